"""`luwu bench fuzz` in small: hostile packets against a running switch (its own process, UDP
ports with configured peers) while two live jobs stream ALLREDUCE phases. Every honest sum is
exact, no phase hangs, and every drop is the one the bench's independent model predicts, reason
by reason. Plus the two holes the fuzz found, each pinned on its own: a datagram longer than the
switch's receive buffer is never taken for its prefix, and a node never completes a fallback sum
from ranks its job does not have."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from luwu.bench.fuzz import fuzz, ok
from luwu.bench.fuzz_model import KINDS, Topology
from luwu.dataplane.engine.node_server import FallbackAggregator
from luwu.dataplane.protocol import (
    DropReason,
    Event,
    Flag,
    MsgType,
    Packet,
    aggregation_packet_len,
    header_view,
    ver_type,
)
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig


@pytest.mark.slow
def test_fuzz_bench_keeps_sums_exact_and_accounts_for_every_drop():
    r = fuzz(20_000, workers=3, seed=7)
    live, acc = r["live"], r["accounting"]
    assert r["attack"]["sent"] == 20_000 and set(r["attack"]["by_kind"]) == set(KINDS)
    assert live["results_checked"] > 0 and all(j["phases_completed"] > 0 for j in live["jobs"].values())
    assert live["wrong"] == 0 and live["hangs"] == 0 and live["unexpected"] == 0
    assert acc["failures"] == [], acc["failures"]
    for reason, row in acc["drops"].items():  # the switch's count of every reason is the model's
        assert row["switch"] == row["predicted"], reason
    drops = r["switch"]["drops"]
    for reason in ("MALFORMED", "BAD_VERSION", "BAD_TYPE", "UNKNOWN_SESSION", "UNKNOWN_WORKER", "SPOOFED",
                   "UNKNOWN_PORT"):  # the mix reaches every check, not just the first
        assert drops[reason] > 0, reason
    assert r["named"]["forged_sums_at_honest_node"] == 0
    assert ok(r)


def _one_rank_switch(max_datagram: int):
    topo = Topology(1, 64, 16)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.settimeout(10)
    sw = SoftwareSwitch(SwitchConfig(lanes=topo.lanes, slots=topo.slots, max_datagram=max_datagram))
    addr = sw.attach_udp(1, ("127.0.0.1", 0), peer=peer.getsockname())
    rt = topo.runtime()  # session 1 alone: one rank, so every contribution completes a sum
    sw.load_runtime({"table_entries": [e for e in rt["table_entries"] if e["match"].get("session") == 1],
                     "multicast_group_entries": [g for g in rt["multicast_group_entries"]
                                                 if g["multicast_group_id"] == 1]})
    sw.start()
    return sw, peer, addr


def test_a_datagram_longer_than_the_receive_buffer_is_malformed_not_its_prefix():
    lanes = 64
    sw, peer, addr = _one_rank_switch(max_datagram=aggregation_packet_len(lanes))
    try:
        pkt = Packet(MsgType.ALLREDUCE, 1, 0, 0, lanes, 0, 0, 0, 0, 0, 0, 0,
                     payload=np.full(lanes, 5, ">i4").tobytes()).pack()
        peer.sendto(pkt + b"\xff" * 3000, addr)  # the kernel hands the switch exactly a valid-looking prefix
        peer.sendto(pkt, addr)
        result = Packet.unpack(peer.recv(65536))  # the exact-length packet completes the sum
        assert result.type == MsgType.RESULT and result.lanes().tolist() == [5] * lanes
        deadline = time.monotonic() + 10
        while sw.counters()["drops"][int(DropReason.MALFORMED)][0] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        c = sw.counters()
        assert c["drops"][int(DropReason.MALFORMED)][0] == 1
        assert c["events"][int(Event.COMPLETED)][0] == 1
    finally:
        sw.stop()
        peer.close()


def test_node_fallback_sums_take_only_the_jobs_ranks():
    lanes, n = 8, 3
    rows = np.zeros((n + 3, 32 + 4 * lanes), dtype=np.uint8)
    h = header_view(rows)
    h["ver_type"], h["flags"] = ver_type(MsgType.GRAD), int(Flag.FALLBACK)
    h["session"], h["count"], h["seq"] = 5, lanes, 7
    h["worker"] = [100, 101, 65534, 0, 1, 2]  # three forged ranks first, then the job's three
    rows[:, 32:] = np.arange(1, n + 4, dtype=">i4").repeat(lanes).reshape(n + 3, lanes).view(np.uint8)
    agg = FallbackAggregator(n, lanes)
    assert agg.absorb(rows, h, np.arange(3)) == [] and agg.rejected == 3
    done = agg.absorb(rows, h, np.arange(3, 6))
    assert len(done) == 1
    assert np.frombuffer(done[0][32:].tobytes(), ">i4").tolist() == [4 + 5 + 6] * lanes
