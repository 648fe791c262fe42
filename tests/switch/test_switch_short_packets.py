"""Aggregation packets shorter than the switch's lanes (docs/protocol.md 3.3, issue 29): a packet
carries the fewest whole chunks of LANE_CHUNK lanes its count needs; the switch sums the lanes
present, emits what the packet triggers (a completion, a resend) at the packet's own length, and
drops any other length as MALFORMED, on every path a batch can take (one packet a turn, a small
turn, a vectorised batch). A switch of 200 lanes: three whole chunks and a whole packet of 200
(not a multiple of the chunk: its last length is the whole packet's).

The 64-lane programs (BMv2, Tofino) have one chunk, so their conformance vectors cannot hold a
short packet; these run the software switch alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from switch_setup import SLOTS, runtime, worker_port

from luwu.dataplane.integrity import fixed16_blocks, wire_lanes, wire_len
from luwu.dataplane.protocol import HEADER_LEN, LANE_CHUNK, DropReason, Dtype, Flag, MsgType, Packet, slot_for
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig, pipeline
from luwu.dataplane.switch.batch import Batch

LANES = 3 * LANE_CHUNK + 8
RANKS = (0, 1, 2)  # session 1: pool [0, 4), three workers, multicast group 1


def packet(worker: int, seq: int, count: int, lanes, *, dtype: int = Dtype.FIXED32, flags: int = 0) -> bytes:
    """Rank `worker`'s ALLREDUCE of session 1 with `count` elements and payload `lanes` (int32 lanes
    for every dtype, FIXED16's two int16 values a lane; as many as given: the test chooses the length)."""
    slot, set_ = slot_for(seq, 0, 4)
    body = np.asarray(lanes, dtype=np.int64).astype(">i4").tobytes()
    return Packet(MsgType.ALLREDUCE, 1, worker, flags | (Flag.SET if set_ else 0), count, seq, slot, 9,
                  seq * LANES, 0, int(dtype), 1000, payload=body).pack()


def switch() -> SoftwareSwitch:
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=1))
    sw.load_runtime(runtime())
    return sw


def contribution(rng: np.random.Generator, count: int, dtype: int = Dtype.FIXED32, flags: int = 0) -> np.ndarray:
    """The lanes of a packet of `count` elements: values, zero padding, and the last lanes (where
    the check words go) non-zero, so a switch summing them anywhere else would show. FIXED16: two
    int16 values a lane (`hi * 2^16 + lo`), `count` of them, docs/protocol.md 5.2."""
    n = wire_lanes(count, int(dtype), flags, LANES)
    v = np.zeros(n, dtype=np.int64)
    if dtype == Dtype.FIXED16:
        used = -(-count // 2)
        v[:used] = rng.integers(-2**12, 2**12, size=used) * 2**16 + rng.integers(-2**12, 2**12, size=used)
        v[-4:] = rng.integers(-2**12, 2**12, size=4) * 2**16
    else:
        v[:count] = rng.integers(-2**30, 2**30, size=count)
        v[-4:] = rng.integers(-2**30, 2**30, size=4)
    return v


def results(out, seq: int, length: int) -> list[np.ndarray]:
    """The lanes of every RESULT of `seq` in `out` (one per worker), each checked to be `length` bytes."""
    got = []
    assert sorted(p for p, _ in out) == [worker_port(r) for r in RANKS], out
    for _, data in out:
        pk = Packet.unpack(data)
        assert (pk.type, pk.seq) == (MsgType.RESULT, seq)
        assert len(data) == length, (len(data), length)
        got.append(np.frombuffer(data[HEADER_LEN:], dtype=">i4"))
    return got


def test_the_length_rule():
    """Whole chunks for the count, capped at the switch's lanes, 4 bytes a lane for every dtype; FIXED16
    counts int16 values, two a lane, its sums their exponent values and 8 check values too."""
    assert wire_len(10, int(Dtype.FIXED32), 0, LANES) == HEADER_LEN + 4 * 64
    assert wire_len(62, int(Dtype.INT32), 0, LANES) == HEADER_LEN + 4 * 64
    assert wire_len(63, int(Dtype.INT32), 0, LANES) == HEADER_LEN + 4 * 128
    assert wire_len(190, int(Dtype.INT32), 0, LANES) == HEADER_LEN + 4 * 192
    assert wire_len(191, int(Dtype.INT32), 0, LANES) == HEADER_LEN + 4 * LANES  # past the last chunk: whole
    nb = fixed16_blocks(LANES)
    assert nb == 3  # 400 int16 values a packet: 3 * (112 + 1) + 8 of them
    assert wire_len(128 - 8 - nb, int(Dtype.FIXED16), 0, LANES) == HEADER_LEN + 4 * 64
    assert wire_len(128 - 8 - nb + 1, int(Dtype.FIXED16), 0, LANES) == HEADER_LEN + 4 * 128
    assert wire_len(60, int(Dtype.FIXED16), int(Flag.MAX), LANES) == HEADER_LEN + 4 * 64  # agreement: a lane each
    assert wire_len(61, int(Dtype.FIXED16), int(Flag.MAX), LANES) == HEADER_LEN + 4 * 128
    counts = np.array([10, 190, 60, 118], dtype=np.int64)
    dtypes = np.array([Dtype.INT32, Dtype.INT32, Dtype.FIXED16, Dtype.FIXED16], dtype=np.uint8)
    flags = np.array([0, 0, Flag.MAX, 0], dtype=np.uint8)
    assert wire_len(counts, dtypes, flags, LANES).tolist() == [288, 800, 288, 544]
    assert wire_lanes(5, int(Dtype.INT32), 0, 64) == 64  # a 64-lane switch: one length, as before


@pytest.mark.parametrize("turns", ["one_by_one", "one_turn", "vectorised"])
@pytest.mark.parametrize("count,dtype,flags", [(10, Dtype.FIXED32, 0), (190, Dtype.INT32, 0),
                                               (30, Dtype.FIXED16, 0), (100, Dtype.FIXED16, int(Flag.MAX)),
                                               (40, Dtype.INT32, int(Flag.MAX))])
def test_a_short_packet_is_summed_and_emitted_short(monkeypatch, turns, count, dtype, flags):
    """Three short contributions of one slot: every RESULT has their length and the lane-wise sum
    (or max) of what they carried, check lanes included; a resend after completion brings the
    stored result back to its sender, at the same length."""
    if turns == "vectorised":
        monkeypatch.setattr(pipeline, "SMALL_TURN", 0)
    rng = np.random.default_rng(count)
    sw = switch()
    seq = 5
    vals = {r: contribution(rng, count, dtype, flags) for r in RANKS}
    pkts = [(worker_port(r), packet(r, seq, count, vals[r], dtype=dtype, flags=flags)) for r in RANKS]
    length = wire_len(count, int(dtype), flags, LANES)
    assert all(len(p) == length for _, p in pkts)
    out = []
    if turns == "one_by_one":
        for p in pkts:
            out += sw.process_datagrams([p])
    else:
        out = sw.process_datagrams(pkts)
    stack = np.stack(list(vals.values()))
    want = stack.max(axis=0) if flags & Flag.MAX else stack.sum(axis=0)
    want = (want + 2**31) % 2**32 - 2**31  # FIXED16 too: its lanes are summed as int32
    for got in results(out, seq, length):
        assert got.tolist() == want.tolist()
    again = sw.process_datagrams([(worker_port(1), packet(1, seq, count, vals[1], dtype=dtype,
                                                          flags=flags | int(Flag.RETX)))])
    assert [p for p, _ in again] == [worker_port(1)] and len(again[0][1]) == length
    assert np.frombuffer(again[0][1][HEADER_LEN:], dtype=">i4").tolist() == want.tolist()
    drops = sw.counters()["drops"]
    assert not any(v[0] for v in drops.values()), drops


def test_a_length_other_than_the_counts_is_malformed_and_changes_nothing():
    """A whole packet whose count needs fewer chunks, a chunk too many, a length that is not whole
    chunks, and a short packet whose count needs more: each MALFORMED, counted, and no slot moves
    (the phase then completes with the right packets alone)."""
    rng = np.random.default_rng(3)
    sw = switch()
    seq, count = 6, 10
    v = contribution(rng, count)
    bad = [np.concatenate([v, np.zeros(LANES - len(v), dtype=np.int64)]),  # whole, count needs one chunk
           np.concatenate([v, np.zeros(LANE_CHUNK, dtype=np.int64)]),  # two chunks
           v[:LANE_CHUNK // 2]]  # half a chunk
    for lanes in bad:
        assert sw.process_datagrams([(worker_port(0), packet(0, seq, count, lanes))]) == []
    assert sw.process_datagrams([(worker_port(0), packet(0, seq, 100, v))]) == []  # count 100 needs two chunks
    f16 = contribution(rng, count, Dtype.FIXED16)  # at the length of the old int16 lanes (32 + 2 * 64)
    assert sw.process_datagrams([(worker_port(0), packet(0, seq, count, f16[:len(f16) // 2],
                                                         dtype=Dtype.FIXED16))]) == []
    assert sw.counters()["drops"][int(DropReason.MALFORMED)][0] == 5
    vals = {r: contribution(rng, count) for r in RANKS}
    out = []
    for r in RANKS:
        out += sw.process_datagrams([(worker_port(r), packet(r, seq, count, vals[r]))])
    want = np.stack(list(vals.values())).sum(axis=0)
    for got in results(out, seq, HEADER_LEN + 4 * LANE_CHUNK):
        assert got.tolist() == want.tolist()


def test_a_zero_packet_stands_for_a_packet_of_its_count():
    """A header-only ZERO contribution (INT32, docs/protocol.md 3.2) next to short real ones: the
    RESULT has the length of an INT32 packet of its count, not the switch's whole packet."""
    rng = np.random.default_rng(4)
    sw = switch()
    seq, count = 7, 20
    vals = {r: contribution(rng, count, Dtype.INT32) for r in RANKS[:2]}
    out = []
    for r in RANKS[:2]:
        out += sw.process_datagrams([(worker_port(r), packet(r, seq, count, vals[r], dtype=Dtype.INT32))])
    zero = packet(2, seq, count, [], dtype=Dtype.INT32, flags=int(Flag.ZERO))
    out += sw.process_datagrams([(worker_port(2), zero)])
    want = (vals[0] + vals[1] + 2**31) % 2**32 - 2**31
    for got in results(out, seq, HEADER_LEN + 4 * LANE_CHUNK):
        assert got.tolist() == want.tolist()


def test_lanes_past_a_short_packet_are_summed_as_zeros():
    """A receive buffer holds whatever it held past a short packet's end: the switch pads the row
    with zeros before the slot registers, so no lane register past the packet ever holds anything
    (as the P4 programs keep those lanes out of the sum)."""
    rng = np.random.default_rng(5)
    sw = switch()
    seq, count = 9, 10
    vals = {r: contribution(rng, count) for r in RANKS}
    items = [(worker_port(r), packet(r, seq, count, vals[r])) for r in RANKS]
    b = Batch.from_bytes(items, False, HEADER_LEN + 4 * LANES)
    b.rows[:, HEADER_LEN + 4 * LANE_CHUNK:] = 0xA5  # stale bytes of earlier, longer packets
    with sw.lock:
        em = sw.pipeline.run(b)
    assert len(em.pkt)
    lengths = {int(b.luwu_len[p]) for p in em.pkt.tolist()}
    assert lengths == {HEADER_LEN + 4 * LANE_CHUNK}
    assert not sw.pipeline.registers.lanes[:, LANE_CHUNK:].any()
    want = np.stack(list(vals.values())).sum(axis=0)
    for p in set(em.pkt.tolist()):
        assert b.rows[p, HEADER_LEN:HEADER_LEN + 4 * LANE_CHUNK].view(">i4").tolist() == want.tolist()
