"""FIXED16 on the software switch (docs/protocol.md 5.2, issue 29): int16 lanes sign-extended into
the int32 lane registers, summed (or maxed with MAX) and emitted truncated to int16, on every path a
batch can take (a one-packet turn, a small turn, a vectorised batch next to 32-bit packets that the
fold takes); the length rule 32 + 2 * lanes. The P4 programs do the same (conformance_vectors_v2.py
runs it on BMv2 too). Headers are sealed (hcheck), so the tests hold whether or not the switch
verifies it.
"""

from __future__ import annotations

import numpy as np
import pytest
from switch_setup import LANES, SLOTS, runtime, worker_port

from luwu.dataplane.integrity import HCHECK_OFFSET, header_check
from luwu.dataplane.protocol import HEADER_LEN, DropReason, Dtype, Flag, MsgType, Packet, slot_for
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig, pipeline

RANKS = (0, 1, 2)  # session 1: pool [0, 4), three workers, multicast group 1


def sealed(data: bytes) -> bytes:
    head = bytearray(data[:HEADER_LEN])
    head[HCHECK_OFFSET:HCHECK_OFFSET + 2] = header_check(bytes(head)).to_bytes(2, "big")
    return bytes(head) + data[HEADER_LEN:]


def packet(worker: int, seq: int, lanes, *, dtype: int = Dtype.FIXED16, flags: int = 0, width: int = 2) -> bytes:
    """Rank `worker`'s ALLREDUCE of session 1, `lanes` as int16 (width 2) or int32 (width 4)."""
    slot, set_ = slot_for(seq, 0, 4)
    body = np.asarray(lanes, dtype=np.int64).astype(">i2" if width == 2 else ">i4").tobytes()
    return sealed(Packet(MsgType.ALLREDUCE, 1, worker, flags | (Flag.SET if set_ else 0), LANES, seq, slot, 9,
                         seq * LANES, 0, int(dtype), 1000, payload=body).pack())


def switch() -> SoftwareSwitch:
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=1))
    sw.load_runtime(runtime())
    return sw


def lanes16(rng: np.random.Generator, rank: int) -> np.ndarray:
    v = rng.integers(-2**13, 2**13, size=LANES)
    v[0], v[1], v[2] = 2**15 - 1, -2**15, -1  # a sum that leaves int16 (wraps), the extremes, a sign
    v[3] = -rank - 1
    return v


def check_result(out, want: np.ndarray, seq: int) -> None:
    """One RESULT copy per worker of session 1, each with the int16 lanes `want`."""
    ports = sorted(port for port, _ in out)
    assert ports == [worker_port(r) for r in RANKS], ports
    for _, data in out:
        assert len(data) == HEADER_LEN + 2 * LANES
        pk = Packet.unpack(data)
        assert (pk.type, pk.seq, pk.dtype) == (MsgType.RESULT, seq, Dtype.FIXED16)
        assert np.frombuffer(data[HEADER_LEN:], dtype=">i2").tolist() == want.tolist()


def wrap16(x: np.ndarray) -> np.ndarray:
    return ((x + 2**15) % 2**16 - 2**15).astype(np.int64)


@pytest.mark.parametrize("turns", ["one_by_one", "one_turn"])
def test_fixed16_sum_and_max(turns):
    """Sums wrap to int16 (low 16 bits); MAX compares the sign-extended lanes."""
    rng = np.random.default_rng(29)
    sw = switch()
    for seq, flags in ((0, 0), (1, int(Flag.MAX))):
        vals = {r: lanes16(rng, r) for r in RANKS}
        pkts = [(worker_port(r), packet(r, seq, vals[r], flags=flags)) for r in RANKS]
        if turns == "one_by_one":
            out = []
            for p in pkts:
                out += sw.process_datagrams([p])
        else:
            out = sw.process_datagrams(pkts)
        stack = np.stack([vals[r] for r in RANKS])
        check_result(out, wrap16(stack.sum(axis=0)) if not flags else stack.max(axis=0), seq)
    drops = sw.counters()["drops"]
    assert not any(v[0] for v in drops.values()), drops


@pytest.mark.parametrize("small_turn", [pipeline.SMALL_TURN, 0])
def test_fixed16_next_to_32bit_phases_and_resend(monkeypatch, small_turn):
    """A batch with FIXED16 and FIXED32 phases on other slots (the 32-bit ones may take the fold),
    classified one packet at a time or vectorised (SMALL_TURN 0); then a FIXED16 resend gets the
    stored int16 sums back to its sender only."""
    monkeypatch.setattr(pipeline, "SMALL_TURN", small_turn)
    rng = np.random.default_rng(30)
    sw = switch()
    v16 = {r: lanes16(rng, r) for r in RANKS}
    v32 = {r: rng.integers(-2**31, 2**31, size=LANES) for r in RANKS}
    batch = []
    for r in RANKS:
        batch.append((worker_port(r), packet(r, 2, v16[r])))
        batch.append((worker_port(r), packet(r, 3, v32[r], dtype=Dtype.FIXED32, width=4)))
    out = sw.process_datagrams(batch)
    by_seq: dict[int, list] = {}
    for port, data in out:
        by_seq.setdefault(Packet.unpack(data).seq, []).append((port, data))
    want16 = wrap16(np.stack(list(v16.values())).sum(axis=0))
    check_result(by_seq[2], want16, 2)
    want32 = np.stack(list(v32.values())).sum(axis=0)
    want32 = ((want32 + 2**31) % 2**32 - 2**31).tolist()
    for _, data in by_seq[3]:
        assert np.frombuffer(data[HEADER_LEN:], dtype=">i4").tolist() == want32
    again = sw.process_datagrams([(worker_port(1), packet(1, 2, v16[1], flags=int(Flag.RETX)))])
    assert [p for p, _ in again] == [worker_port(1)]
    assert np.frombuffer(again[0][1][HEADER_LEN:], dtype=">i2").tolist() == want16.tolist()
    assert Packet.unpack(again[0][1]).flags & Flag.RETX


def test_fixed16_length_rule():
    """FIXED16 is 32 + 2 * lanes bytes: 4 * lanes is MALFORMED, and so is 2 * lanes for FIXED32."""
    sw = switch()
    bad = [(worker_port(0), packet(0, 0, np.ones(LANES), width=4)),
           (worker_port(0), packet(0, 0, np.ones(LANES), dtype=Dtype.FIXED32, width=2))]
    for p in bad:
        assert sw.process_datagrams([p]) == []
    assert sw.counters()["drops"][int(DropReason.MALFORMED)][0] == 2
