"""How an allreduce of a dtype and an op crosses the network (docs/protocol.md 5).

float sum/avg: agree per-chunk exponents with a MAX on the `meta` session, then FIXED32 sums on
the `data` session. float max/min: ORDERED32 with lane MAX (min negates the keys; NaN is made
the winning key first, so NaN propagates as in torch.maximum/minimum). int32: INT32 sum
(wrapping like numpy) or max/min. Results are decoded as RESULT packets arrive, so no int32 copy
of the whole result is kept.

A float sum chunk whose RESULT carries SATURATED (some contributor had inf/NaN or a value the
agreed exponent could not hold) cannot be read from the fixed-point sum: the engine never returns
its clipped value but fills that chunk with NaN and sets `handle.saturated`, so a caller recomputes
exactly those elements on an exact path (the torch backend: worker/backend/fallback.py) and a
caller that does not still sees no plausible number (docs/protocol.md 5.1). An in-place sum
(`out` is `x`: the torch backend reduces a tensor in its own storage) would lose this worker's
inputs of those chunks to the decode: the engine copies them aside just before their RESULTs are
decoded and hands them over as `handle.info["kept"]` (the inputs at the result's NaN elements, in
order), so the exact path still has them; nothing is kept when nothing saturates.

A fingerprint (`check`: non-negative int32 fields the caller packs, e.g. the collective, dtype,
element count, reduce op and sequence number) is agreed on the meta session before any result is
used: every worker sends each field's 16-bit halves and their complements, each lane tagged so it
checks itself (agreement.py), the switch takes the lane MAX, so every worker reads max(v) and
min(v) of every field and sees the same disagreement. A lane whose tag fails was corrupted in
flight: that is no disagreement; it is counted (the meta session's `agreement.corrupt`, the
handle's info["agreement_corrupt"]) and the collective goes on, its data checked as ever; so does
a fingerprint whose stored MAX failed its check words on every resend (`_checked`). A float sum's
fields ride in the exponent agreement it makes anyway (no extra packet; its data is not sent when
they differ); any other reduction sends one meta packet beside its data, waited for with it. A
disagreement fails the handle with `CollectiveMismatch`, never a result.
"""

from __future__ import annotations

import numpy as np

from .. import fixed16
from ..integrity import FIXED16_BLOCK, pack_exponents, unpack_exponents
from ..protocol import DATA_HEADER, HEADER_LEN, Dtype, Flag
from ..quantize import (
    FIXED16_MAX_CONTRIBUTORS,
    block_exponents,
    chunk_exponents,
    dequantize_rows_scaled,
    fixed16_bits,
    from_ordered,
    negate_order,
    num_chunks,
    pow2_split,
    sum_shift,
    to_ordered,
)
from . import agreement
from .collective import CollectiveSession, ReduceOp
from .handles import CollectiveMismatch, CorruptResult, EngineError, Handle
from .packets import QuantizedLanes, payload_int32

OPS = ("sum", "avg", "max", "min")
_FLAGS_AT = DATA_HEADER.fields["flags"][1]  # a RESULT row's flags byte
_SATURATED = np.uint8(Flag.SATURATED)
_DTYPE_AT = DATA_HEADER.fields["dtype"][1]
_FIXED16 = np.uint8(Dtype.FIXED16)
_MAX = np.uint8(Flag.MAX)


def check_reduction(dtype: np.dtype, op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unsupported reduce op {op!r}: luwu reduces with {', '.join(OPS)}")
    if dtype not in (np.float32, np.int32):
        raise TypeError(f"the engine reduces float32 and int32 buffers, not {dtype} (widen bf16/fp16 to float32)")
    if dtype == np.int32 and op == "avg":
        raise ValueError("avg of int32 is not defined; use sum and divide")


class AllreduceOp:
    """One allreduce of a flat float32/int32 buffer over the meta and data sessions."""

    def __init__(self, x: np.ndarray, op: str, n: int, handle: Handle, exps: np.ndarray | None = None,
                 out: np.ndarray | None = None, check: np.ndarray | None = None, grad_format: str = "fixed32"):
        check_reduction(x.dtype, op)
        self.fixed16 = grad_format == "fixed16" and n <= FIXED16_MAX_CONTRIBUTORS  # else FIXED32 (exact as ever)
        self.corrupt: list[int] = []  # FIXED16 chunks whose RESULT failed its check words
        self._lanes16 = 0  # the data session's lanes, once a FIXED16 sum starts
        if check is not None:
            check = np.ascontiguousarray(check, dtype=np.int32).reshape(-1)
            if check.size == 0 or int(check.min()) < 0:
                raise ValueError("an allreduce's check fields must be non-negative int32 values (at least one)")
        self.check = check  # the fingerprint agreed on the meta session (module docstring)
        self._parts = 1  # results to come before the handle completes: the data, and a check of its own
        self._result: np.ndarray | None = None
        self.x = x
        self.op = op
        self.n = n
        self.handle = handle
        self.numel = x.size
        self.local_exps = exps  # computed in the caller's thread for float sums
        self.exps: np.ndarray | None = None
        self.scale: tuple[np.ndarray, np.ndarray] | None = None  # each chunk's sum_shift as pow2_split's factors
        # results are decoded straight into `dest` (the caller's `out`, or a new array): whole
        # chunks into `out`, a view of it, and a short last chunk into `tail` (lanes past numel
        # would overrun the caller's buffer)
        self.dest = out
        self.out: np.ndarray | None = None
        self.tail: np.ndarray | None = None
        self.saturated = False
        # in place (out is x) float sums: this worker's inputs of saturated chunks, copied before
        # their RESULTs are decoded over them (module docstring); None when not in place
        self.kept: dict[int, np.ndarray] | None = None
        self.exact_only = False  # the exponent agreement came back corrupt: the whole result takes the exact path
        self._sent: np.ndarray | None = None  # max/min: the keys this worker sent, (chunks, lanes)

    @staticmethod
    def local_exponents(x: np.ndarray, op: str, lanes: int, grad_format: str = "fixed32") -> np.ndarray | None:
        """This worker's exponents of a float sum: one per packet (FIXED32) or per block (FIXED16)."""
        if x.dtype == np.float32 and op in ("sum", "avg") and x.size:
            return block_exponents(x, FIXED16_BLOCK) if grad_format == "fixed16" else chunk_exponents(x, lanes)
        return None

    def start(self, meta: CollectiveSession | None, data: CollectiveSession) -> None:
        if meta is None:
            self.check = None  # a plan without a meta session (no float sums either): nothing to agree on
        float_sum = self.x.dtype == np.float32 and self.op in ("sum", "avg") and self.numel > 0
        if self.check is not None and not float_sum:  # its own meta packet, beside the data
            self._parts += 1
            k = agreement.lanes(self.check.size)
            vals = np.zeros(num_chunks(k, meta.lanes) * meta.lanes, dtype=np.int32)
            vals[:k] = self._check_lanes()
            check_op = meta.new_op(k, Dtype.INT32, True, self._checked)
            check_op.tagged = (self.check.size, k)  # its lanes' tags checked per RESULT (collective.py)
            meta.set_values(check_op, vals)
        if self.numel == 0:
            self._result = self.x.copy() if self.dest is None else self.dest
            self._part_done()
            return
        lanes = data.lanes
        chunks = num_chunks(self.numel, lanes)
        if self.dest is None:
            self.dest = np.empty(self.numel, dtype=self.x.dtype)
        elif self.x.dtype == np.float32 and self.op in ("sum", "avg") and np.may_share_memory(self.dest, self.x):
            self.kept = {}
        full = self.numel // lanes
        self.out = self.dest[:full * lanes].reshape(full, lanes)
        if full < chunks:
            self.tail = np.empty((1, lanes), dtype=self.x.dtype)
        if self.x.dtype == np.float32 and self.op in ("sum", "avg"):
            if meta is None:
                raise RuntimeError("a float sum needs the job's meta session; the plan has none")
            if meta.lanes != lanes:
                raise RuntimeError("meta and data sessions must use the same packet mode")
            if self.fixed16:
                self._start_fixed16(meta, data)
                return
            data_op = data.new_op(self.numel, Dtype.FIXED32, False, self._done, self._decode_fixed)
            k = 0 if self.check is None else agreement.lanes(self.check.size)  # the fingerprint, then the exponents
            local = np.zeros(num_chunks(k + chunks, lanes) * lanes, dtype=np.int32)
            if k:
                local[:k] = self._check_lanes()
            local[k:k + chunks] = pack_exponents(self.local_exps)  # each lane self-checking (protocol.md 3.8)
            meta_op = meta.new_op(k + chunks, Dtype.INT32, True, lambda m: self._have_exps(m, data, data_op))
            meta_op.tagged = (0 if self.check is None else self.check.size, k + chunks)  # checked per RESULT
            meta.set_values(meta_op, local)
            return
        if self.x.dtype == np.float32:
            keys = to_ordered(nan_wins(self.x, self.op))  # float max/min (sums returned above)
            dtype = Dtype.ORDERED32
        else:
            keys = self.x
            dtype = Dtype.INT32
        lane_max = self.op in ("max", "min")
        if self.op == "min":
            keys = negate_order(keys)
        padded = np.zeros(chunks * lanes, dtype=np.int32)
        padded[: self.numel] = keys
        if lane_max:  # what this worker sent: a max is never below it (docs/protocol.md 3.6, MAX packets)
            self._sent = padded.reshape(chunks, lanes)
        data_op = data.new_op(self.numel, dtype, lane_max, self._done, self._decode_keys)
        data.set_values(data_op, padded)

    # -- float sums ---------------------------------------------------------------------------
    def _have_exps(self, meta_op: ReduceOp, data: CollectiveSession, data_op: ReduceOp) -> None:
        chunks = data_op.chunks
        agreed = meta_op.result.reshape(-1)
        k = 0 if self.check is None else agreement.lanes(self.check.size)
        # the agreement's stored max failed its check words on every resend (collective.py
        # `_verified`), or a lane's tag does not match (docs/protocol.md 3.8): corrupted in flight
        corrupt = bool(meta_op.saturated_chunks)
        if not corrupt and k and not self._agreed(agreed[:k], meta_op):
            return  # its data is never sent: the workers' data streams no longer match (the caller's group is broken)
        exps, ok = unpack_exponents(agreed[k:k + chunks])
        if corrupt or not ok.all():
            # The data is sent all the same: its sequence range is reserved on the data session,
            # and a segment never filled would block every later op of this engine (a hang, seen
            # with the bit-flipping proxy: tests/integration/integrity_soak.py). Quantised with this
            # worker's own exponents (nothing clips), and the whole result takes the exact path:
            # NaN + saturated, recomputed exactly by the torch backend (worker/backend/fallback.py).
            self.exact_only = True
            exps = self.local_exps
            if self.kept is not None:  # in place: the decode will overwrite every chunk of x
                lanes = data.lanes
                self.kept = {c: self.x[c * lanes: min((c + 1) * lanes, self.numel)].copy() for c in range(chunks)}
        self.exps = exps
        # a sum of N values below 2^127 may pass 2^128: inf, as IEEE rounds it; split once per op,
        # not per received batch
        s1, s2, _ = pow2_split(sum_shift(self.exps, self.n))
        self.scale = (s1, s2)
        self.saturated |= meta_op.saturated
        if self.out.flags.c_contiguous and self.out.dtype == np.float32:  # else only the reference decode
            tail = np.zeros(0, np.float32) if self.tail is None else self.tail.reshape(-1)
            data_op.fixed = (s1, s2, self.out.reshape(-1), len(self.out), tail)
        # live: a resend re-reads x (collective.py refill), which the caller may reuse once its handle failed
        data.ready(data_op, QuantizedLanes(self.x, self.exps, data.lanes, self.n,
                                           live=lambda: not self.handle.done()), exponents=self.exps)

    # -- float sums in FIXED16 (dataplane/fixed16.py) ---------------------------------------------
    def _start_fixed16(self, meta: CollectiveSession, data: CollectiveSession) -> None:
        """The exponent agreement per block of FIXED16_BLOCK elements, then the FIXED16 data."""
        _nb, per = fixed16.layout(data.row_lanes)
        self._lanes16 = data.row_lanes
        blocks = num_chunks(self.numel, FIXED16_BLOCK)
        data_op = data.new_op(self.numel, Dtype.FIXED16, False, self._done16, self._decode16, per=per)
        if self.check is None:  # the exponents alone: one self-checking 32-bit lane per block
            meta.agree_exponents16(self.local_exps, lambda e, sat: self._have_exps16(e, sat, data, data_op))
            return
        k = agreement.lanes(self.check.size)  # the fingerprint rides in int32 lanes, so the exponents do too
        local = np.zeros(num_chunks(k + blocks, meta.lanes) * meta.lanes, dtype=np.int32)
        if k:
            local[:k] = self._check_lanes()
        local[k:k + blocks] = pack_exponents(self.local_exps)  # each lane self-checking (protocol.md 3.8)
        meta_op = meta.new_op(k + blocks, Dtype.INT32, True, lambda m: self._have_block_exps(m, data, data_op))
        meta_op.tagged = (self.check.size, k + blocks)  # checked per RESULT (collective.py `_verified`)
        meta.set_values(meta_op, local)

    def _have_block_exps(self, meta_op: ReduceOp, data: CollectiveSession, data_op: ReduceOp) -> None:
        agreed = meta_op.result.reshape(-1)
        k = 0 if self.check is None else agreement.lanes(self.check.size)
        corrupt = bool(meta_op.saturated_chunks)  # failed its check words or tags on every resend
        if not corrupt and k and not self._agreed(agreed[:k], meta_op):
            return  # the workers' collectives differ: their data streams no longer match
        exps, ok = unpack_exponents(agreed[k:k + num_chunks(self.numel, FIXED16_BLOCK)])
        if corrupt or not ok.all():
            # as `_have_exps`: the data is sent all the same (a reserved range never filled blocks
            # every later op: a hang), quantised with this worker's own exponents, and the whole
            # result takes the exact path (`_done16`)
            self.exact_only = True
            exps = self.local_exps
            if self.kept is not None:  # in place: the decode will overwrite every chunk of x
                per = data_op.per
                self.kept = {c: self.x[c * per: min((c + 1) * per, self.numel)].copy()
                             for c in range(data_op.chunks)}
        self.exps = exps
        self.saturated |= meta_op.saturated
        self._ready16(data, data_op)

    def _ready16(self, data: CollectiveSession, data_op: ReduceOp) -> None:
        """The FIXED16 data can go: its RESULTs may take the compiled pass (collective.py
        `_compiled_results16`, decoding into `dest` as `_decode16` does), its packets are filled."""
        if self.dest.flags.c_contiguous and self.dest.dtype == np.float32 and self.dest.ndim == 1:
            data_op.fixed16 = (self.dest, fixed16.pow2_table(fixed16_bits(self.n)))
        data.ready_fixed16(data_op, self.x, self.exps, self.n, live=lambda: not self.handle.done())

    def _have_exps16(self, agreed: np.ndarray | None, saturated: bool, data: CollectiveSession,
                     data_op: ReduceOp) -> None:
        if agreed is None:  # never quantise with exponents that may not be everyone's
            self.handle.set_error(EngineError("the exponent agreement of a fixed16 sum came back corrupted "
                                              "(a tag or check lane did not match)"))
            agreed = np.full(data_op.numel and -(-data_op.numel // FIXED16_BLOCK), 127, dtype=np.int32)
            # its packets still go, as zeros flagged SATURATED (the handle is done: `live`), so the
            # other workers' sums complete (as NaN + saturated) and the stream stays in step
        self.exps = agreed
        self.saturated |= saturated
        self._ready16(data, data_op)

    def _decode16(self, chunk: np.ndarray, rows: np.ndarray, sel: np.ndarray, _hdr_exps: np.ndarray) -> None:
        lanes = self._lanes16
        per = fixed16.layout(lanes)[1]
        flags = rows[sel, _FLAGS_AT]
        sat = (flags & _SATURATED) != 0
        if self.kept is not None:  # in place: keep the inputs a saturated chunk's decode would overwrite
            for c in chunk[sat].tolist():
                self.kept.setdefault(c, self.x[c * per: min((c + 1) * per, self.numel)].copy())
        # every row here passed collective.py `_verified` on this same buffer, as its own dtype: a
        # FIXED16 sum's check words are verified already unless a row was let through SATURATED
        # after failing them, or is no plain FIXED16 sum (another dtype, an agreement's MAX): then
        # all are checked again
        checked = not (sat.any() or (flags & _MAX).any() or (rows[sel, _DTYPE_AT] != _FIXED16).any())
        ok = fixed16.decode_rows(rows, sel, lanes, self.n, self.dest, checked=checked)
        if not ok.all():  # a corrupted sum: the exact path, never its value (docs/protocol.md 5.2)
            for c in chunk[~ok].tolist():
                if self.kept is not None:
                    self.kept.setdefault(c, self.x[c * per: min((c + 1) * per, self.numel)].copy())
                self.corrupt.append(c)

    def _done16(self, data_op: ReduceOp) -> None:
        per = data_op.per
        if self.exact_only:  # the exponent agreement was corrupt
            data_op.saturated_chunks.append(np.arange(data_op.chunks, dtype=np.int64))
        bad = sorted(set(self.corrupt) | set(np.concatenate(data_op.saturated_chunks).tolist()
                                            if data_op.saturated_chunks else []))
        if bad:
            if self.kept is not None:
                self.handle.info["kept"] = np.concatenate([self.kept[c] for c in bad])
            for c in bad:
                self.dest[c * per: min((c + 1) * per, self.numel)] = np.float32(np.nan)
        if self.op == "avg":
            self.dest /= np.float32(self.n)
        self.handle.saturated = self.saturated or bool(bad)
        self._result = self.dest
        self._part_done()

    def _decode_fixed(self, chunk: np.ndarray, rows: np.ndarray, sel: np.ndarray, _hdr_exps: np.ndarray) -> None:
        if self.kept is not None:  # in place: keep the inputs a saturated chunk's decode would overwrite
            sat = (rows[sel, _FLAGS_AT] & _SATURATED) != 0
            if sat.any():
                lanes = self.out.shape[1]
                for c in chunk[sat].tolist():
                    self.kept.setdefault(c, self.x[c * lanes: min((c + 1) * lanes, self.numel)].copy())
        s1, s2 = self.scale
        s1, s2 = s1[chunk], s2[chunk]
        lanes = self.out.shape[1]
        last = self._last(chunk)
        if last is None:
            dequantize_rows_scaled(rows, sel, HEADER_LEN, lanes, s1, s2, chunk, self.out)
            return
        whole = ~last
        dequantize_rows_scaled(rows, sel[whole], HEADER_LEN, lanes, s1[whole], s2[whole], chunk[whole], self.out)
        dequantize_rows_scaled(rows, sel[last], HEADER_LEN, lanes, s1[last], s2[last],
                               np.zeros(int(last.sum()), np.int64), self.tail)

    def _last(self, chunk: np.ndarray) -> np.ndarray | None:
        """Which of `chunk` is the short last chunk (decoded into `tail`), None when none is."""
        if self.tail is None:
            return None
        last = chunk == len(self.out)
        return last if last.any() else None

    # -- max/min and integers -----------------------------------------------------------------
    def _decode_keys(self, chunk: np.ndarray, rows: np.ndarray, sel: np.ndarray, _hdr_exps: np.ndarray) -> None:
        bad = (rows[sel, _FLAGS_AT] & _SATURATED) != 0  # a corrupt stored sum (collective.py `_verified`)
        if bad.any():  # never decoded: an in-place `out` keeps this worker's input there (`_corrupt`)
            chunk, sel = chunk[~bad], sel[~bad]
            if not len(sel):
                return
        keys = payload_int32(rows[sel], self.out.shape[1]).astype(np.int32)
        if self._sent is not None and (keys < self._sent[chunk]).any():
            # the lanes of a MAX carry no check words of their data: a max below this worker's own
            # key is a corrupted one (docs/protocol.md 3.6); no result from it
            self.handle.set_error(CorruptResult(
                f"allreduce {self.op}: a result lane below this worker's own value (a corrupted RESULT); no result "
                "is given"))
            return
        if self.op == "min":
            keys = negate_order(keys)
        values = from_ordered(keys) if self.x.dtype == np.float32 else keys
        last = self._last(chunk)
        if last is None:
            self.out[chunk] = values
        else:
            self.out[chunk[~last]] = values[~last]
            self.tail[0] = values[last][-1]

    def _corrupt(self, op: ReduceOp, what: str) -> bool:
        """Whether `op` (an exact-lane op: INT32, or ORDERED32 below) came back with chunks whose
        check words failed on every resend (collective.py `_verified` flags them SATURATED, which
        nothing else sets on these dtypes); if so the handle fails, naming them. The data's error
        carries them (`chunks`, `per` elements each) and the result of every other chunk (`result`:
        the corrupt chunks were never decoded, so an in-place one still holds this worker's input
        there), from which a caller recomputes exactly those elements (worker/backend/fallback.py)."""
        if not op.saturated_chunks:
            return False
        bad = sorted(set(np.concatenate(op.saturated_chunks).tolist()))
        result = None
        if op.decode is not None and self.dest is not None:  # the data (not a fingerprint): every good chunk decoded
            result = self.dest
            if self.tail is not None and len(self.out) not in bad:
                result[self.out.size:] = self.tail[0, :self.numel - self.out.size]
        self.handle.set_error(CorruptResult(
            f"{what}: the switch's sum of chunk(s) {bad[:8]} failed its check words on every resend (a "
            f"contribution was corrupted on its way to the switch); no result is given",
            chunks=bad if result is not None else None, per=op.per, result=result))
        return True

    def _done(self, data_op: ReduceOp) -> None:
        if data_op.saturated_chunks and data_op.dtype == Dtype.ORDERED32:
            # float max/min: chunks with a corrupted sum become NaN, which the exact path recomputes
            # as Gloo does (worker/backend/fallback.py); never the corrupted keys
            bad = np.concatenate(data_op.saturated_chunks)
            self.out[bad[bad < len(self.out)]] = np.float32(np.nan)
            if self.tail is not None and (bad == len(self.out)).any():
                self.tail[:] = np.float32(np.nan)
            self.saturated = True
        elif data_op.dtype == Dtype.INT32 and self._corrupt(data_op, "allreduce"):
            return
        if self.exact_only and data_op.dtype == Dtype.FIXED32:  # the exponent agreement was corrupt
            data_op.saturated_chunks.append(np.arange(data_op.chunks, dtype=np.int64))
            self.saturated = True
        if data_op.saturated_chunks and data_op.dtype == Dtype.FIXED32:
            # the clipped fixed-point sum of these chunks is not the sum: never hand it out
            bad = np.concatenate(data_op.saturated_chunks)
            if self.kept is not None:  # the inputs at the NaN elements the result will have, in order
                self.handle.info["kept"] = np.concatenate([self.kept[c] for c in sorted(set(bad.tolist()))])
            self.out[bad[bad < len(self.out)]] = np.float32(np.nan)
            if self.tail is not None and (bad == len(self.out)).any():
                self.tail[:] = np.float32(np.nan)
        result = self.dest
        if self.tail is not None:
            whole = self.out.size
            result[whole:] = self.tail[0, :self.numel - whole]
        if self.op == "avg":
            result /= np.float32(self.n)
        self.handle.saturated = self.saturated or data_op.saturated
        self._result = result
        self._part_done()

    # -- the fingerprint ------------------------------------------------------------------------
    def _check_lanes(self) -> np.ndarray:
        return agreement.pack(self.check)

    def _agreed(self, lanes: np.ndarray, meta_op: ReduceOp) -> bool:
        """Whether every worker sent this fingerprint (lanes: the MAX of the packed lanes); else fail
        the handle. A corrupted lane (agreement.py) is counted; it proves nothing either way, so only the
        halves whose lanes both passed their tags can tell a disagreement."""
        lo, hi, ok, differ = agreement.unpack(lanes, self.check.size)
        if not ok:
            stats = meta_op.session.stats
            stats["agreement.corrupt"] = stats.get("agreement.corrupt", 0) + 1
            self.handle.info["agreement_corrupt"] = True
        if not differ:
            return True
        if not ok:  # a corrupted field's MIN and MAX mean nothing: name only the fields that tell
            good = agreement.fields_ok(lanes, self.check.size)
            mine = self.check.tolist()
            lo = [v if g else m for v, g, m in zip(lo, good.tolist(), mine)]
            hi = [v if g else m for v, g, m in zip(hi, good.tolist(), mine)]
        self.handle.set_error(CollectiveMismatch(
            f"the workers' collectives differ: fields {self.check.tolist()} here, from {lo} to "
            f"{hi} over the workers", lo, hi, self.check.tolist()))
        return False

    def _checked(self, meta_op: ReduceOp) -> None:
        if meta_op.saturated_chunks:
            # the fingerprint's stored MAX failed its check words on every resend (a contribution
            # corrupted before the switch; every worker reads the same): it proves nothing either
            # way, like a lane whose tag fails, and a float sum's corrupt agreement (`_have_exps`).
            # Counted; the data is checked as ever, so the result stands on its own check words.
            stats = meta_op.session.stats
            stats["agreement.corrupt"] = stats.get("agreement.corrupt", 0) + 1
            self.handle.info["agreement_corrupt"] = True
            self._part_done()
            return
        if self._agreed(meta_op.result.reshape(-1), meta_op):
            self._part_done()

    def _part_done(self) -> None:
        self._parts -= 1
        if self._parts == 0:
            self.handle.set_result(self._result)  # ignored when a disagreement failed it first


def nan_wins(x: np.ndarray, op: str) -> np.ndarray:
    """x with every NaN made the key that wins `op` (+NaN for max, -NaN for min), so a NaN in any
    contribution gives NaN, as torch.maximum/minimum do (the ordered encoding ranks +NaN above
    +inf and -NaN below -inf, whatever the NaN's sign bit was)."""
    nan = np.isnan(x)
    if not nan.any():
        return x
    return np.where(nan, np.copysign(np.float32(np.nan), np.float32(1 if op == "max" else -1)), x).astype(np.float32)
