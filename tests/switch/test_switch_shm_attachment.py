"""Shared-memory attachment end to end: the switch's event loop in a thread (or a child process)
with ring pairs in /dev/shm, endpoints on `ShmEndpoint` (the engine's side of the rings):
the ring itself (wrap-around, full ring, doorbell, oversize, the row copy, rows lent to the
endpoint until its next receive), exact sums, counters equal to the
UDP attachment's for the same traffic, simulated loss, a dead switch or endpoint named, and no
files left behind."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from switch_setup import LANES, NODE_PORT, SLOTS, agg_packet, heartbeat, param, runtime

from luwu.dataplane.net.shm_endpoint import ShmEndpoint
from luwu.dataplane.net.shm_ring import RingBusy, ShmRing, copy_rows, supported
from luwu.dataplane.protocol import NODE, DropReason, Event, Flag, MsgType, Packet
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")

DEADLINE = 20.0  # s, an upper bound for any exchange (never an assertion on speed)
PORTS = (1, 2, 3, NODE_PORT)


def wait_for(pred, what: str):
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


def rows_of(datas: list[bytes], width: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.zeros((len(datas), width), dtype=np.uint8)
    for i, d in enumerate(datas):
        rows[i, :len(d)] = np.frombuffer(d, dtype=np.uint8)
    return rows, np.array([len(d) for d in datas], dtype=np.int64)


class ShmPeer:
    """A test endpoint on a shared-memory port (the product's endpoint side, driven by hand)."""

    def __init__(self, prefix: str):
        self.ep = ShmEndpoint(prefix)

    def send(self, *datas: bytes) -> None:
        rows, lengths = rows_of(list(datas), self.ep.up.row_bytes)
        assert self.ep.send_rows(rows, np.arange(len(datas)), lengths) == len(datas)

    def recv_all(self) -> list[Packet]:
        out = []
        while k := self.ep.recv():
            out += [Packet.unpack(self.ep.rx[i, :self.ep.rx_len[i]].tobytes()) for i in range(k)]
        return out

    def close(self):
        self.ep.close()


class UdpPeer:
    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.addr = self.sock.getsockname()
        self.switch = None

    def send(self, *datas: bytes) -> None:
        for d in datas:
            self.sock.sendto(d, self.switch)

    def recv_all(self) -> list[Packet]:
        out = []
        while True:
            try:
                out.append(Packet.unpack(self.sock.recv(65536)))
            except BlockingIOError:
                return out

    def close(self):
        self.sock.close()


def make_star(kind: str):
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=3))
    if kind == "shm":
        peers = {p: ShmPeer(sw.attach_shm(p)) for p in PORTS}
    else:
        peers = {p: UdpPeer() for p in PORTS}
        for p, peer in peers.items():  # each UDP port knows its peer, as each shm port knows its ring
            peer.switch = sw.attach_udp(p, ("127.0.0.1", 0), peer=peer.addr)
    sw.load_runtime(runtime())
    sw.start()
    return sw, peers


@pytest.fixture
def star():
    sw, peers = make_star("shm")
    yield sw, peers
    sw.stop()
    for p in peers.values():
        p.close()


# -- the ring ------------------------------------------------------------------------------------
def test_ring_wraps_fills_and_rings_its_doorbell(tmp_path):
    path = f"/dev/shm/luwu-test-{os.getpid()}-{time.monotonic_ns()}"
    prod = ShmRing(path, "producer", slots=8, row_bytes=64, create=True)
    cons = ShmRing(path, "consumer")
    try:
        rows = np.arange(20 * 64, dtype=np.uint32).astype(np.uint8).reshape(20, 64)
        out = np.zeros((20, 64), dtype=np.uint8)
        lens = np.zeros(20, dtype=np.int64)
        poller = select.poll()
        poller.register(cons.fd, select.POLLIN)
        assert cons.pop_into(out, lens, 0, 8) == 0 and cons.arm() and poller.poll(0) == []  # empty: may sleep
        got = 0
        for first in range(0, 20, 5):  # batches of 5 through 8 slots: every batch after the first wraps
            n, too_long, nbytes = prod.push_rows(rows, np.arange(first, first + 5), np.full(5, 60))
            assert (n, too_long, nbytes) == (5, 0, 300)
            assert poller.poll(0), "a batch published to an armed (sleeping) consumer must ring"
            assert not cons.arm(), "arming a ring that holds packets says: do not sleep"
            got += cons.pop_into(out, lens, got, 20)
            assert cons.arm() and poller.poll(0) == [], "armed again on an empty ring: doorbell drained"
        # a packet is its `length` bytes; the rest of a row is not copied (shm_ring.py)
        assert got == 20 and np.array_equal(out[:, :60], rows[:, :60]) and (lens == 60).all()
        prod.push_rows(rows, np.arange(3), np.full(3, 60))
        assert cons.pop_into(out, lens, 0, 1) == 1  # a busy consumer (it found packets) ...
        cons.drain()
        prod.push_rows(rows, np.arange(3), np.full(3, 60))
        assert poller.poll(0) == [], "... is not rung: no system call per batch while it keeps up"
        assert cons.pop_into(out, lens, 0, 20) == 5 and cons.pop_into(out, lens, 0, 20) == 0
        n, _, _ = prod.push_rows(rows, np.arange(20), np.full(20, 64))
        assert n == 8, "a full ring takes no more than its slots"
        n, too_long, _ = prod.push_rows(rows, np.arange(2), np.array([65, 10]))
        assert (n, too_long) == (0, 1), "an oversize packet is refused; the other does not fit a full ring"
        assert cons.pop_into(out, lens, 0, 20) == 8 and cons.pop_into(out, lens, 0, 20) == 0
        assert cons.peer_alive() is True and prod.peer_alive() is True  # both sides are this process
    finally:
        cons.close()
        prod.close()
    assert not os.path.exists(path) and not os.path.exists(path + ".bell")


def test_copy_rows_is_a_row_gather():
    """shm_ring.copy_rows (slices per run of consecutive rows) copies exactly what a fancy-index
    gather does, for scattered, consecutive and repeated rows and part-width copies."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (40, 96), dtype=np.uint8)
    for idx in (np.arange(7, 19), np.array([3, 4, 5, 9, 10, 2, 2, 39]), np.array([0]), np.array([], dtype=np.int64),
                rng.integers(0, 40, 25)):
        for off, used in ((0, 96), (8, 64), (32, 1)):
            dst = np.full((30, 96), 0xA5, dtype=np.uint8)
            want = dst.copy()
            want[4:4 + len(idx), :used] = src[idx, off:off + used]
            copy_rows(dst, 4, src, idx, off, used)
            assert np.array_equal(dst, want), (idx, off, used)


def test_endpoint_lends_rows_until_its_next_receive(tmp_path):
    """ShmEndpoint.recv() hands out the ring's own rows (no copy): the switch cannot overwrite them
    until the endpoint's next recv() or arm() gives them back, and then it can."""
    prefix = f"/dev/shm/luwu-test-{os.getpid()}-{time.monotonic_ns()}"
    down = ShmRing(prefix + ".down", "producer", slots=8, row_bytes=64, create=True)
    up = ShmRing(prefix + ".up", "consumer", slots=8, row_bytes=64, create=True)
    ep = ShmEndpoint(prefix, batch=4)
    try:
        rows = np.arange(16 * 64, dtype=np.uint32).astype(np.uint8).reshape(16, 64)
        assert down.push_rows(rows, np.arange(8), np.full(8, 64))[0] == 8
        assert ep.recv() == 4 and np.array_equal(ep.rx[:4], rows[:4]) and (ep.rx_len[:4] == 64).all()
        assert down.push_rows(rows, np.arange(8, 12), np.full(4, 64))[0] == 0, "lent rows are not free"
        assert ep.recv() == 4 and np.array_equal(ep.rx[:4], rows[4:8])  # gives the first four back
        assert down.push_rows(rows, np.arange(8, 12), np.full(4, 64))[0] == 4
        assert not ep.arm(), "arming gives the lent rows back and sees the new packets"
        assert ep.recv() == 4 and np.array_equal(ep.rx[:4], rows[8:12])
        assert down.push_rows(rows, np.arange(12, 16), np.full(4, 64))[0] == 4
        assert ep.recv() == 4 and np.array_equal(ep.rx[:4], rows[12:16])
        assert ep.recv() == 0 and ep.arm() and down.pending() == 0
        assert ep.stats["rx_packets"] == 16
    finally:
        ep.close()
        up.close()
        down.close()


def test_a_port_takes_one_endpoint_process():
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    prefix = sw.attach_shm(1)
    code = ("import sys\nfrom luwu.dataplane.net.shm_endpoint import ShmEndpoint\n"
            f"e = ShmEndpoint({prefix!r}); print('attached', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "attached"
        with pytest.raises(RingBusy, match=f"process {holder.pid}, which is alive"):
            ShmEndpoint(prefix)  # a second consumer would corrupt a single-consumer ring
    finally:
        holder.stdin.close()
        holder.wait(30)
    ShmEndpoint(prefix).close()  # the holder exited: the port takes a new endpoint (a restarted engine)
    sw.stop()


def test_endpoint_refuses_paths_outside_dev_shm_and_missing_ports(tmp_path):
    with pytest.raises(ValueError, match="/dev/shm"):
        ShmEndpoint(str(tmp_path / "ring"))
    with pytest.raises(ConnectionRefusedError, match="no switch port"):
        ShmEndpoint(f"/dev/shm/luwu-test-missing-{os.getpid()}")


# -- the switch over rings ---------------------------------------------------------------------------
def test_allreduce_grad_param_and_heartbeats_over_shm(star):
    sw, peers = star
    workers = [peers[1], peers[2], peers[3]]
    node = peers[NODE_PORT]
    rng = np.random.default_rng(0)
    x = rng.integers(-2**31, 2**31, (10, 3, LANES)).astype(np.int32)
    got = {r: {} for r in range(3)}

    def results(upto):
        for r, w in enumerate(workers):
            for p in w.recv_all():
                got[r][p.seq] = p
        return all(len(v) >= upto for v in got.values())
    for first in range(0, 10, 4):  # the protocol's window: at most pool_size phases in flight
        for r, w in enumerate(workers):  # a batch of packets per endpoint: one ring push
            w.send(*[agg_packet(1, r, seq, x[seq, r]) for seq in range(first, min(first + 4, 10))])
        upto = min(first + 4, 10)
        wait_for(lambda upto=upto: results(upto), f"RESULTs up to seq {upto}")
    for r in range(3):
        for seq, p in got[r].items():  # exact int32 sums, wrapping like the switch's registers
            assert p.type == MsgType.RESULT and p.lanes().tolist() == x[seq].sum(axis=0, dtype=np.int32).tolist()
    for r, w in enumerate(workers):
        w.send(agg_packet(2, r, 0, x[0, r], mtype=MsgType.GRAD), heartbeat(2, r, 5 + r, 50 + r))
    agg, hbs = [], []

    def at_node():
        for p in node.recv_all():
            (agg if p.type == MsgType.AGG else hbs).append(p)
        return agg and hbs
    wait_for(at_node, "AGG and the heartbeat round at the node")
    assert agg[0].lanes().tolist() == x[0].sum(axis=0, dtype=np.int32).tolist()
    assert (hbs[0].ack, hbs[0].credit) == (5, 50)
    node.send(param(2, count=4, dtype=1, pull_id=3))
    seen = {r: [] for r in range(3)}

    def params():
        for r, w in enumerate(workers):
            seen[r] += [p for p in w.recv_all() if p.type == MsgType.PARAM]
        return all(seen.values())
    wait_for(params, "PARAM at every worker")
    assert all(v[0].slot == 3 and v[0].count == 4 for v in seen.values())
    c = sw.counters()
    assert c["events"][int(Event.COMPLETED)][0] == 11 and sw.errors == 0
    assert all(c["ports"][p]["rx_packets"] >= 1 for p in PORTS)


def _phases(workers, readers, x, seqs, got):
    """Every worker contributes phases `seqs` of session 1 (a pool's worth at a time); `readers`
    (ranks) collect their RESULTs into got[rank][seq]."""
    seqs = list(seqs)
    for first in range(0, len(seqs), 4):  # the session's slot pool: 4 phases in flight
        batch = seqs[first:first + 4]
        for r, w in enumerate(workers):
            w.send(*[agg_packet(1, r, seq, x[seq, r]) for seq in batch])

        def done(batch=batch):
            for r in readers:
                for p in workers[r].recv_all():
                    got[r][p.seq] = p
            return all(seq in got[r] for r in readers for seq in batch)
        wait_for(done, f"RESULTs of phases {batch}")


def test_multicast_rows_are_written_once_into_a_pool_and_referenced_from_every_ring(star):
    sw, peers = star
    workers = [peers[1], peers[2], peers[3]]
    x = np.random.default_rng(1).integers(-2**31, 2**31, (12, 3, LANES)).astype(np.int32)
    got = {r: {} for r in range(3)}
    _phases(workers, range(3), x, range(12), got)
    for r in range(3):
        assert sorted(got[r]) == list(range(12))
        for seq, p in got[r].items():
            assert p.type == MsgType.RESULT and p.lanes().tolist() == x[seq].sum(axis=0, dtype=np.int32).tolist()
    pools = {pid for w in workers for pid in w.ep._pools}  # every endpoint read them from one pool
    assert len(pools) == 1 and all(len(w.ep._pools) == 1 for w in workers)
    assert all(sw.counters()["ports"][p]["tx_packets"] == 12 for p in (1, 2, 3))


def test_a_turn_takes_at_most_its_share_of_each_ring_and_the_rest_in_the_next_turns(monkeypatch):
    """A shared-memory port gives a turn at most SHM_TURN_BYTES of packets (loop.py: a smaller
    turn sends its results sooner); the rest of a ring's backlog goes into the next turns without
    waiting for a doorbell, and every sum is exact."""
    from luwu.dataplane.switch import loop

    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=3))
    peers = {p: ShmPeer(sw.attach_shm(p)) for p in PORTS}
    monkeypatch.setattr(loop, "SHM_TURN_BYTES", 2 * peers[1].ep.up.row_bytes)  # two packets a ring a turn
    taken: list[int] = []  # packets each ring gave each turn
    handle_turn = sw.handle_turn

    def recording(rx, segments):
        taken.extend(z - a for _, a, z in segments)
        handle_turn(rx, segments)
    sw.handle_turn = recording
    sw.load_runtime(runtime())
    sw.start()
    try:
        workers = [peers[1], peers[2], peers[3]]
        x = np.random.default_rng(2).integers(-2**31, 2**31, (12, 3, LANES)).astype(np.int32)
        got: dict[int, dict] = {r: {} for r in range(3)}
        _phases(workers, range(3), x, range(12), got)  # each worker pushes 4 packets at once, 3 times
    finally:
        sw.stop()
        for p in peers.values():
            p.close()
    for r in range(3):
        assert sorted(got[r]) == list(range(12))
        for seq, p in got[r].items():
            assert p.type == MsgType.RESULT and p.lanes().tolist() == x[seq].sum(axis=0, dtype=np.int32).tolist()
    assert sum(taken) == 36 and max(taken) == 2, taken  # a backlog of 4 split over turns, none lost
    assert sw.errors == 0


def test_a_reader_that_stops_does_not_block_the_others_and_keeps_its_rows(star, monkeypatch):
    """Rank 2 stops reading: its references pin the pool's rows, so once the pool is full the
    multicast goes inline to every ring (the others are served), and the rows it was referenced
    are never reused under it: when it reads again, every RESULT is exact."""
    from luwu.dataplane.switch import attach_shm

    monkeypatch.setattr(attach_shm, "default_slots", lambda row: 8)  # a small pool (made lazily)
    sw, peers = star
    workers = [peers[1], peers[2], peers[3]]
    x = np.random.default_rng(2).integers(-2**31, 2**31, (40, 3, LANES)).astype(np.int32)
    got = {r: {} for r in range(3)}
    _phases(workers, (0, 1), x, range(40), got)
    assert sw._pools is not None and next(iter(sw._pools._pools.values())).slots == 8
    assert sw.ports[3].tx.pending() == 40  # all on rank 2's ring, unread
    for p in workers[2].recv_all():
        got[2][p.seq] = p
    for r in range(3):
        assert sorted(got[r]) == list(range(40)), r
        for seq, p in got[r].items():
            assert p.lanes().tolist() == x[seq].sum(axis=0, dtype=np.int32).tolist(), (r, seq)
    assert workers[2].ep._pools  # it did read some of them from the pool


def test_the_pool_rows_of_an_endpoint_that_exited_are_reused(monkeypatch):
    """Port 3's endpoint process exits without reading: its references no longer pin the pool
    (a new endpoint on the port skips them), so the multicast keeps going through the pool."""
    from luwu.dataplane.switch import attach_shm

    monkeypatch.setattr(attach_shm, "default_slots", lambda row: 8)
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=3))
    prefixes = {p: sw.attach_shm(p, slots=64) for p in PORTS}
    peers = {p: ShmPeer(prefixes[p]) for p in (1, 2, NODE_PORT)}
    subprocess.run([sys.executable, "-c", "from luwu.dataplane.net.shm_endpoint import ShmEndpoint\n"
                    f"ShmEndpoint({prefixes[3]!r})"], check=True, timeout=DEADLINE)  # attaches, exits
    rank2 = ShmRing(prefixes[3] + ".up", "producer")  # its sends now come from here (the producer died)
    sw.load_runtime(runtime())
    sw.start()
    try:
        class Rank2:
            def send(self, *datas):
                rows, lengths = rows_of(list(datas), rank2.row_bytes)
                assert rank2.push_rows(rows, np.arange(len(datas)), lengths)[0] == len(datas)

        workers = [peers[1], peers[2], Rank2()]
        x = np.random.default_rng(3).integers(-2**31, 2**31, (40, 3, LANES)).astype(np.int32)
        got = {0: {}, 1: {}}
        _phases(workers, (0, 1), x, range(40), got)
        for r in (0, 1):
            assert [got[r][seq].lanes().tolist() for seq in range(40)] == \
                [x[seq].sum(axis=0, dtype=np.int32).tolist() for seq in range(40)]
        pool = next(iter(sw._pools._pools.values()))
        assert pool.head == 40  # every RESULT went through the 8-row pool: rows were reused
    finally:
        sw.stop()
        rank2.close()
        for p in peers.values():
            p.close()


def test_references_to_a_pool_that_is_gone_are_lost_packets(star):
    """A switch that stopped removed its pools: references an endpoint had not read yet are lost
    packets (counted), never rows of something else, and the ring is empty afterwards (no spin)."""
    sw, peers = star
    workers = [peers[1], peers[2], peers[3]]
    x = np.ones((4, 3, LANES), dtype=np.int32)
    for r, w in enumerate(workers):
        w.send(*[agg_packet(1, r, seq, x[seq, r]) for seq in range(4)])
    wait_for(lambda: sw.ports[1].tx.pending() == 4, "four RESULTs on rank 0's ring")
    pool = next(iter(sw._pools._pools.values()))
    os.unlink(pool.shm.path)  # as a stopped switch leaves it (its endpoint had not mapped it yet)
    assert workers[0].recv_all() == [] and workers[0].ep.stats["rx_lost"] == 4
    assert workers[0].ep.arm()  # nothing left: the endpoint may sleep


def _scripted_traffic(sw, peers) -> dict:
    """The same packets, phase by phase, on either attachment; returns the switch's counters."""
    w = [peers[1], peers[2], peers[3]]
    node = peers[NODE_PORT]
    x = np.arange(4 * 3 * LANES, dtype=np.int64).reshape(4, 3, LANES) * 1_000_003

    def settle(pred, what):
        wait_for(pred, what)

    # valid packets first, so UDP ports learn their peers the way shm ports know theirs
    node.send(heartbeat(2, NODE, 0, 64))
    settle(lambda: sw.counters()["ports"].get(NODE_PORT, {}).get("rx_packets", 0) == 1, "the node's heartbeat")
    for seq in range(4):
        for r in range(3):
            w[r].send(agg_packet(1, r, seq, x[seq, r]))
    settle(lambda: sw.counters()["events"][int(Event.COMPLETED)][0] == 4, "four completed phases")
    w[0].send(agg_packet(1, 0, 2, x[2, 0], flags=Flag.RETX))  # a retransmission of a completed slot
    w[1].send(b"\x13" * 20)  # malformed
    w[2].send(heartbeat(2, NODE, 1, 2))  # the node's id on a worker's port: the source guard
    w[2].send(agg_packet(1, 1, 5, x[0, 1]))  # rank 1's id on rank 2's port
    w[0].send(agg_packet(9, 0, 0, x[0, 0]))  # unknown session
    settle(lambda: sum(v[0] for v in sw.counters()["drops"].values()) >= 4, "the bad packets")
    for r in range(3):
        w[r].send(agg_packet(2, r, 0, x[0, r], mtype=MsgType.GRAD), heartbeat(2, r, 5 + r, 50 + r))
    settle(lambda: sw.counters()["events"][int(Event.COMPLETED)][0] == 5, "the GRAD phase")
    node.send(param(2, count=4, dtype=1, pull_id=3))
    # out to each worker: 4 RESULTs, the node's heartbeat, the PARAM (and to rank 0 the resent RESULT)
    want = {1: 7, 2: 6, 3: 6}
    settle(lambda: all(sw.counters()["ports"].get(p, {}).get("tx_packets", 0) >= n for p, n in want.items()),
           "PARAM out")
    time.sleep(0.1)  # let any straggling emission be counted (the comparison below is exact)
    c = sw.counters()
    ports = {p: {k: v for k, v in s.items() if k in ("rx_packets", "tx_packets")} for p, s in c["ports"].items()}
    return {"drops": c["drops"], "events": c["events"], "rx_types": c["rx_types"],
            "session_packets": c["session_packets"], "ports": ports}


def test_counters_equal_the_udp_attachments_for_the_same_traffic():
    seen = {}
    for kind in ("udp", "shm"):
        sw, peers = make_star(kind)
        try:
            seen[kind] = _scripted_traffic(sw, peers)
        finally:
            sw.stop()
            for p in peers.values():
                p.close()
    assert seen["shm"] == seen["udp"]
    drops = seen["shm"]["drops"]
    assert drops[int(DropReason.MALFORMED)][0] == 1 and drops[int(DropReason.SPOOFED)][0] >= 1
    assert seen["shm"]["events"][int(Event.RESENT)][0] == 1


def test_simulated_loss_on_a_shm_port_is_recovered_by_retransmission(star):
    sw, peers = star
    for p in (1, 2, 3):
        sw.set_drop_sim(p, ingress=0.2, egress=0.2)
    workers = [peers[1], peers[2], peers[3]]
    x = np.arange(3 * LANES, dtype=np.int32).reshape(3, LANES)
    got = {r: {} for r in range(3)}
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline and not all(len(g) == 4 for g in got.values()):
        for r, w in enumerate(workers):  # go back: resend whatever has no result yet
            missing = [agg_packet(1, r, seq, x[r], flags=Flag.RETX) for seq in range(4) if seq not in got[r]]
            if missing:
                w.send(*missing)
        time.sleep(0.02)
        for r, w in enumerate(workers):
            for p in w.recv_all():
                got[r][p.seq] = p.lanes().tolist()
    assert all(len(g) == 4 for g in got.values()), "loss was not recovered"
    assert all(v == x.sum(axis=0).tolist() for g in got.values() for v in g.values())
    assert sw.counters()["drops"][int(DropReason.SIMULATED_LOSS)][0] > 0


def test_a_full_ring_loses_packets_like_a_full_socket_buffer(star):
    sw, peers = star
    att = sw.ports[1]
    slots = att.tx.slots
    rows, lengths = rows_of([heartbeat(2, NODE, i, i) for i in range(slots + 5)], att.tx.row_bytes)
    with sw.lock:  # straight onto port 1's ring, as the event loop's emit would
        sent = att.send_rows(rows, np.arange(len(rows)), lengths)
    assert sent == slots and att.stats["tx_ring_full"] == 5
    assert len(peers[1].recv_all()) == slots


def test_endpoint_and_switch_processes_are_watched(tmp_path):
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    prefix = sw.attach_shm(1)
    try:
        assert sw.ports[1].endpoint_alive() is None  # nobody attached yet
        code = ("from luwu.dataplane.net.shm_endpoint import ShmEndpoint\n"
                f"print(ShmEndpoint({prefix!r}).peer_gone(0.0))")
        out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr  # it saw this (live) switch
        assert sw.ports[1].endpoint_alive() is False, "the endpoint process exited: the switch must see it"
    finally:
        sw.stop()
    assert not any(os.path.exists(prefix + s) for s in (".up", ".down", ".up.bell", ".down.bell"))


def test_rings_of_dead_switch_processes_are_swept():
    from luwu.dataplane.switch.attach_shm import sweep_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True).stdout.strip()
    stale = [f"/dev/shm/luwu-sw-{dead}-0-p1.up", f"/dev/shm/luwu-sw-{dead}-0-p1.up.bell",
             f"/dev/shm/luwu-sw-{dead}-mc3"]  # a multicast pool too
    live = [f"/dev/shm/luwu-sw-{os.getpid()}-999-p1.down",  # this process lives: never swept
            f"/dev/shm/luwu-sw-{os.getpid()}-mc999"]
    for path in stale + live:
        open(path, "w").close()
    try:
        sweep_stale()
        assert not any(os.path.exists(p) for p in stale) and all(os.path.exists(p) for p in live)
    finally:
        for path in stale + live:
            if os.path.exists(path):
                os.unlink(path)


def test_a_killed_switch_process_is_named_and_its_rings_removed():
    from luwu.dataplane.loopback import LoopbackSwitch, StarPlan

    plan = StarPlan(workers=1, mode="tofino", transport="shm")
    with LoopbackSwitch(plan, process=True) as ls:
        prefix = plan.switch_ports[1][0]
        ep = ShmEndpoint(prefix)
        try:
            assert ep.peer_gone(0.0) is None
            pid = ls.pid
            pool = f"/dev/shm/luwu-sw-{pid}-mc999"  # as a multicast pool of the switch would be named
            open(pool, "w").close()
            ls.kill()
            msg = ep.peer_gone(1.0)
            assert msg is not None and f"pid {pid}" in msg and prefix in msg
        finally:
            ep.close()
        assert not os.path.exists(prefix + ".up"), "the parent removes the rings a killed switch left"
    assert not os.path.exists(pool), "and its multicast pools"
