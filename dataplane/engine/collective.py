"""A worker's side of a `collective` session: ALLREDUCE out, RESULT back (docs/protocol.md 7.1).

Each `ReduceOp` is one in-network reduction of a buffer of int32 lanes: it reserves a range of
the session's sequence numbers when submitted, gets its packets when its values are known (a
float sum first needs the agreed exponents), and completes when every chunk's RESULT is in.
RESULTs are also the acknowledgements of this stream, and its selective acknowledgements: each
names the one packet it answers, so the send stream learns every hole (send_stream.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import fixed16
from ..integrity import FIXED16_BLOCK, HEADER_CHECK_TABLE, check_lanes, unpack_exponents
from ..kernels import use_numba
from ..protocol import DATA_HEADER, HCHECK_OFFSET, HEADER_LEN, LANE_CHUNK, Dtype, Flag, MsgType
from ..quantize import EXP_MIN, as_words, fixed_point_kernels, num_chunks
from ..session import SessionSpec
from . import agreement
from .packets import (
    TERM_LAYOUT,
    LanesOf,
    aggregation_fill,
    check_words_hold,
    exponent16_fill,
    fixed16_fill,
    in_bounds,
    payload_int32,
    slice_lanes,
)
from .send_stream import RtoEstimator, Segment, SendStream
from .window import RecvWindow

# (chunk indices, received rows, the rows of those chunks, header exponents): reads the lanes in place
Decode = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
SATURATED = np.uint8(Flag.SATURATED)
CHECK = check_lanes(Dtype.INT32)  # check lanes of the 32-bit formats a collective session carries
CORRUPT_TRIES = 3  # RESULTs of one chunk failing their check words in a row: the stored sum is wrong


class FailedChecks:
    """Packets of each sequence number that failed their check words in a row (docs/protocol.md
    3.6): a resend that fails CORRUPT_TRIES times means the switch's stored sum is wrong. Shared
    by the workers' RESULT receiver (below) and the node's AGG receiver (node_server.py)."""

    def __init__(self) -> None:
        self._runs: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def failed(self, seq: int) -> bool:
        """Count one failure of `seq`; True (and forget it) at its CORRUPT_TRIES-th in a row."""
        n = self._runs.get(seq, 0) + 1
        if n < CORRUPT_TRIES:
            self._runs[seq] = n
            return False
        self._runs.pop(seq, None)
        return True

    def passed(self, seqs: list[int]) -> None:
        """Packets of `seqs` passed: their runs of failures end."""
        if self._runs:
            for seq in seqs:
                self._runs.pop(seq, None)
_ANY, _ALL = np.logical_or.reduce, np.logical_and.reduce  # without ndarray.any's Python wrapper (per batch)
# header fields' byte offsets, for the compiled RESULT pass (the layout is protocol.py's)
_SEQ_AT, _TENSOR_AT, _OFFSET_AT, _FLAGS_AT = (DATA_HEADER.fields[f][1] for f in ("seq", "tensor", "offset", "flags"))
_DTYPE_AT, _COUNT_AT, _NUMEL_AT = (DATA_HEADER.fields[f][1] for f in ("dtype", "count", "numel"))
_MAX16 = np.uint8(Flag.MAX)
_SKIP32 = int(Flag.SATURATED | Flag.MAX)  # RESULTs the whole-batch pass leaves to the references
_NO_TABLE = (np.zeros(0, np.uint16), np.zeros(0, np.intp))  # its header checks made already
_SKIP16 = np.uint8(Flag.SATURATED | Flag.MAX)  # FIXED16 RESULTs the compiled pass leaves to the reference


class ReduceOp:
    __slots__ = (
        "chunks",
        "decode",
        "dtype",
        "fixed",
        "fixed16",
        "flags",
        "got",
        "numel",
        "on_done",
        "op_id",
        "per",
        "result",
        "saturated",
        "saturated_chunks",
        "seg",
        "session",
        "tagged",
    )

    def __init__(self, session: CollectiveSession, op_id: int, numel: int, dtype: Dtype, flags: int,
                 seg: Segment, decode: Decode | None, on_done: Callable[[ReduceOp], None], per: int = 0):
        self.session = session
        self.op_id = op_id
        self.numel = numel
        self.per = per or session.lanes  # elements per packet: the lanes, or a FIXED16 packet's data lanes
        self.chunks = num_chunks(numel, self.per)
        self.dtype = dtype
        self.flags = flags
        self.seg = seg
        self.decode = decode
        self.on_done = on_done
        self.result = None if decode else np.zeros((self.chunks, session.lanes), dtype=np.int32)
        self.got = 0
        # a float sum's (s1, s2, flat whole-chunk output, whole chunks, flat tail) once its factors
        # are known: what the compiled RESULT pass decodes with (None: the reference `decode` only)
        self.fixed: tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray] | None = None
        # a FIXED16 sum's (flat float32 output, 2^(e + c - 15) table) once its exponents are agreed:
        # the compiled RESULT pass decodes with them (None: the reference `decode` only)
        self.fixed16: tuple[np.ndarray, np.ndarray] | None = None
        self.saturated = False
        self.saturated_chunks: list[np.ndarray] = []  # chunk indices whose RESULT carried SATURATED
        # an agreement's self-checking lanes (docs/protocol.md 3.8), checked per RESULT in `_verified`:
        # (fingerprint fields k, end): lanes [0, agreement.lanes(k)) a fingerprint, then exponent
        # lanes up to `end`; None: no tagged lanes
        self.tagged: tuple[int, int] | None = None

    def absorb(self, chunk: np.ndarray, rows: np.ndarray, sel: np.ndarray, flags: np.ndarray, exps: np.ndarray) -> bool:
        if self.decode is not None:
            self.decode(chunk, rows, sel, exps)
        else:
            self.result[chunk] = payload_int32(rows[sel], self.session.lanes)
        self.got += len(chunk)
        sat = (flags & SATURATED) != 0
        if _ANY(sat):
            self.saturated = True
            self.saturated_chunks.append(chunk[sat])
        return self.got >= self.chunks


class CollectiveSession:
    def __init__(self, spec: SessionSpec, rank: int, sock, rto: RtoEstimator, now: float):
        self.spec = spec
        self.id = spec.session
        self.rank = rank
        # a packet's last CHECK lanes are its check words (docs/protocol.md 3.6): `lanes` elements
        # of data per packet, `row_lanes` (the switch's lane count) on the wire
        self.row_lanes = spec.lanes
        self.lanes = spec.lanes - CHECK
        if self.lanes < 1:
            raise ValueError(f"a collective session needs more than {CHECK} lanes per packet (its last {CHECK} "
                             f"are check words), not {spec.lanes}")
        self.n = spec.num_workers  # contributors of every sum this session receives
        self._failures = FailedChecks()  # RESULTs that failed their check words, per seq
        self.window = RecvWindow(spec.pool_size)
        # refill: an op's fill reads its source (the caller's buffer, the agreed exponents),
        # which stays as it was for every chunk whose RESULT has not arrived (a RESULT is what
        # may overwrite an in-place buffer's chunk, and `received` skips those chunks)
        self.send = SendStream(sock, spec.pool_size, rto, HEADER_LEN + 4 * spec.lanes, now,
                               received=self.window.received_mask, refill=True)
        self.ops: dict[int, ReduceOp] = {}
        self.next_op = 0
        self.stats = {"ops": 0, "results": 0, "duplicates": 0, "stale": 0, "dropped.bad_check": 0,
                      "corrupt_chunks": 0}
        self._fresh = np.empty(spec.pool_size, dtype=np.int64)  # the compiled pass's fresh seqs (a batch fits the window)
        self._info = np.zeros(4, dtype=np.int64)  # and its window advance and delivery summary

    # -- submission (engine thread) -----------------------------------------------------------------
    def new_op(self, numel: int, dtype: Dtype, lane_max: bool, on_done: Callable[[ReduceOp], None],
               decode: Decode | None = None, per: int = 0) -> ReduceOp:
        """A reduction of `numel` elements, `per` per packet (default: the session's lanes)."""
        op_id = self.next_op
        self.next_op = (self.next_op + 1) & 0xFFFFFFFF
        seg = self.send.reserve(num_chunks(numel, per or self.lanes))
        op = ReduceOp(self, op_id, numel, dtype, int(Flag.MAX) if lane_max else 0, seg, decode, on_done, per)
        self.ops[op_id] = op
        self.stats["ops"] += 1
        return op

    def ready(self, op: ReduceOp, lanes_of: LanesOf, exponents: np.ndarray | None = None) -> None:
        """The op's lanes can now be produced, block by block, just before they are sent."""
        s = self.spec
        op.seg.ready(aggregation_fill(
            seg_start=op.seg.start, msg_type=MsgType.ALLREDUCE, session=s.session, worker=self.rank,
            pool_base=s.pool_base, pool_size=s.pool_size, lanes=self.lanes, tensor=op.op_id, numel=op.numel,
            dtype=op.dtype, lanes_of=lanes_of, flags=op.flags, exponents=exponents, row_lanes=self.row_lanes))

    def ready_fixed16(self, op: ReduceOp, x: np.ndarray, exps: np.ndarray, n: int,
                      live: Callable[[], bool] | None = None) -> None:
        """A FIXED16 sum's packets can now be produced (packets.fixed16_fill)."""
        s = self.spec
        op.seg.ready(fixed16_fill(
            seg_start=op.seg.start, msg_type=MsgType.ALLREDUCE, session=s.session, worker=self.rank,
            pool_base=s.pool_base, pool_size=s.pool_size, lanes=self.row_lanes, tensor=op.op_id, x=x, exps=exps, n=n,
            live=live))

    def agree_exponents16(self, exps: np.ndarray, on_agreed: Callable[[np.ndarray | None, bool], None]) -> ReduceOp:
        """A MAX of per-block exponents, one lane each (packets.exponent16_fill). `on_agreed(e,
        saturated)` gets the agreed exponents, or None when a RESULT's tag or check lanes were wrong."""
        agreed = np.zeros(len(exps), dtype=np.int32)
        corrupt = [False]

        def decode(chunk: np.ndarray, rows: np.ndarray, sel: np.ndarray, _e: np.ndarray) -> None:
            # `_verified` checked these rows (fixed16.verify_rows: check lanes, every tag) unless one
            # was let through SATURATED after failing that, or is not a FIXED16 MAX: then again here
            f = rows[sel, _FLAGS_AT]
            checked = not ((f & SATURATED).any() or ((f & _MAX16) == 0).any()
                           or (rows[sel, _DTYPE_AT] != int(Dtype.FIXED16)).any())
            if not fixed16.decode_agreement_rows(rows, sel, self.row_lanes, chunk, agreed, checked):
                corrupt[0] = True

        op = self.new_op(len(exps), Dtype.FIXED16, True, lambda o: on_agreed(None if corrupt[0] else agreed,
                                                                            o.saturated),
                         decode, per=fixed16.agreement_lanes(self.row_lanes))
        s = self.spec
        op.seg.ready(exponent16_fill(seg_start=op.seg.start, session=s.session, worker=self.rank,
                                     pool_base=s.pool_base, pool_size=s.pool_size, lanes=self.row_lanes,
                                     tensor=op.op_id, exps=exps))
        return op

    def set_values(self, op: ReduceOp, values: np.ndarray) -> None:
        """All lanes known already (int32, chunks * lanes)."""
        self.ready(op, slice_lanes(values, self.lanes))

    # -- packets (engine thread) --------------------------------------------------------------------
    def on_results(self, idx: np.ndarray, rows: np.ndarray, h: np.ndarray, now: float) -> None:
        """RESULT packets `rows[idx]` (headers `h[idx]`; idx ascending, as the engine groups a batch)."""
        if self.ops and len(idx) == len(h) and not self._failures:  # a FIXED16 sum's common batch: one compiled pass
            op = next(iter(self.ops.values()))
            if op.fixed16 is not None and self._compiled_results16(op, rows, h, now):
                return
        idx = self._verified(idx, rows, h)
        if self.ops and len(idx):
            idx = in_bounds(idx, h, self.stats, self._chunk_of)
        if not len(idx):
            return
        every = len(idx) == len(h)  # idx is all of h's rows, in order (the engine's common batch)
        if every and self.ops and (self._compiled_results(rows, h, now)
                                   or (len(h) == 1 and self._one_result(rows, h, now))):
            return
        seqs = h["seq"] if every else h["seq"][idx]
        new = self.window.accept(seqs)
        fresh = int(np.count_nonzero(new))
        if fresh < len(idx):
            self.stats["duplicates"] += len(idx) - fresh
            idx = idx[new]
            seqs = seqs[new]
            every = False
        if fresh:
            hs = h if every else h[idx]  # the new RESULTs' headers, gathered once
            tensors = hs["tensor"]
            if _ALL(tensors == tensors[0]):  # the common batch: one op's results, no grouping
                self._absorb(int(tensors[0]), idx, rows, hs)
            else:
                for op_id in np.unique(tensors):
                    mine = tensors == op_id
                    self._absorb(int(op_id), idx[mine], rows, hs[mine])
        if self.window.advance():
            self.send.on_ack(self.window.ack, self.window.credit(), now, sample=False)
        # RESULTs are per-packet delivery news (SACK): RTT samples only from in-order ones, and
        # every hole a later RESULT reveals is resent at once (a hole is a loss: docs/protocol.md 7.1)
        self.send.on_delivered(seqs, now)

    def on_result_batch(self, rows: np.ndarray, lens: np.ndarray, h: np.ndarray, now: float,
                        checked: bool = True) -> bool:
        """A whole received RESULT batch (`rows`, lengths `lens`, headers `h`) of the oldest op, a
        FIXED32 float sum, in one compiled pass (kernels/fixed_point.py `absorb_checked_results`):
        unless `checked`, the header checks and the one-session test of dispatch.py `_dispatch`;
        then the length check and short-packet widening of `_handle`, then `on_results`
        (`_verified`, `in_bounds`, `_compiled_results`), which are its references
        (tests/engine/test_checked_results.py). False wherever a row would not pass all of them (a
        corrupted, foreign, stale or SATURATED one...): the caller then runs the references, which
        count and drop exactly as ever. Nothing has changed then but, after a failed check word,
        the decoded output of rows before it that passed every check, which the references decode
        again with the same bits (the kernel's docstring)."""
        if not self.ops or not use_numba():
            return False
        op = next(iter(self.ops.values()))  # the oldest op: the one whose RESULTs come first
        fixed = op.fixed
        if fixed is None or op.dtype != Dtype.FIXED32 or op.per != self.lanes or not h.flags.c_contiguous \
                or rows.shape[1] < HEADER_LEN + 4 * self.row_lanes:
            return False
        words = as_words(rows, HEADER_LEN)
        if words is None:
            return False
        w = self.window
        s1, s2, out, full, tail = fixed
        k = len(h)
        at, width, mult = TERM_LAYOUT
        fresh = fixed_point_kernels().absorb_checked_results(
            h.view(np.uint8), HEADER_LEN, k, lens, _SEQ_AT, _TENSOR_AT, _OFFSET_AT, _FLAGS_AT, _COUNT_AT, _NUMEL_AT,
            _DTYPE_AT, _SKIP32, int(Dtype.FIXED32), LANE_CHUNK, self.row_lanes, at, width, mult, int(MsgType.GRAD),
            int(MsgType.AGG), self.n, w.bits, w.ack, op.op_id, self.lanes, op.chunks, op.numel, words,
            rows.shape[1] // 4, HEADER_LEN // 4, s1, s2, out, full, tail, self.send.retx, self.send.xmit_no,
            self.send.sack_high, self._fresh, self._info, *(_NO_TABLE if checked else HEADER_CHECK_TABLE), HCHECK_OFFSET,
            h.view(np.uint8))
        if fresh < 0:
            return False
        if self._failures:  # as `_verified`: every row passed its check words
            self._failures.passed(h["seq"].tolist())
        self._absorbed(op, k, fresh, now)
        return True

    def _verified(self, idx: np.ndarray, rows: np.ndarray, h: np.ndarray) -> np.ndarray:
        """The RESULTs among `idx` whose check words hold for a sum of `n` contributions
        (docs/protocol.md 3.6). A failed one is dropped and counted, as if lost: the stream's
        resend gets the switch's stored copy, which cures a corruption after the switch. A chunk
        that fails CORRUPT_TRIES times in a row has a wrong stored sum (a contribution was
        corrupted before the switch): it is let through flagged SATURATED, which takes the
        exact path (reductions.py), never a plausible number."""
        hs = h[idx]
        dtypes = hs["dtype"]
        if len(idx) and _ALL(dtypes == dtypes[0]) and int(dtypes[0]) != int(Dtype.FIXED16):  # the common batch
            ok = check_words_hold(rows, idx, self.lanes, hs, int(dtypes[0]), self.n)
        else:
            ok = np.ones(len(idx), dtype=bool)
            for d in np.unique(dtypes).tolist():
                mine = dtypes == d if len(idx) > 1 else slice(None)
                if d == int(Dtype.FIXED16):  # packed int16 slots, 4 16-bit check words: dataplane/fixed16.py
                    ok[mine] = fixed16.verify_rows(rows, np.atleast_1d(idx[mine]), self.row_lanes, self.n)
                    continue
                ok[mine] = check_words_hold(rows, np.atleast_1d(idx[mine]), self.lanes, hs[mine], d, self.n)
        if self.ops and _ANY(hs["flags"] & int(Flag.MAX)):  # an agreement's lanes carry their own tags
            self._tags_ok(idx, rows, hs, ok)
        if ok.all():
            if self._failures:  # (no list built on the hot path)
                self._failures.passed(hs["seq"].tolist())
            return idx
        keep = ok.copy()
        for j in np.flatnonzero(~ok).tolist():
            if not self._failures.failed(int(hs["seq"][j])):
                self.stats["dropped.bad_check"] += 1
                continue
            self.stats["corrupt_chunks"] += 1
            i = int(idx[j])
            rows[i, _FLAGS_AT] |= SATURATED
            h["flags"][i] |= SATURATED
            keep[j] = True
        self._failures.passed(hs["seq"][ok].tolist())
        return idx[keep]

    def _chunk_of(self, t: int, hs: np.ndarray, mine: np.ndarray) -> tuple[int, int, None] | None:
        """What a RESULT of op `t` must name (packets.in_bounds): a chunk of it, a whole chunk of
        `per` elements within its numel. RESULTs of no op here are left to `_absorb` (stale)."""
        op = self.ops.get(t)
        return None if op is None else (op.per, op.numel, None)

    def _tags_ok(self, idx: np.ndarray, rows: np.ndarray, hs: np.ndarray, ok: np.ndarray) -> None:
        """Clear `ok` of the RESULTs of a tagged op (ReduceOp.tagged) whose lane tags fail. A MAX
        packet's check words cover its header only (docs/protocol.md 3.6), so a lane corrupted after
        the switch is caught here, per packet: dropped like a failed check and resent, rather than
        found once the op is accepted, when only this worker would take the exact path."""
        for j in np.flatnonzero(ok).tolist():
            op = self.ops.get(int(hs["tensor"][j]))
            if op is None or op.tagged is None:
                continue
            k, end = op.tagged
            fp = agreement.lanes(k) if k else 0
            off = int(hs["offset"][j])
            lo, hi = max(fp, off), min(end, off + self.lanes)
            # the packet's tagged lanes only (those before `end`; the fingerprint's come first): an
            # agreement is a few dozen lanes of a packet of thousands
            vals = rows[int(idx[j]), HEADER_LEN:HEADER_LEN + 4 * max(0, hi - off)].view(">i4").astype(np.int32)
            good = hi <= lo or bool(_ALL(unpack_exponents(vals[lo - off:hi - off])[1]))
            if good and fp and off == 0 and fp <= self.lanes:  # a fingerprint within this one packet
                good = bool(_ALL(agreement.lanes_ok(vals[:fp], k)))
            ok[j] = good

    def _compiled_results(self, rows: np.ndarray, h: np.ndarray, now: float) -> bool:
        """`on_results` for the common batch in one compiled pass (dataplane/kernels/fixed_point.py
        `absorb_fixed_results`): every row new or a duplicate within the window, ascending, of the
        oldest op, a float sum, none SATURATED. False, with nothing changed, for anything else
        (the numpy code below is the reference: tests/engine/test_compiled_results.py)."""
        op = next(iter(self.ops.values()))  # the oldest op: the one whose RESULTs come first
        if op.fixed16 is not None:  # (checked again after `_verified`: a batch a failed check had made wait)
            return self._compiled_results16(op, rows, h, now)
        fixed = op.fixed
        if fixed is None or not use_numba() or not h.flags.c_contiguous:
            return False
        words = as_words(rows, HEADER_LEN)
        if words is None:
            return False
        w = self.window
        s1, s2, out, full, tail = fixed
        k = len(h)
        fresh = fixed_point_kernels().absorb_fixed_results(
            h.view(np.uint8), HEADER_LEN, k, _SEQ_AT, _TENSOR_AT, _OFFSET_AT, _FLAGS_AT, SATURATED, w.bits, w.ack,
            op.op_id, self.lanes, op.chunks, words, rows.shape[1] // 4, HEADER_LEN // 4, s1, s2, out, full, tail,
            self.send.retx, self.send.xmit_no, self.send.sack_high, self._fresh, self._info)
        if fresh < 0:
            return False
        self._absorbed(op, k, fresh, now)
        return True

    def _compiled_results16(self, op: ReduceOp, rows: np.ndarray, h: np.ndarray, now: float) -> bool:
        """`on_results` for a FIXED16 sum's common batch in one compiled pass, check words included
        (kernels/fixed16_rows.py `absorb_fixed16_results`): every row `_verified` and `in_bounds`
        would pass, new or a duplicate within the window, ascending, of the oldest op, a plain sum
        (not SATURATED, not MAX). The reference is `on_results`' numpy code with the op's `decode`
        (reductions.py `_decode16`). False, with nothing changed, for anything else."""
        if not use_numba() or not h.flags.c_contiguous or rows.ndim != 2 or rows.dtype != np.uint8 \
                or rows.shape[1] % 2 or not rows.flags.c_contiguous or rows.shape[0] < len(h):
            return False
        words = rows.reshape(-1).view(np.uint16)
        if not words.flags.aligned:
            return False
        out, pow2 = op.fixed16
        nb = fixed16.layout(self.row_lanes)[0]
        w = self.window
        k = len(h)
        hb = h.view(np.uint8).reshape(k, HEADER_LEN)
        fresh = fixed16.kernels().absorb_fixed16_results(
            hb.reshape(-1), HEADER_LEN, k, _SEQ_AT, _TENSOR_AT, _OFFSET_AT, _FLAGS_AT, _DTYPE_AT, _COUNT_AT, _NUMEL_AT,
            _SKIP16, int(Dtype.FIXED16), w.bits, w.ack, op.op_id, op.numel, op.per, op.chunks, words,
            rows.shape[1] // 2, HEADER_LEN // 2, 2 * self.row_lanes, nb, FIXED16_BLOCK, self.n, fixed16.header_terms(hb),
            pow2, -EXP_MIN, out, self.send.retx, self.send.xmit_no, self.send.sack_high, self._fresh, self._info)
        if fresh < 0:
            return False
        self._absorbed(op, k, fresh, now)
        return True

    def _absorbed(self, op: ReduceOp, k: int, fresh: int, now: float) -> None:
        """The counts, the op's completion, the window's ack and the send stream's delivery news
        after a compiled RESULT pass took `k` rows, `fresh` of them new."""
        w = self.window
        w.changed()
        dup = k - fresh
        if dup:
            w.duplicates += dup
            self.stats["duplicates"] += dup
        if fresh:
            self.stats["results"] += fresh
            op.got += fresh
            if op.got >= op.chunks:
                del self.ops[op.op_id]
                op.on_done(op)
        moved, in_order, newest, rack = self._info.tolist()
        if moved:
            w.ack = (w.ack + moved) & 0xFFFFFFFF
            self.send.on_ack(w.ack, w.credit(), now, sample=False)
        if in_order and fresh:
            self.send.delivered_in_order(newest, rack, now)
        elif fresh:
            self.send.on_delivered(self._fresh[:fresh], now)

    def _one_result(self, rows: np.ndarray, h: np.ndarray, now: float) -> bool:
        """`on_results` for a batch of one new RESULT of an op without a `decode` (an exponent
        agreement before a push: one chunk, exact) in Python scalars, as the numpy code below
        does it (the reference: tests/engine/test_allreduce.py runs both): a dozen numpy calls on
        arrays of one cost more than the packet. False, with nothing changed, for anything else
        (a duplicate, out of the window, an unknown op or chunk)."""
        _vt, flags, _s, _w, _c, seq, _slot, tensor, offset = h[0].item()[:9]
        w = self.window
        op = self.ops.get(tensor)
        chunk = offset // self.lanes
        pos = seq & (w.size - 1)
        if op is None or op.decode is not None or ((seq - w.ack) & 0xFFFFFFFF) >= w.size or w.bits[pos] \
                or chunk >= op.chunks:
            return False
        w.bits[pos] = True
        w.changed()
        # its elements only (an agreement's few dozen of a packet's thousands of lanes); the lanes past
        # numel stay the zeros the result was made with (no reader looks past numel)
        m = min(self.lanes, op.numel - chunk * self.lanes)
        op.result[chunk, :m] = rows[0, HEADER_LEN:HEADER_LEN + 4 * m].view(">i4")
        self.stats["results"] += 1
        op.got += 1
        if flags & SATURATED:
            op.saturated = True
            op.saturated_chunks.append(np.array([chunk], dtype=np.int64))
        if op.got >= op.chunks:
            del self.ops[op.op_id]
            op.on_done(op)
        send = self.send
        if w.advance():
            send.on_ack(w.ack, w.credit(), now, sample=False)
        row = seq & (len(send.retx) - 1)
        if ((seq - send.sack_high) & 0xFFFFFFFF) < 0x80000000 and not send.retx[row]:
            send.delivered_in_order(seq, int(send.xmit_no[row]), now)  # on_delivered's common batch
        else:
            send.on_delivered(np.array([seq], dtype=np.int64), now)
        return True

    def _absorb(self, op_id: int, sel: np.ndarray, rows: np.ndarray, hs: np.ndarray) -> None:
        """Rows `sel` (headers `hs`) are op `op_id`'s first RESULTs for their chunks."""
        op = self.ops.get(op_id)
        if op is None:
            self.stats["stale"] += len(sel)
            return
        chunk = (hs["offset"] // op.per).astype(np.int64)
        self.stats["results"] += len(sel)
        if op.absorb(chunk, rows, sel, hs["flags"], hs["exponent"]):
            del self.ops[op.op_id]
            op.on_done(op)

    def pump(self, now: float) -> int:
        return self.send.pump(now)

    def on_timer(self, now: float) -> None:
        self.send.check_timeout(now)

    def wake_at(self) -> float:
        """The engine may sleep until then unless a packet arrives: RESULTs are all it waits for."""
        return self.send.deadline()

    def busy(self) -> bool:
        return bool(self.ops) or not self.send.idle()
