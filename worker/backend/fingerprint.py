"""Collective fingerprints: every rank's collective, agreed before its result is used.

Each collective the scheduler submits carries a `Fingerprint` (which collective, dtype, element
count, reduce op, root, its sequence number in the group, and under TORCH_DISTRIBUTED_DEBUG=DETAIL
a hash of the shape, as Gloo's wrapper compares shapes there). Its fields ride on the engine's
meta session (dataplane/engine/reductions.py): a float sum's fields go in the exponent agreement it
makes anyway, any other reduction adds one packet beside its data, not a round trip. Ranks whose
fingerprints differ all get the same MAX/MIN of every field, so each of them fails the collective
(never a partial or mixed result): `mismatch_error` then reads every rank's own description
through the group's store (the error path only) and names them, e.g. "all_reduce #17: ... rank 0
has all_reduce of 4 x torch.float32, SUM, rank 1 has all_reduce of 8 x torch.float32, SUM"; under
DETAIL in the words of torch's ProcessGroupWrapper ("Detected mismatch between collectives on ranks
..."). A mismatch breaks the group: the ranks' packet streams no longer line up.

Corruption in flight is no mismatch: each field's lanes check themselves (their tags,
dataplane/engine/agreement.py), and a lane whose tag fails is counted, not compared. Should a
corrupted lane pass its tag (1 in 2^16 for a random corruption of a lane, never for 1-3 flipped
bits), every rank fails alike and reads the same description back through the store: then
`mismatch_error` says so (`CorruptedAgreementError`), never "the ranks called different collectives".

Collectives that go point to point (gather, scatter, all_to_all, send/recv) are not fingerprinted:
their receivers check the sizes they get (collectives.py).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch

from .diagnostics import LuwuError

# torch's names (as in dist.all_reduce), in ProcessGroupWrapper's OpType words for DETAIL
KINDS = {
    "all_reduce": (1, "ALLREDUCE"), "reduce": (2, "REDUCE"), "reduce_scatter": (3, "REDUCE_SCATTER"),
    "reduce_scatter_tensor": (4, "_REDUCE_SCATTER_BASE"), "broadcast": (5, "BROADCAST"),
    "all_gather": (6, "ALLGATHER"), "all_gather_into_tensor": (7, "_ALLGATHER_BASE"), "barrier": (8, "BARRIER"),
}
OPS = {"": 0, "sum": 1, "avg": 2, "max": 3, "min": 4, "product": 5, "band": 6, "bor": 7, "bxor": 8}
_FIELDS = ("collective", "dtype", "element count", "element count", "reduce op", "root", "sequence number", "shape",
           "engine operation")
_MASK = 0x7FFFFFFF  # fields are non-negative int32 (the engine agrees on their self-checking halves)
MISMATCH_KEY = "luwu-mismatch/{check}/{rank}"  # each rank's description of a disagreed check, in the group's store
EXPLAIN_WAIT = 5.0  # s a rank waits for the others' descriptions before naming what it has


def detail() -> bool:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: compare shapes too, and word mismatches as torch does."""
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & _MASK


@dataclass
class Fingerprint:
    """One rank's view of a collective: what must be equal on every rank."""

    kind: str
    dtypes: list[torch.dtype]
    numel: int
    op: str = ""
    root: int = -1
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    seq: int = -1  # set by the scheduler, in call order

    @classmethod
    def of(cls, kind: str, tensors: list[torch.Tensor], op: str = "", root: int = -1) -> Fingerprint:
        return cls(kind, [t.dtype for t in tensors], sum(t.numel() for t in tensors), op, root,
                   [tuple(t.shape) for t in tensors])

    def fields(self, part: int, shapes: bool) -> np.ndarray:
        """The int32 fields of the engine operation `part` of this collective."""
        dtype = _code(",".join(str(d) for d in self.dtypes))
        shape = _code(repr(self.shapes)) if shapes else 0
        return np.array([KINDS[self.kind][0], dtype, (self.numel >> 31) & _MASK, self.numel & _MASK,
                         OPS.get(self.op, _code(self.op)), self.root + 1, self.seq & _MASK, shape, part & _MASK],
                        dtype=np.int32)

    def describe(self) -> str:
        dtypes = ", ".join(str(d) for d in self.dtypes) or "no tensor"
        what = f"{self.kind} of {self.numel} x {dtypes}"
        if len(self.shapes) > 1 or detail():
            what += f" (shapes {', '.join(str(list(s)) for s in self.shapes)})"
        if self.op:
            what += f", {self.op.upper()}"
        if self.root >= 0:
            what += f", root {self.root}"
        return what

    def torch_words(self) -> str:
        """ProcessGroupWrapper's CollectiveFingerPrint(...) wording."""
        shapes = ", ".join(str(list(s)) for s in self.shapes)
        dtypes = ", ".join(str(d).replace("torch.", "").capitalize() for d in self.dtypes)
        text = f"CollectiveFingerPrint(SequenceNumber={self.seq}, OpType={KINDS[self.kind][1]}, TensorShape={shapes}, " \
               f"TensorDtypes={dtypes}"
        if self.op:
            text += f", ReduceOp={self.op.upper()}"
        if self.root >= 0:
            text += f", Root={self.root}"
        return text + ")"


def _differs(lo: list[int], hi: list[int]) -> list[str]:
    return list(dict.fromkeys(name for name, a, b in zip(_FIELDS, lo, hi) if a != b))


def mismatch_error(store, check: int, rank: int, world: int, fp: Fingerprint, err) -> LuwuError:
    """The error of a collective whose fingerprint the ranks disagreed on (`err`: the engine's
    CollectiveMismatch, with each field's MIN and MAX over the ranks). Publishes this rank's
    description under the agreed check number and names every rank's it can read within
    EXPLAIN_WAIT s (every rank of the group fails the same check, so each publishes)."""
    differs = _differs(err.lo, err.hi)
    mine = {"describe": fp.describe(), "torch": fp.torch_words(), "seq": fp.seq}
    others: dict[int, dict] = {rank: mine}
    try:
        store.set(MISMATCH_KEY.format(check=check, rank=rank), json.dumps(mine))
        keys = [MISMATCH_KEY.format(check=check, rank=r) for r in range(world) if r != rank]
        if keys:
            store.wait(keys, timedelta(seconds=EXPLAIN_WAIT))
        for r in range(world):
            if r != rank:
                others[r] = json.loads(store.get(MISMATCH_KEY.format(check=check, rank=r)))
    except Exception:  # noqa: BLE001 - a rank that never published (dead, or gone on): name what is known
        pass
    name = f"{fp.kind} #{fp.seq}"
    if len(others) == world and world > 1 and all(d == mine for d in others.values()):
        # every rank describes the same collective: the disagreement came from the agreement's lanes,
        # corrupted in flight in a way their tags did not catch (engine/agreement.py), not from the program
        return CorruptedAgreementError(
            f"luwu {name}: the ranks' fingerprints of this collective disagreed in flight, yet every rank "
            f"reports the same call ({fp.describe()}): a packet of the agreement was corrupted on the way "
            "(a faulty NIC, cable or switch memory); the program is not at fault. This group is unusable now; "
            "check the network path (the switch's and engines' drop counters) and restart the job")
    if detail():
        theirs = [f"Rank {r} is running collective: {d['torch']}" for r, d in sorted(others.items()) if r != rank]
        text = (f"Detected mismatch between collectives on ranks. Rank {rank} is running collective: "
                f"{mine['torch']}, but {', '.join(theirs) if theirs else 'another rank differs in ' + ', '.join(differs)}"
                f". Collectives differ in the following aspects: {', '.join(differs)}")
        return CollectiveMismatchError(f"luwu {name}: {text}")
    ranks = ", ".join(f"rank {r} has {d['describe']}" + (f" (its #{d['seq']})" if d["seq"] != fp.seq else "")
                      for r, d in sorted(others.items()))
    if len(others) < world:
        ranks += f"; the other ranks did not say (they differ in: {', '.join(differs)})"
    return CollectiveMismatchError(
        f"luwu {name}: the ranks called different collectives (differing: {', '.join(differs)}): {ranks}. Every rank "
        "must call the same collectives in the same order with the same sizes, dtypes and ops; this group is "
        "unusable now")


class CollectiveMismatchError(LuwuError):
    """The ranks of a group called different collectives (fingerprint.py); raised on every rank."""


class CorruptedAgreementError(LuwuError):
    """The ranks' fingerprints of a collective disagreed on the wire although every rank called the
    same collective (read back through the store): corruption in flight, not a program error."""
