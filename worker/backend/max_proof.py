"""End-to-end proof of a MAX/MIN result from the switch (issue 27; docs/protocol.md 3.6).

A SUM result is verified end to end by the check words every sender adds and the switch sums
like data. A lane MAX cannot carry such words (the max of check words is not the check word of
the max), so after a MAX/MIN reduction through the switch each rank proves its result in one
more SUM round, which the check words do verify:

1. it checks `result >= own` element by element in the op's order (the ordered keys the engine
   sent: NaN ranks above +inf, -0.0 below +0.0), and counts a violation (`bad`, one lane);
2. it marks the elements it *won*: `result == own` (bit for bit in key order), 1 bit;
3. it adds a 64-bit hash of its whole result (blake2b) in its own pair of lanes (zero elsewhere).

The SUM of these lanes over the ranks gives every rank the same numbers: the proof holds when
no rank saw a violation, every rank's result hash is the same (so all ranks hold one result R),
and every element was won by at least one rank. Then R_k >= every rank's contribution (1, on
every rank, about one R) and R_k is some rank's contribution (2): R_k is the MAX. A result
corrupted between the switch and some rank breaks the hash equality (the corrupted rank's hash
differs: detected unless two 64-bit hashes collide); one corrupted on the way in (a
contributor's lane raised) wins where no rank has that value (count 0), or lowered is beaten by
another's larger value (a violation at that rank) or, if it was that rank's own, still counted
as a win only if nobody exceeds it, which (1) rules out. Every rank reaches the same verdict
from the same verified sum, so all take the same path: the result, or (a failed proof) the
exact recomputation over TCP (fallback.py, Gloo's order for floats), counted in the group's
fallback stats (`max_proof_failures`); never a wrong result.

Counts take b = bit_length(world) bits (a count is at most world), packed 32 // b per int32
lane with no carry between fields: 16 per lane for 2 or 3 ranks, 4 per lane up to 255 ranks,
so the round sends numel / (32 // b) + 2 * world + 1 lanes per rank, 6.25 % of the data's lanes
for 2 ranks. It is a second round trip after the MAX result, submitted in order through the
scheduler's hold (a later collective waits for the MAX result, not for the proof's round); it
never touches SUM collectives. `LUWU_VERIFY_MAX=0` turns it off (default 1).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from luwu.dataplane.engine import Handle
from luwu.dataplane.engine.reductions import nan_wins

from .diagnostics import LuwuError

ENV = "LUWU_VERIFY_MAX"


def enabled(env=None) -> bool:
    """LUWU_VERIFY_MAX: 1 (default) proves every MAX/MIN result from the switch; 0 trusts it."""
    raw = (os.environ if env is None else env).get(ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV}={raw!r}: set 1 to prove MAX/MIN results end to end (the default) or 0 not to")
    return raw == "1"


def count_bits(world: int) -> int:
    """Bits per won count: enough for 0..world."""
    return max(1, int(world).bit_length())


def pack_counts(won: np.ndarray, world: int) -> np.ndarray:
    """`won` (0/1 or bool per element) packed 32 // count_bits(world) to an int32 lane, field j of
    a lane at bits j*b.. : a SUM of such lanes over `world` ranks is the packed per-element counts."""
    b = count_bits(world)
    per = 32 // b
    lanes = -(-won.size // per)
    w = np.zeros(lanes * per, dtype=np.uint8)
    w[:won.size] = won
    cols = w.reshape(lanes, per)
    acc = cols[:, 0].astype(np.uint32)
    for j in range(1, per):
        acc |= cols[:, j].astype(np.uint32) << np.uint32(j * b)
    return acc.view(np.int32)


def unpack_counts(lanes: np.ndarray, numel: int, world: int) -> np.ndarray:
    """The per-element counts of a summed `pack_counts` lane array."""
    b = count_bits(world)
    per = 32 // b
    u = np.asarray(lanes, dtype=np.int32).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(b))[None, :]
    return ((u[:, None] >> shifts) & np.uint32((1 << b) - 1)).reshape(-1)[:numel]


def keys(values: np.ndarray, op: str) -> np.ndarray:
    """What the switch compares for values (float32: ordered keys, NaN made the winner as the
    engine sends it; int32: the values), int32 in the op's order (MIN: the order-reversing ~k, as
    the engine negates them): the larger key wins for max and min alike. May be `values` itself."""
    k = ordered(nan_wins(values, op)) if values.dtype == np.float32 else values.view(np.int32)
    return k if op == "max" else np.invert(k)


def ordered(x: np.ndarray) -> np.ndarray:
    """quantize.to_ordered's keys (equal bit for bit: tests), without its np.where (30x slower)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.int32)
    return b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


def proof_lanes(own: np.ndarray, result: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This rank's lanes of the proof round: [bad, hash pairs of every rank (own pair only), counts].
    `own` and `result` are keys in the op's order (`keys`)."""
    bad = bool((result < own).any())
    digest = hashlib.blake2b(np.ascontiguousarray(result).data, digest_size=8).digest()
    hashes = np.zeros(2 * world, dtype=np.int32)
    hashes[2 * rank: 2 * rank + 2] = np.frombuffer(digest, dtype=">i4")
    return np.concatenate([np.array([int(bad)], dtype=np.int32), hashes, pack_counts(result == own, world)])


def verdict(summed: np.ndarray, numel: int, world: int) -> str:
    """'' when the summed proof lanes prove the result, else what failed (the same on every rank)."""
    summed = np.asarray(summed, dtype=np.int32).reshape(-1)
    if summed[0] != 0:
        return f"{int(summed[0])} rank(s) got a result below their own contribution"
    pairs = summed[1: 1 + 2 * world].reshape(world, 2)
    if (pairs != pairs[0]).any():
        return "the ranks received different results"
    counts = unpack_counts(summed[1 + 2 * world:], numel, world)
    lost = int(np.count_nonzero(counts == 0))
    if lost:
        return f"{lost} element(s) of the result are no rank's contribution"
    return ""


class MaxProof:
    """The proof of one MAX/MIN engine allreduce (module docstring); made on the submit thread
    before the engine gets `x` (its keys are kept: an in-place int reduction overwrites x)."""

    def __init__(self, ctx, x: np.ndarray, op: str, esize: int, kind: str):
        fallback = ctx.sched.fallback
        self.ctx = ctx
        self.fallback = fallback
        self.op = op
        self.esize = esize
        self.kind = kind
        own = keys(x, op)
        self.own = own.copy() if own is x else own  # an in-place int reduction overwrites x
        # what the exact path exchanges: the float32 input (never reduced in place) or an int copy
        self.x = x if x.dtype == np.float32 else x.copy()
        self.tag = fallback.take_tag()  # numbered on the submit thread: the same on every rank

    def attach(self, handle: Handle) -> Handle:
        """A handle that completes with `handle`'s result once proven, or with the exact result."""
        out = Handle(handle.name)
        out.info = handle.info
        self.ctx.then(handle, lambda result: self._round(result, out))
        return out

    def _round(self, result: np.ndarray, out: Handle) -> None:
        """On the submit thread, before any later collective: submit the proof's SUM round."""
        fb = self.fallback
        world = fb.world_size
        lanes = proof_lanes(self.own, keys(result, self.op), fb.rank, world)
        fb.stats["max_proofs"] = fb.stats.get("max_proofs", 0) + 1
        fb.stats["max_proof_lanes"] = fb.stats.get("max_proof_lanes", 0) + int(lanes.size)
        h = self.ctx.sched.link.allreduce(lanes, "sum")

        def done(h: Handle) -> None:
            if h.error is not None:
                out.set_error(h.error)
                return
            why = verdict(h.wait(), result.size, world)
            if not why:
                out.set_result(result)
                return
            fb.stats["max_proof_failures"] = fb.stats.get("max_proof_failures", 0) + 1
            out.info["exact"] = True
            out.info["max_proof"] = why
            try:
                fb._exchange(result, self.x, self.op, self.tag, out, self.esize, None, self.kind,
                             np.arange(result.size))
            except Exception as e:  # noqa: BLE001 - e.g. the channel is closed: this collective fails
                out.set_error(LuwuError(f"luwu {out.name}: the switch's {self.op.upper()} result failed its "
                                        f"proof ({why}) and its exact recomputation failed: {e}"))

        h.add_done_callback(done)
