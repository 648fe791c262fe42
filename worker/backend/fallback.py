"""The exact path for float sums the switch could not compute (docs/protocol.md 5.1, docs/backend.md).

A float SUM/AVG chunk whose RESULT carries SATURATED (a contributor had inf/NaN, or a value of at
least 2^127 that the shared exponent cannot hold) comes back from the engine as NaN, and only such
chunks do (a fixed-point sum never decodes to NaN). For those elements every rank sends its raw
float32 input to every other rank over the group's TCP channel (luwu.worker.p2p) and sums the N
contributions locally in rank order in float64, rounded once to float32: IEEE semantics (inf + 1 =
inf, inf + -inf = NaN, a finite sum past the float32 range = inf) and the identical result on
every rank. Every rank learns the same saturated set from the same RESULT flags, so they exchange
the same elements without asking each other.

A float MAX/MIN allreduce, reduce or reduce_scatter whose result has NaN elements (the switch
makes any contributor's NaN win, reductions.py) takes the same exchange for those elements, and
each rank computes what Gloo computes there (codec.gloo_max_min: a NaN is not always the result in
Gloo's ring, and each collective runs its own ring, codec.gloo_ring), so NaN in MAX/MIN gives
Gloo's bits.

A MAX/MIN result from the switch is proven end to end before use (max_proof.py); one that fails
its proof is recomputed here, every element, from every rank's input, in Gloo's order for floats.

The exchange runs from the engine handle's callback and the channel's threads, never blocking the
scheduler's threads, and is matched by a tag every rank assigns in submission order, so saturated
collectives may complete in any order without deadlock. Tags from FALLBACK_TAG_BASE up are
reserved: user send/recv tags are non-negative.

An exact-lane (INT32) allreduce, which carries int sums, max and min and the byte moves
(broadcast, all_gather, barrier, host encodings), has no NaN to mark a chunk whose stored sum failed
its check words on every resend (a contribution corrupted before the switch): the engine fails it
with CorruptResult naming the chunks, with the result of every other chunk (reductions.py). Every
rank gets the same chunks (each reads the switch's one stored sum), so each sends its input words of
those chunks to every other rank and reduces them in rank order, int32 sums wrapping as numpy does
(`guard_exact`, counted in `corrupt_ops` and `corrupt_chunks`): the result the switch would have
given.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from luwu.dataplane.engine import Handle
from luwu.dataplane.engine.handles import CorruptResult

from .codec import gloo_max_min, gloo_ring
from .diagnostics import LuwuError

FALLBACK_TAG_BASE = -(2**62)  # p2p tags of fallback exchanges (HELLO_TAG is -2^63; user tags are >= 0)


def exact_sum(parts: list[np.ndarray], avg: bool) -> np.ndarray:
    """The IEEE sum of the ranks' float32 contributions, in rank order, in float64, rounded once to
    float32 (for two ranks this is exactly float32 a + b; float64 never overflows on float32 inputs,
    so only the final rounding turns a too-large finite sum into inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = parts[0].astype(np.float64)
        for p in parts[1:]:
            total += p
        if avg:
            total /= len(parts)
        return total.astype(np.float32)


class ExactFallback:
    """Recomputes the saturated elements of float sums of one process group over its P2PChannel."""

    def __init__(self, p2p, rank: int, world_size: int):
        from . import max_proof

        self.p2p = p2p
        self.rank = rank
        self.world_size = world_size
        self._next = 0
        self.stats = {"exchanges": 0, "elements": 0, "max_proofs": 0, "max_proof_lanes": 0, "max_proof_failures": 0,
                      "corrupt_ops": 0, "corrupt_chunks": 0}
        self.verify_max = max_proof.enabled()  # LUWU_VERIFY_MAX (max_proof.py)

    def prove(self, ctx, x: np.ndarray, op: str, fp):
        """The MaxProof of a MAX/MIN engine allreduce of x (max_proof.py), or None when it is off;
        call on the submit thread before the engine gets x, then `attach` it to the engine's handle."""
        if not self.verify_max or op not in ("max", "min") or x.size == 0:
            return None
        from .max_proof import MaxProof

        esize = fp.dtypes[0].itemsize if fp is not None and fp.dtypes else 4
        return MaxProof(ctx, x, op, esize, fp.kind if fp is not None else "all_reduce")

    def guard(self, handle: Handle, x: np.ndarray, op: str, esize: int = 4, kind: str = "all_reduce") -> Handle:
        """A handle that completes like `handle`, with any saturated elements recomputed exactly.

        Call on the submit thread, once per float32 SUM/AVG engine allreduce and per float MAX/MIN
        all_reduce, reduce and reduce_scatter(_tensor), in submission order (that order numbers the
        exchange). `x` is this rank's float32 input, read when the result is in; `esize` the bytes
        per element of the caller's dtype and `kind` the collective (fingerprint.KINDS), which tell
        where Gloo's ring cuts a MAX/MIN buffer (codec.gloo_ring). A sum reduced in place (the engine's `out` is `x`) reads
        the inputs the engine kept of its saturated chunks instead (`handle.info["kept"]`).
        """
        tag = self.take_tag()
        out = Handle(handle.name)
        out.info = handle.info

        def done(h: Handle) -> None:
            if h.error is not None:
                out.set_error(h.error)
                return
            result = h.wait()
            if h.info.get("exact"):  # recomputed exactly already (max_proof.py): Gloo's NaN included
                out.set_result(result)
                return
            redo = bool(np.isnan(result).any()) if op in ("max", "min") else h.saturated
            if not redo:
                out.set_result(result)
                return
            try:
                self._exchange(result, x, op, tag, out, esize, h.info.get("kept"), kind)
            except Exception as e:  # noqa: BLE001 - e.g. the channel is closed: this collective fails
                out.set_error(LuwuError(f"luwu {out.name}: the exact recomputation of saturated elements failed: {e}"))

        handle.add_done_callback(done)
        return out

    def guard_exact(self, handle: Handle, x: np.ndarray, op: str) -> Handle:
        """A handle that completes like `handle`, an INT32 allreduce of `x` (sum, max or min), with
        the chunks the engine reports corrupt (CorruptResult.chunks) recomputed exactly from every
        rank's input. Call on the submit thread, once per INT32 engine allreduce, in submission order."""
        tag = self.take_tag()
        out = Handle(handle.name)
        out.info = handle.info
        mine = x.reshape(-1)

        def done(h: Handle) -> None:
            err = h.error
            if err is None:
                out.saturated = h.saturated
                out.set_result(h.wait())
                return
            if not isinstance(err, CorruptResult) or err.chunks is None or err.result is None or err.per <= 0:
                out.set_error(err)
                return
            try:
                result = np.asarray(err.result).reshape(-1)
                per = err.per
                idx = np.concatenate([np.arange(c * per, min((c + 1) * per, mine.size)) for c in err.chunks])
                # in place, a corrupt chunk was never decoded: x still holds this rank's input there
                inputs = mine[idx].copy()
                self.stats["corrupt_ops"] += 1
                self.stats["corrupt_chunks"] += len(err.chunks)
                self._exchange(result, mine, op, tag, out, kept=inputs, idx=idx)
            except Exception as e:  # noqa: BLE001 - e.g. the channel is closed: this collective fails
                out.set_error(LuwuError(f"luwu {out.name}: the exact recomputation of corrupt chunks failed ({e}) "
                                        f"after: {err}"))

        handle.add_done_callback(done)
        return out

    def take_tag(self) -> int:
        """The p2p tag of this group's next exact exchange (on the submit thread: the same on every rank)."""
        tag = FALLBACK_TAG_BASE + self._next
        self._next += 1
        return tag

    def _exchange(self, result: np.ndarray, x: np.ndarray, op: str, tag: int, out: Handle, esize: int = 4,
                  kept: np.ndarray | None = None, kind: str = "all_reduce", idx: np.ndarray | None = None) -> None:
        """Recompute result[idx] (default: its NaN elements) from every rank's x[idx], exactly."""
        if idx is None:
            idx = np.flatnonzero(np.isnan(result))
        if kept is None:
            if idx.size and np.may_share_memory(result, x):  # in place, yet nothing kept: x's inputs are gone
                raise RuntimeError("the inputs of the saturated elements were overwritten by the result")
            mine = np.ascontiguousarray(x.reshape(-1)[idx], dtype=x.dtype)
        else:  # an in-place sum: x holds the result; the engine kept the inputs at its NaN elements (reductions.py)
            if kept.size != idx.size:
                raise RuntimeError(f"the engine kept {kept.size} inputs of saturated chunks for {idx.size} NaN elements")
            mine = np.ascontiguousarray(kept, dtype=x.dtype)
        parts: list[np.ndarray | None] = [None] * self.world_size
        parts[self.rank] = mine
        peers = [r for r in range(self.world_size) if r != self.rank]
        remaining = [len(peers)]
        lock = threading.Lock()
        self.stats["exchanges"] += 1
        self.stats["elements"] += int(idx.size)

        def failed(what: str, err: BaseException) -> None:
            out.set_error(LuwuError(f"luwu {out.name}: exact recomputation of {idx.size} saturated elements: "
                                    f"{what}: {err}"))

        def finish() -> None:
            arrived = [p for p in parts if p is not None]
            if len(arrived) != len(parts):  # finish runs after every receive completed: a missing part is a bug
                failed("a rank's values are missing", RuntimeError(f"{len(arrived)} of {len(parts)} ranks' values"))
                return
            if op in ("max", "min") and result.dtype.kind == "i":
                result[idx] = (np.maximum if op == "max" else np.minimum).reduce(arrived)
            elif op in ("max", "min"):
                owners = gloo_ring(kind, result.size, esize, self.world_size)[idx]
                result[idx] = gloo_max_min([torch.from_numpy(np.array(p)) for p in arrived], op, owners).numpy()
            elif result.dtype.kind == "i":  # an INT32 sum: wraps like numpy int32, in rank order
                total = np.array(arrived[0], dtype=result.dtype)
                for p in arrived[1:]:
                    np.add(total, p, out=total)
                result[idx] = total
            else:
                result[idx] = exact_sum(arrived, op == "avg")
            out.set_result(result)

        def sent(peer: int, err: BaseException | None) -> None:
            if err is not None:
                failed(f"sending to rank {peer}", err)

        def received(err: BaseException | None) -> None:
            if err is not None:
                failed("receiving a rank's values failed", err)
                return
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                finish()

        def deliver(peer: int, payload: bytes) -> None:
            got = np.frombuffer(payload, dtype=mine.dtype)
            if got.size != idx.size:
                raise ValueError(f"rank {peer} sent {got.size} values for {idx.size} saturated elements "
                                 "(the ranks disagree on the saturated chunks)")
            parts[peer] = got

        if not peers:
            finish()
            return
        payload = mine.tobytes()
        for peer in peers:
            self.p2p.send(peer, tag, payload, lambda err, p=peer: sent(p, err))
        for peer in peers:
            self.p2p.recv(peer, tag, lambda b, p=peer: deliver(p, b), received)
