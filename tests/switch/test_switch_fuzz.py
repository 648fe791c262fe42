"""Fuzz: thousands of malformed, foreign, truncated and oversized packets (scapy and hypothesis)
interleaved with a valid allreduce session. The switch keeps running, counts every bad packet
exactly as the independent reference model does, and the valid session completes correctly --
as datagrams, as Ethernet frames, and over real sockets with the event loop."""

from __future__ import annotations

import random
import socket
import time

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw, fuzz
from switch_reference import ReferenceSwitch
from switch_setup import LANES, SESSIONS, SLOTS, agg_packet, heartbeat, runtime

from luwu.dataplane.integrity import sealed
from luwu.dataplane.protocol import HEADER_LEN, VERSION, DropReason, Event, Flag, MsgType, Packet
from luwu.dataplane.scapy_layer import Luwu
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

PHASES = 12
POOL = SESSIONS[1][1]  # session 1's aggregation slots


def valid_session(seed: int):
    """Session 1 (3 workers, pool 4): PHASES phases of ALLREDUCE and their expected sums."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2**31, 2**31, (PHASES, 3, LANES)).astype(np.int32)
    # every third phase one worker contributes zeros as a header-only ZERO packet (protocol.md 3.2)
    for s in range(0, PHASES, 3):
        x[s, s % 3] = 0
    items = [(r + 1, zero_packet(1, r, s) if s % 3 == 0 and r == s % 3 else agg_packet(1, r, s, x[s, r]))
             for s in range(PHASES) for r in range(3)]
    return items, x.sum(axis=1, dtype=np.int32)


def zero_packet(session: int, worker: int, seq: int, *, mtype: int = MsgType.ALLREDUCE, dtype: int = 0) -> bytes:
    """A header-only ZERO contribution (INT32 unless `dtype` says otherwise)."""
    return agg_packet(session, worker, seq, [], mtype=mtype, flags=Flag.ZERO, dtype=dtype)[:HEADER_LEN]


def harmless(data: bytes) -> bytes:
    """Junk must not be a valid contribution to the session under test (it would change its sums)."""
    if len(data) >= 8 and data[0] >> 4 == VERSION and data[0] & 0xF in (MsgType.ALLREDUCE, MsgType.GRAD) \
            and int.from_bytes(data[2:4], "big") == 1:
        return data[:2] + (77).to_bytes(2, "big") + data[4:]
    return data


def resealed(data: bytes, rnd: random.Random) -> bytes:
    """Most junk gets a matching header check, so it reaches the checks past the parser (the
    rest is dropped BAD_CHECKSUM, docs/protocol.md 3.5)."""
    return sealed(data) if len(data) >= HEADER_LEN and rnd.random() < 0.8 else data


def scapy_luwu(rnd: random.Random) -> bytes:
    """A fuzzed luwu header (random field values) with a random-length payload."""
    random.seed(rnd.getrandbits(32))  # scapy's fuzz() draws from the global random module
    return bytes(fuzz(Luwu())) + bytes(rnd.getrandbits(8) for _ in range(rnd.choice([0, 4, 31, 4 * LANES, 200])))


@st.composite
def junk(draw):
    kind = draw(st.sampled_from(["bytes", "scapy", "mutate", "truncate", "oversize", "foreign", "zero"]))
    rnd = draw(st.randoms(use_true_random=False))
    if kind == "bytes":
        data = draw(st.binary(max_size=300))
    elif kind == "scapy":  # drawn in the test body: scapy's fuzz() uses the global random module
        return draw(st.integers(1, 4)), rnd.getrandbits(32)
    elif kind == "mutate":
        data = bytearray(agg_packet(rnd.choice([1, 2, 3, 77]), rnd.choice([0, 1, 2, 9]), rnd.randrange(16),
                                    [1] * LANES, mtype=rnd.choice(list(MsgType))))
        for _ in range(rnd.randrange(1, 4)):
            data[rnd.randrange(len(data))] = rnd.getrandbits(8)
        data = bytes(data)
    elif kind == "truncate":
        full = agg_packet(1, rnd.randrange(3), rnd.randrange(PHASES), [1] * LANES)
        data = full[:rnd.randrange(len(full))]
    elif kind == "zero":  # header-only ZERO packets: valid or not by type and dtype, some with a payload
        data = zero_packet(2, rnd.choice([0, 1, 2]), rnd.randrange(16), mtype=rnd.choice(list(MsgType)),
                           dtype=rnd.choice([0, 0, 1, 4, 5]))
        data += bytes(rnd.choice([0, 0, 0, 4, 4 * LANES]))
    elif kind == "oversize":
        data = agg_packet(2, 0, 0, [1] * LANES) + bytes(rnd.choice([4, 1000, 60000]))
    else:  # a well-formed packet of a session or worker the switch does not know
        data = agg_packet(rnd.choice([77, 1023]), 0, 0, [1] * LANES) if rnd.random() < 0.5 else heartbeat(1, 9, 1, 1)
    return draw(st.integers(1, 4)), resealed(harmless(data), rnd)


def check_results(out, expected) -> None:
    results = {}
    for _, d in out:
        p = Packet.unpack(d)
        if p.session == 1 and p.type == MsgType.RESULT:
            results.setdefault(p.seq, []).append(p.lanes().tolist())
    assert sorted(results) == list(range(PHASES))
    for seq, copies in results.items():
        assert len(copies) == 3 and all(c == expected[seq].tolist() for c in copies)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(junk(), min_size=100, max_size=250), st.randoms(use_true_random=False))
def test_datagram_fuzz_matches_reference_and_session_completes(bad, rnd):
    good, expected = valid_session(rnd.getrandbits(16))
    items = [(p, resealed(harmless(scapy_luwu(random.Random(d))), random.Random(d)) if isinstance(d, int) else d)
             for p, d in bad]
    for it in good:  # the valid packets keep their order, junk lands in between
        items.insert(rnd.randrange(len(items) + 1), it)
    # keep the valid packets in order: re-sort them into the positions they landed in
    pos = [i for i, it in enumerate(items) if it in good]
    for i, it in zip(pos, good):
        items[i] = it
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    sw.load_runtime(runtime())
    ref = ReferenceSwitch(LANES, SLOTS)
    ref.load(runtime())
    out = []
    i = 0
    while i < len(items):  # random batch sizes, as the event loop would see
        k = rnd.randint(1, 64)
        out += sw.process_datagrams(items[i:i + k])
        i += k
    assert out == [o for p, d in items for o in ref.process(p, d)]
    c = sw.counters()
    assert {k: c[k] for k in ("drops", "events", "rx_types", "session_packets")} == ref.counters()
    check_results(out, expected)


def frame(data: bytes, sport: int = 19541, dport: int = 19541) -> bytes:
    return bytes(Ether(src="02:00:00:00:01:01", dst="02:00:00:00:00:fe") / IP(src="10.0.1.1", dst="10.0.0.254")
                 / UDP(sport=sport, dport=dport) / Raw(data))


def test_frame_fuzz_with_scapy_keeps_the_session_correct():
    rnd = random.Random(11)
    bad = []
    for i in range(3000):
        k = i % 6
        if k == 0:
            bad.append(frame(resealed(harmless(scapy_luwu(rnd)), rnd)))
        elif k == 1:  # truncated anywhere, including inside Ethernet/IP/UDP
            f = frame(agg_packet(1, 0, 0, [1] * LANES))
            bad.append(f[:rnd.randrange(len(f))])
        elif k == 2:  # oversized jumbo frame with a lying UDP length
            f = bytearray(frame(agg_packet(2, 0, 0, [1] * LANES)) + bytes(9000))
            bad.append(bytes(f))
        elif k == 3:
            bad.append(bytes(Ether() / ARP()) if rnd.random() < 0.5 else bytes(rnd.getrandbits(8) for _ in range(60)))
        elif k == 4:  # IPv4 with a wrong length field or IHL
            f = bytearray(frame(agg_packet(2, 0, 0, [1] * LANES)))
            f[14] = 0x40 | rnd.randrange(0, 5) if rnd.random() < 0.5 else f[14]
            f[16:18] = rnd.getrandbits(16).to_bytes(2, "big")
            bad.append(bytes(f))
        else:
            bad.append(frame(harmless(bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(200))))))
    good, expected = valid_session(5)
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    sw.load_runtime(runtime())
    out = []
    gi = 0
    for i in range(0, len(bad), 100):
        batch = [(rnd.randint(1, 4), f) for f in bad[i:i + 100]]
        for _ in range(2):
            if gi < len(good):
                batch.insert(rnd.randrange(len(batch) + 1), (good[gi][0], frame(good[gi][1])))
                gi += 1
        out += sw.process_frames(batch)
    while gi < len(good):
        out += sw.process_frames([(good[gi][0], frame(good[gi][1]))])
        gi += 1
    datagrams = [(p, bytes(Ether(f)[UDP].payload)) for p, f in out]
    check_results(datagrams, expected)
    c = sw.counters()
    assert sum(v[0] for v in c["drops"].values()) >= 2500  # nearly every junk frame is refused and counted
    assert c["events"][int(Event.COMPLETED)][0] == PHASES


def test_socket_fuzz_switch_keeps_serving():
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    sw.load_runtime(runtime())
    socks = []
    try:
        for r in range(3):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
            socks.append(s)
            s.connect(sw.attach_udp(r + 1, ("127.0.0.1", 0), peer=s.getsockname()))
        sw.start()
        rnd = random.Random(3)
        good, expected = valid_session(9)
        sent_bad = 0
        got: dict[int, list] = {r: [] for r in range(3)}

        def drain() -> None:  # read as a worker would: a full receive buffer loses results in the kernel
            for r, s in enumerate(socks):
                while True:
                    try:
                        got[r].append(Packet.unpack(s.recv(65536)))
                    except BlockingIOError:
                        break

        def results(r: int) -> set[int]:
            return {p.seq for p in got[r] if p.type == MsgType.RESULT}

        for k, (port, data) in enumerate(good):
            # as a worker would, send phase s only once phase s - POOL is complete (its slot is free
            # again): a switch thread starved of the GIL could otherwise take a later phase's packet
            # in the same turn before an earlier phase's last one, and the slot would see the reuse first
            wait_for = k // 3 - POOL
            until = time.monotonic() + 20
            while wait_for >= 0 and time.monotonic() < until and not all(wait_for in results(r) for r in range(3)):
                drain()
                time.sleep(0.001)
            for _ in range(60):  # junk from the same (valid) peers, so it reaches the pipeline
                s = socks[rnd.randrange(3)]
                try:
                    s.send(harmless(scapy_luwu(rnd)) if rnd.random() < 0.5 else bytes(rnd.getrandbits(8) for _ in
                                                                                    range(rnd.randrange(80))))
                    sent_bad += 1
                except BlockingIOError:
                    pass
            socks[port - 1].send(data)
            time.sleep(0.001)
            drain()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(len(results(r)) < PHASES for r in range(3)):
            drain()
            time.sleep(0.001)
        for r in range(3):
            by_seq = {p.seq: p.lanes().tolist() for p in got[r] if p.type == MsgType.RESULT}
            assert sorted(by_seq) == list(range(PHASES)), f"worker {r} got {sorted(by_seq)}"
            assert all(by_seq[s] == expected[s].tolist() for s in by_seq)
        c = sw.counters()
        assert sw.errors == 0
        assert sum(v[0] for v in c["drops"].values()) >= 0.8 * sent_bad
        assert c["drops"][int(DropReason.UNKNOWN_PORT)][0] == 0
    finally:
        sw.stop()
        for s in socks:
            s.close()
