"""FIXED16 on the software switch (docs/protocol.md 5.2, PACKED16): a FIXED16 aggregation packet has
32-bit lanes like every dtype, each holding two int16 values as `hi * 2^16 + lo` (lo signed), and
the switch sums them as plain int32 lanes (wrapping) and takes MAX as the signed int32 maximum,
exactly as it does INT32 packets, on every path a batch can take (a one-packet turn, a small turn,
a vectorised batch next to 32-bit packets, a lone shared-memory turn: fast/aggregate_one.py). Both
halves of a summed lane decode to the int16 sums (`lo = int16(S & 0xFFFF)`, `hi = (S - lo) >> 16`)
while each slot's sum fits int16. The length rule is 32 + 4 * lanes; the old int16-lane length
32 + 2 * lanes is MALFORMED. The P4 programs do the same (conformance_vectors_v2.py runs them on BMv2).
"""

from __future__ import annotations

import numpy as np
import pytest
from switch_setup import LANES, SLOTS, agg_packet, runtime, worker_port

from luwu.dataplane.net.shm_ring import supported
from luwu.dataplane.protocol import HEADER_LEN, DropReason, Dtype, Flag, MsgType, Packet, slot_for
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig, pipeline
from luwu.dataplane.switch.fast import aggregate_one

RANKS = (0, 1, 2)  # session 1: pool [0, 4), three workers, multicast group 1
FIXED16 = int(Dtype.FIXED16)


def packet(worker: int, seq: int, lanes, *, dtype: int = FIXED16, flags: int = 0, count: int = LANES,
           width: int = 4) -> bytes:
    """Rank `worker`'s ALLREDUCE of session 1 (header check sealed), `lanes` as int32 lanes (width 4,
    every dtype's) or as the old int16 lanes (width 2: 32 + 2 * lanes bytes)."""
    slot, set_ = slot_for(seq, 0, 4)
    v = np.asarray(lanes, dtype=np.int64)
    body = (v.astype(np.int32).astype(">i4") if width == 4 else v.astype(np.int16).astype(">i2")).tobytes()
    return Packet(MsgType.ALLREDUCE, 1, worker, flags | (Flag.SET if set_ else 0), count, seq, slot, 9,
                  seq * LANES, 0, dtype, 1000, payload=body).pack()


def switch() -> SoftwareSwitch:
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=1))
    sw.load_runtime(runtime())
    return sw


def pack(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Two int16 values a lane: the int32 `hi * 2^16 + lo` (lo signed), as int64."""
    return wrap32(hi.astype(np.int64) * 2**16 + lo.astype(np.int64))


def unpack(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (hi, lo) int16 halves of int32 lanes `s` (docs/protocol.md 5.2)."""
    s = s.astype(np.int64)
    lo = (s & 0xFFFF).astype(np.uint16).astype(np.int16).astype(np.int64)
    return (s - lo) >> 16, lo


def wrap32(x: np.ndarray) -> np.ndarray:
    return (x + 2**31) % 2**32 - 2**31


def slots(rng: np.random.Generator, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A rank's (hi, lo) int16 values: three ranks' sums fit int16 (the senders' headroom), with
    the extremes of that headroom, negative and positive lo (a borrow into hi), and zeros."""
    hi = rng.integers(-2**13, 2**13, size=LANES)
    lo = rng.integers(-2**13, 2**13, size=LANES)
    hi[0], lo[0] = 2**13 - 1, -2**13  # the headroom's extremes
    hi[1], lo[1] = -2**13, 2**13 - 1
    hi[2], lo[2] = 0, -rank - 1  # a negative lo under a zero hi: the sum borrows from hi
    hi[3], lo[3] = rank + 1, 0
    return hi, lo


def results(out, seq: int, dtype: int = FIXED16) -> list[np.ndarray]:
    """The int32 lanes of the one RESULT copy per worker of session 1 in `out`."""
    ports = sorted(port for port, _ in out)
    assert ports == [worker_port(r) for r in RANKS], ports
    got = []
    for _, data in out:
        assert len(data) == HEADER_LEN + 4 * LANES
        pk = Packet.unpack(data)
        assert (pk.type, pk.seq, pk.dtype) == (MsgType.RESULT, seq, dtype)
        got.append(np.frombuffer(data[HEADER_LEN:], dtype=">i4").astype(np.int64))
    return got


@pytest.mark.parametrize("small_turn", [pipeline.SMALL_TURN, 0])
@pytest.mark.parametrize("turns", ["one_by_one", "one_turn"])
def test_fixed16_lanes_are_summed_as_int32(monkeypatch, turns, small_turn):
    """Packed FIXED16 lanes: the RESULT lanes are the wrapping int32 sum, both halves of each decode
    to the int16 sums, and the same lanes sent as INT32 on another slot give the same RESULT lanes."""
    monkeypatch.setattr(pipeline, "SMALL_TURN", small_turn)
    rng = np.random.default_rng(29)
    sw = switch()
    vals = {r: slots(rng, r) for r in RANKS}
    lanes = {r: pack(*vals[r]) for r in RANKS}
    for seq, dtype in ((0, FIXED16), (1, int(Dtype.INT32))):
        pkts = [(worker_port(r), packet(r, seq, lanes[r], dtype=dtype)) for r in RANKS]
        if turns == "one_by_one":
            out = []
            for p in pkts:
                out += sw.process_datagrams([p])
        else:
            out = sw.process_datagrams(pkts)
        want = wrap32(np.stack(list(lanes.values())).sum(axis=0))
        hi_sum = np.stack([vals[r][0] for r in RANKS]).sum(axis=0)
        lo_sum = np.stack([vals[r][1] for r in RANKS]).sum(axis=0)
        assert (np.abs(hi_sum) < 2**15).all() and (np.abs(lo_sum) < 2**15).all()  # the headroom held
        for got in results(out, seq, dtype):
            assert got.tolist() == want.tolist()
            hi, lo = unpack(got)
            assert hi.tolist() == hi_sum.tolist() and lo.tolist() == lo_sum.tolist()
    drops = sw.counters()["drops"]
    assert not any(v[0] for v in drops.values()), drops


def test_fixed16_max_is_the_signed_int32_max():
    """MAX (the exponent agreement, one exponent a lane: `e << 16 | tag`) is the signed int32
    maximum of the lanes, not a maximum per int16 half."""
    rng = np.random.default_rng(31)
    sw = switch()
    lanes = {r: wrap32(rng.integers(-2**31, 2**31, size=LANES)) for r in RANKS}
    lanes[0][0], lanes[1][0], lanes[2][0] = pack(np.array([5, 5, 4]), np.array([-1, 3, 2**15 - 1]))
    out = sw.process_datagrams([(worker_port(r), packet(r, 2, lanes[r], flags=int(Flag.MAX), count=LANES - 4))
                                for r in RANKS])
    want = np.stack(list(lanes.values())).max(axis=0)
    assert want[0] == 5 * 2**16 + 3
    for got in results(out, 2):
        assert got.tolist() == want.tolist()


def test_fixed16_next_to_32bit_phases_and_resend(monkeypatch):
    """A vectorised batch with FIXED16 and FIXED32 phases on other slots (both may take the fold),
    then a FIXED16 resend: the stored int32 sums back to its sender only, RETX set."""
    monkeypatch.setattr(pipeline, "SMALL_TURN", 0)
    rng = np.random.default_rng(30)
    sw = switch()
    v16 = {r: pack(*slots(rng, r)) for r in RANKS}
    v32 = {r: rng.integers(-2**31, 2**31, size=LANES) for r in RANKS}
    batch = []
    for r in RANKS:
        batch.append((worker_port(r), packet(r, 2, v16[r])))
        batch.append((worker_port(r), packet(r, 3, v32[r], dtype=int(Dtype.FIXED32))))
    out = sw.process_datagrams(batch)
    by_seq: dict[int, list] = {}
    for port, data in out:
        by_seq.setdefault(Packet.unpack(data).seq, []).append((port, data))
    want16 = wrap32(np.stack(list(v16.values())).sum(axis=0))
    for got in results(by_seq[2], 2):
        assert got.tolist() == want16.tolist()
    want32 = wrap32(np.stack(list(v32.values())).sum(axis=0))
    for got in results(by_seq[3], 3, int(Dtype.FIXED32)):
        assert got.tolist() == want32.tolist()
    again = sw.process_datagrams([(worker_port(1), packet(1, 2, v16[1], flags=int(Flag.RETX)))])
    assert [p for p, _ in again] == [worker_port(1)]
    assert np.frombuffer(again[0][1][HEADER_LEN:], dtype=">i4").tolist() == want16.tolist()
    assert Packet.unpack(again[0][1]).flags & Flag.RETX


def test_fixed16_length_rule():
    """FIXED16 is 32 + 4 * lanes bytes like every dtype: the old int16-lane length 32 + 2 * lanes is
    MALFORMED (and changes nothing: the phase then completes with the right packets); a count up
    to 2 * lanes (its int16 values) is accepted, one more is MALFORMED."""
    sw = switch()
    ones = np.ones(LANES, dtype=np.int64)
    bad = [packet(0, 0, ones, width=2),  # the old length
           packet(0, 0, ones, count=2 * LANES + 1)]  # more int16 values than a packet holds
    for p in bad:
        assert sw.process_datagrams([(worker_port(0), p)]) == []
    assert sw.counters()["drops"][int(DropReason.MALFORMED)][0] == 2
    out = []
    for r in RANKS:
        out += sw.process_datagrams([(worker_port(r), packet(r, 0, ones * (r + 1), count=2 * LANES))])
    for got in results(out, 0):
        assert got.tolist() == [6] * LANES
    assert sw.counters()["drops"][int(DropReason.MALFORMED)][0] == 2


@pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")
def test_fixed16_lone_turns_take_the_lone_path():
    """On shared-memory ports a FIXED16 contribution alone in its turn takes fast/aggregate_one.py's
    path, as an INT32 one does, and the RESULT carries the int32 sum of the packed lanes."""
    from test_switch_lone_turns import small_pool_rig

    rig = small_pool_rig()
    real = aggregate_one.turn
    taken = []

    def counted(*a):
        taken.append(real(*a))
        return taken[-1]

    aggregate_one.turn = counted
    lanes = {r: pack(np.full(LANES, r + 1), np.arange(LANES) - 3 * r) for r in (0, 1)}
    try:
        for rank in (0, 1):  # session 5: two workers, results to three ports
            out = rig.run_turn([(worker_port(rank), agg_packet(5, rank, 1, lanes[rank], dtype=FIXED16))])
    finally:
        aggregate_one.turn = real
        rig.close()
    assert taken == [True, True]
    want = wrap32(lanes[0] + lanes[1])
    got = [np.frombuffer(d[HEADER_LEN:], dtype=">i4").tolist() for r in (0, 1, 2) for d in out[worker_port(r)]]
    assert got == [want.tolist()] * 3
    hi, lo = unpack(want)
    assert hi.tolist() == [3] * LANES and lo.tolist() == (2 * np.arange(LANES) - 3).tolist()
