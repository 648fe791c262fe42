"""A worker's side of a `node` session: push gradients (GRAD), pull parameters (PULL -> PARAM).

Push: the layer's exponents are agreed on the job's meta session, then the layer goes out as
FIXED32 GRAD packets; the node's heartbeats (multicast by the switch) acknowledge them and grant
credit, and the push completes when the node has everything. Pull: every worker asks for the
same pull ids in the same order; the node answers each once, multicast; data for a pull this
worker has not posted yet is staged (docs/protocol.md 7.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import fixed16
from ..integrity import FIXED16_BLOCK, TRAILER_LEN, pack_exponents, trailers_ok, unpack_exponents
from ..kernels import use_numba
from ..protocol import DTYPE_ITEMSIZE, HEADER_LEN, Dtype, MsgType
from ..quantize import block_exponents, chunk_exponents, fixed_point_kernels, num_chunks
from ..session import SessionSpec
from .collective import CHECK, CollectiveSession
from .handles import EngineError, Handle
from .heartbeats import HeartbeatPolicy, HeartbeatSender
from .packets import QuantizedLanes, aggregation_fill, fixed16_fill, pull_request_bytes
from .send_stream import RtoEstimator, SendStream
from .transport import packet_sender
from .window import RecvWindow

WIRE_DTYPES = {Dtype.FP32: np.dtype(">f4"), Dtype.FP16: np.dtype(">f2"), Dtype.BF16: np.dtype(">u2")}
NATIVE_DTYPES = {Dtype.FP32: np.float32, Dtype.FP16: np.float16, Dtype.BF16: np.uint16}  # bf16 as raw bits


@dataclass
class PullBuffer:
    tensor: int
    numel: int
    dtype: Dtype
    data: np.ndarray  # chunks * epp elements of the wire dtype, or (direct) the pull's `out`, flat
    got: int = 0
    direct: bool = False  # `data` is the caller's buffer: packets are decoded straight into it


@dataclass
class PullOp:
    pull_id: int
    tensor: int
    version: int
    handle: Handle
    out: np.ndarray | None = None
    requested_at: float = -1e9
    retries: int = 0
    answered: bool = False


_ALL, _ANY = np.logical_and.reduce, np.logical_or.reduce  # without ndarray.all's wrapper (per received batch)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class WorkerNodeSession:
    def __init__(self, spec: SessionSpec, rank: int, sock, rto: RtoEstimator, hb: HeartbeatPolicy,
                 pull_retry: float, now: float):
        self.spec = spec
        self.id = spec.session
        self.rank = rank
        self.sock = sock
        self._send_packet = packet_sender(sock)
        # a GRAD's last CHECK lanes are its check words (docs/protocol.md 3.6): `lanes` gradient
        # elements per packet; PARAM packets fill all `row_lanes` * 4 bytes
        self.row_lanes = spec.lanes
        self.lanes = spec.lanes - CHECK
        # refill: a resend quantises the chunk again from the push's source, which the caller keeps
        # unchanged until the push completes; on a shm port the packets are then written straight
        # into the up ring (no copy of every 64 KiB row from a send ring: send_stream.py)
        self.grad = SendStream(sock, spec.pool_size, rto, HEADER_LEN + 4 * spec.lanes, now, refill=True)
        self.node_heard = now  # last HEARTBEAT from the node (liveness.py: its silence names it dead)
        self.param_window = RecvWindow(_pow2_at_least(spec.param_window))
        self.hb = HeartbeatSender(sock, spec.session, rank, self.param_window, hb, capacity=spec.param_window)
        self.pull_retry = pull_retry
        self.next_pull = 0
        self.pulls: dict[int, PullOp] = {}
        self.buffers: dict[int, PullBuffer] = {}  # by pull id, posted or staged
        self._to_request: list[PullOp] = []
        # when the first of _to_request is due (a PULL to send or resend); recomputed only once
        # something changed (_pull_stale), not per loop turn: most turns have a pull waiting
        self._pull_due = float("inf")
        self._pull_stale = False
        self.stats = {"pushes": 0, "pulls": 0, "param_packets": 0, "param_duplicates": 0, "staged": 0,
                      "pull_requests": 0, "corrupt_agreements": 0}

    # -- push ---------------------------------------------------------------------------------
    def push(self, tensor: int, x: np.ndarray, meta: CollectiveSession, handle: Handle,
             local_exps: np.ndarray | None = None, grad_format: str = "fixed32") -> None:
        """Sum `x` over the workers into the node's layer `tensor` (float32, flat), as FIXED32 or, with
        grad_format "fixed16", FIXED16 packets (`local_exps`: this worker's exponents in that format)."""
        numel = x.size
        if numel == 0:
            handle.set_result(None)
            return
        if grad_format == "fixed16":
            self._push16(tensor, x, meta, handle, local_exps)
            return
        lanes = self.lanes
        chunks = num_chunks(numel, lanes)
        seg = self.grad.reserve(chunks, on_acked=lambda: handle.set_result(None))
        local = np.zeros(num_chunks(chunks, meta.lanes) * meta.lanes, dtype=np.int32)  # (the meta op's chunks)
        # each exponent lane self-checking (docs/protocol.md 3.8): the MAX's winner carries its own tag
        local[:chunks] = pack_exponents(chunk_exponents(x, lanes) if local_exps is None else local_exps)
        n = self.spec.num_workers
        s = self.spec

        def have_exps(meta_op) -> None:
            exps, ok = unpack_exponents(meta_op.result.reshape(-1)[:chunks])
            corrupt = bool(meta_op.saturated_chunks) or not ok.all()
            if corrupt:
                # The exponent agreement came back corrupt (its sum failed its check words on every
                # resend, or a lane's tag does not match: docs/protocol.md 3.8). The GRAD range is
                # reserved on the stream, and a segment never sent would block every later push of
                # this worker (a hang, seen with the bit-flipping proxy): send it as zeros flagged
                # SATURATED, with the same exponents on every worker, so the node's sum of the layer
                # is non-finite and rejected like one -- the step skipped, the version advancing.
                self.stats["corrupt_agreements"] += 1
                handle.saturated = True
                exps = np.zeros(chunks, dtype=np.int32)

            def saturated() -> None:
                handle.saturated = True

            # live: once the push failed its caller may reuse x; a resend after that is zeros flagged
            # SATURATED (and so is every packet of a push whose agreement was corrupt)
            lanes_of = QuantizedLanes(x, exps, lanes, n, saturated, live=lambda: not corrupt and not handle.done())
            seg.ready(aggregation_fill(
                seg_start=seg.start, msg_type=MsgType.GRAD, session=s.session, worker=self.rank,
                pool_base=s.pool_base, pool_size=s.pool_size, lanes=lanes, tensor=tensor, numel=numel,
                dtype=Dtype.FIXED32, lanes_of=lanes_of, exponents=exps, row_lanes=self.row_lanes))

        meta_op = meta.new_op(chunks, Dtype.INT32, True, have_exps)
        meta_op.tagged = (0, chunks)  # a lane whose tag fails is dropped and resent (collective.py `_verified`)
        meta.set_values(meta_op, local)
        self.stats["pushes"] += 1

    def _push16(self, tensor: int, x: np.ndarray, meta: CollectiveSession, handle: Handle,
                local_exps: np.ndarray | None) -> None:
        """`push` in FIXED16: block exponents agreed on the meta session, then 16-bit GRAD packets
        whose exponent lanes tell the node the exponents (docs/protocol.md 5.2)."""
        numel = x.size
        blocks = num_chunks(numel, FIXED16_BLOCK)
        seg = self.grad.reserve(fixed16.packets(numel, self.row_lanes), on_acked=lambda: handle.set_result(None))
        local = block_exponents(x, FIXED16_BLOCK) if local_exps is None else local_exps
        s = self.spec

        def have_exps(agreed: np.ndarray | None, sat: bool) -> None:
            if agreed is None:  # never quantise with exponents that may not be everyone's
                handle.set_error(EngineError(f"the exponent agreement of layer {tensor}'s fixed16 push came back "
                                             "corrupted (a tag or check lane did not match)"))
                agreed = np.full(blocks, 127, dtype=np.int32)  # its packets still go (zeros, SATURATED): see live
            handle.saturated |= sat

            def saturated() -> None:
                handle.saturated = True

            seg.ready(fixed16_fill(
                seg_start=seg.start, msg_type=MsgType.GRAD, session=s.session, worker=self.rank,
                pool_base=s.pool_base, pool_size=s.pool_size, lanes=self.row_lanes, tensor=tensor, x=x,
                exps=agreed, n=s.num_workers, live=lambda: not handle.done(), on_saturated=saturated))

        meta.agree_exponents16(local, have_exps)  # one self-checking lane per block
        self.stats["pushes"] += 1

    def on_node_heartbeat(self, ack: int, credit: int, now: float, gap: bool = False) -> None:
        self.node_heard = now
        moved = self.grad.on_ack(ack, credit, now)
        if gap and not moved and ack == self.grad.ack:
            self.grad.fast_retransmit(now)  # the node has packets past a hole: resend from its ack

    # -- pull ---------------------------------------------------------------------------------
    def pull(self, tensor: int, version: int, handle: Handle, out: np.ndarray | None, now: float) -> None:
        pull_id = self.next_pull
        self.next_pull = (self.next_pull + 1) & 0xFFFFFFFF
        op = PullOp(pull_id, tensor, version, handle, out)
        self.pulls[pull_id] = op
        self.stats["pulls"] += 1
        buf = self.buffers.get(pull_id)
        if buf is not None and buf.got >= buf.numel:
            self._complete(op, buf)
            return
        if buf is not None:
            op.answered = True
        self._to_request.append(op)
        self._pull_stale = True

    def on_params(self, idx: np.ndarray, rows: np.ndarray, lens: np.ndarray, h: np.ndarray, now: float) -> None:
        # the trailer first (docs/protocol.md 3.7): a PARAM that fails is lost, the pull's retry asks again
        ok = trailers_ok(rows, idx, lens[idx])
        if not _ALL(ok):
            self.stats["dropped.bad_trailer"] = self.stats.get("dropped.bad_trailer", 0) + int((~ok).sum())
            idx = idx[ok]
            if not len(idx):
                return
        if len(idx) == len(h) and self._params_in_order(rows, lens, h):
            return
        new = self.param_window.accept(h["seq"][idx])
        dups = int(len(idx) - new.sum())
        if dups:
            self.stats["param_duplicates"] += dups
            self.hb.nudge()
            idx = idx[new]
        pull_ids = h["slot"][idx]
        if len(idx) and _ALL(pull_ids == pull_ids[0]):  # the common batch: one pull's packets, no grouping
            self._place(int(pull_ids[0]), idx, rows, lens, h)
        else:
            for pid in np.unique(pull_ids):
                self._place(int(pid), idx[pull_ids == pid], rows, lens, h)
        self.stats["param_packets"] += len(idx)
        self.param_window.advance()

    def _params_in_order(self, rows: np.ndarray, lens: np.ndarray, h: np.ndarray) -> bool:
        """`on_params` for the common batch, read in Python scalars (a pull's few packets: the
        vectorised code's thirty numpy calls on arrays of five cost more than the packets): every
        packet new, consecutive seqs inside the window, one pull's consecutive chunks, all well
        formed. False, with nothing changed, for anything else (the code below is the reference;
        tests/engine/test_push_pull.py's lossy runs take both)."""
        n = len(h)
        w = self.param_window
        seqs = h["seq"].tolist()
        s0 = seqs[0]
        p0 = s0 & (w.size - 1)
        if ((s0 - w.ack) & 0xFFFFFFFF) + n > w.size or p0 + n > w.size or seqs != list(range(s0, s0 + n)) \
                or _ANY(w.bits[p0:p0 + n]):
            return False
        _vt, _f, _s, _w, _c, _seq, pull_id, tensor, off0, _e, dtype, _r, numel = h[0].item()
        wire = WIRE_DTYPES.get(dtype)
        slots, counts, offsets, lengths = h["slot"].tolist(), h["count"].tolist(), h["offset"].tolist(), lens.tolist()
        if wire is None or slots.count(pull_id) != n:
            return False
        dtype = Dtype(dtype)
        epp = elems_per_param_packet(self.row_lanes, dtype)
        c0, rem = divmod(off0, epp)
        if rem:
            return False
        item = wire.itemsize
        for i in range(n):
            at, count = offsets[i], counts[i]
            if at != off0 + i * epp or at + count > numel or HEADER_LEN + count * item > lengths[i]:
                return False
        w.bits[p0:p0 + n] = True
        w.changed()
        self._store(pull_id, tensor, numel, dtype, wire, epp, None, None, 0, c0, n, sum(counts), rows)
        self.stats["param_packets"] += n
        w.advance()
        return True

    def _place(self, pull_id: int, sel: np.ndarray, rows: np.ndarray, lens: np.ndarray, h: np.ndarray) -> None:
        first = h[sel[0]]
        dtype, numel, tensor = int(first["dtype"]), int(first["numel"]), int(first["tensor"])
        if dtype not in WIRE_DTYPES:
            self.stats["malformed"] = self.stats.get("malformed", 0) + len(sel)
            return
        dtype = Dtype(dtype)
        wire = WIRE_DTYPES[dtype]
        epp = elems_per_param_packet(self.row_lanes, dtype)
        counts = h["count"][sel].astype(np.int64)
        offsets = h["offset"][sel].astype(np.int64)
        ok = (offsets % epp == 0) & (offsets + counts <= numel) & (HEADER_LEN + counts * wire.itemsize <= lens[sel])
        if not _ALL(ok):
            self.stats["malformed"] = self.stats.get("malformed", 0) + int((~ok).sum())
            sel, counts, offsets = sel[ok], counts[ok], offsets[ok]
        chunk = offsets // epp
        n = len(sel)
        s0, c0 = (int(sel[0]), int(chunk[0])) if n else (0, 0)
        run = bool(n) and _ALL(sel == np.arange(s0, s0 + n)) and _ALL(chunk == np.arange(c0, c0 + n))
        self._store(pull_id, tensor, numel, dtype, wire, epp, None if run else sel, None if run else chunk,
                    s0, c0, n, int(counts.sum()), rows)

    def _store(self, pull_id: int, tensor: int, numel: int, dtype: Dtype, wire: np.dtype, epp: int,
               sel: np.ndarray | None, chunk: np.ndarray | None, s0: int, c0: int, n: int, got: int,
               rows: np.ndarray) -> None:
        """Well-formed PARAM packets of pull `pull_id` (`got` elements) into its buffer: rows
        s0..s0+n holding chunks c0..c0+n (sel and chunk None: one run in order), else rows `sel`
        holding chunks `chunk`."""
        buf = self.buffers.get(pull_id)
        op = self.pulls.get(pull_id)
        if buf is None:
            into = _direct_target(op, tensor, numel, dtype)
            if into is not None:  # a posted pull into a buffer that takes these bits: no staging copy
                buf = PullBuffer(tensor, numel, dtype, into, direct=True)
            else:
                chunks = max(1, num_chunks(numel, epp))
                buf = PullBuffer(tensor, numel, dtype, np.empty(chunks * epp, dtype=NATIVE_DTYPES[dtype]))
            self.buffers[pull_id] = buf
            if op is None:
                self.stats["staged"] += 1
        if op is not None and not op.answered:
            op.answered = True
            self._pull_stale = True
        # full-width copies: a short last packet spills garbage only into the padding past numel
        width = HEADER_LEN + epp * wire.itemsize
        if buf.direct:
            if sel is None:
                _decode_run(buf, rows, s0, c0, n, wire, epp)
            else:  # out of order (a resend, a reordered path): packet by packet
                for row, c in zip(sel.tolist(), chunk.tolist()):
                    _decode_run(buf, rows, row, c, 1, wire, epp)
        elif sel is None:
            # the common batch, one run of a pull's packets in order: slices, so the rows are copied
            # once straight into the buffer (a fancy index gathers them into a temporary first)
            buf.data.reshape(-1, epp)[c0:c0 + n] = rows[s0:s0 + n, HEADER_LEN:width].view(wire)
        else:
            buf.data.reshape(-1, epp)[chunk] = rows[sel, HEADER_LEN:width].view(wire)
        buf.got += got
        if buf.got >= buf.numel and op is not None:
            self._complete(op, buf)

    def _complete(self, op: PullOp, buf: PullBuffer) -> None:
        del self.pulls[op.pull_id]
        del self.buffers[op.pull_id]
        if buf.tensor != op.tensor:
            op.handle.set_error(EngineError(
                f"pull {op.pull_id}: the node sent tensor {buf.tensor} but this worker asked for {op.tensor}; "
                "workers must issue the same pulls in the same order"))
            return
        op.handle.info["dtype"] = buf.dtype
        if buf.direct:  # decoded into op.out as the packets came (_direct_target checked it takes them)
            op.handle.set_result(op.out)
            return
        data = buf.data[: buf.numel]
        if op.out is None:
            op.handle.set_result(data)
            return
        if op.out.size != buf.numel:
            op.handle.set_error(EngineError(
                f"pull of tensor {op.tensor}: the node sent {buf.numel} elements, the buffer holds {op.out.size}"))
            return
        if op.out.dtype == data.dtype:
            np.copyto(op.out.reshape(-1), data)
        elif op.out.dtype == np.float32 and buf.dtype == Dtype.BF16 and op.out.flags.c_contiguous:
            widen_staged_bf16(data, op.out.reshape(-1).view(np.uint32))
        elif op.out.dtype == np.float32:
            np.copyto(op.out.reshape(-1), as_float32(data, buf.dtype))
        else:
            op.handle.set_error(EngineError(f"pull of tensor {op.tensor}: cannot write {buf.dtype.name} into {op.out.dtype}"))
            return
        op.handle.set_result(op.out)

    # -- engine loop hooks ----------------------------------------------------------------------
    def pump(self, now: float) -> int:
        sent = self.grad.pump(now)
        if self._to_request and now >= self._pulls_due():  # most loop turns have no pull to (re)send
            sent += self._send_pulls(now)
        self.hb.maybe_send(now)
        return sent

    def _send_pulls(self, now: float) -> int:
        sent = 0
        due = [op for op in self._to_request if not op.answered and now - op.requested_at >= self._retry(op)]
        self._to_request = [op for op in self._to_request if not op.answered and op.pull_id in self.pulls]
        for i in range(0, len(due), 64):
            group = due[i:i + 64]
            self._send_packet(pull_request_bytes(self.id, self.rank, [(op.pull_id, op.tensor, op.version)
                                                                     for op in group]))
            for op in group:
                op.retries += op.requested_at > 0
                op.requested_at = now
            self.stats["pull_requests"] += 1
            sent += 1
        self._pull_stale = True
        return sent

    def _pulls_due(self) -> float:
        """When the first unanswered pull is due to be (re)requested (inf: none)."""
        if self._pull_stale:
            self._to_request = [op for op in self._to_request if not op.answered and op.pull_id in self.pulls]
            at = float("inf")
            for op in self._to_request:
                due = op.requested_at + self._retry(op)
                if due < at:
                    at = due
            self._pull_due, self._pull_stale = at, False
        return self._pull_due

    def _retry(self, op: PullOp) -> float:
        return 0.0 if op.requested_at < 0 else min(self.pull_retry * (2 ** op.retries), 1.0)

    def on_timer(self, now: float) -> None:
        self.grad.check_timeout(now)

    def wake_at(self) -> float:
        """The next retransmission, heartbeat or pull retry: the engine sleeps until then."""
        at = self.grad.deadline()
        hb = self.hb.due_at()
        if hb < at:
            at = hb
        due = self._pulls_due()
        return due if due < at else at

    def busy(self) -> bool:
        return bool(self.pulls) or not self.grad.idle()

    def hello(self, now: float) -> None:
        self.hb.send(now)


def _direct_target(op: PullOp | None, tensor: int, numel: int, dtype: Dtype) -> np.ndarray | None:
    """The pull's `out`, flat, when PARAM packets can be decoded straight into it: the layer and
    size it asked for, C-contiguous and writable, and the wire's own dtype or bf16 into float32
    (a float32's top half). Else None: the packets are staged and `_complete` converts or refuses."""
    out = op.out if op is not None else None
    if out is None or op.tensor != tensor or out.size != numel or not out.flags.c_contiguous \
            or not out.flags.writeable:
        return None
    if out.dtype == NATIVE_DTYPES[dtype] or (out.dtype == np.float32 and dtype == Dtype.BF16):
        return out.reshape(-1)
    return None


def _decode_run(buf: PullBuffer, rows: np.ndarray, s0: int, c0: int, n: int, wire: np.dtype, epp: int) -> None:
    """Packets rows[s0:s0 + n] (chunks c0..c0 + n) into the caller's buffer `buf.data`: a copy of
    the big-endian values (or bf16 -> float32: the 16 bits widened, then shifted to the top half),
    whole chunks in one slice, the short last chunk by itself (the buffer ends at numel)."""
    widen = buf.data.dtype == np.float32 and buf.dtype == Dtype.BF16
    dst = buf.data.view(np.uint32) if widen else buf.data
    if widen and rows.flags.c_contiguous and rows.dtype == np.uint8 and rows.shape[1] % 2 == 0 and use_numba():
        # one compiled pass (kernels/fixed_point.py; this numpy code is the reference: tests/engine/test_kernels.py)
        fixed_point_kernels().widen_bf16_rows(rows.view(np.uint16), s0, n, HEADER_LEN // 2, epp, dst,
                                              c0 * epp, buf.numel)
        return
    whole = max(0, min(n, buf.numel // epp - c0))
    if whole:
        d = dst[c0 * epp:(c0 + whole) * epp].reshape(whole, epp)
        d[...] = rows[s0:s0 + whole, HEADER_LEN:HEADER_LEN + epp * wire.itemsize].view(wire)
        if widen:
            np.left_shift(d, 16, out=d)
    if whole < n:  # the last chunk, short of epp elements
        c = c0 + whole
        count = buf.numel - c * epp
        d = dst[c * epp:buf.numel]
        d[...] = rows[s0 + whole, HEADER_LEN:HEADER_LEN + count * wire.itemsize].view(wire)
        if widen:
            np.left_shift(d, 16, out=d)


def widen_staged_bf16(data: np.ndarray, bits: np.ndarray, compiled: bool | None = None) -> None:
    """A staged pull's bf16 values (native uint16) into `bits` (its float32 output as uint32):
    bf16 is a float32's top half, widened in place in the output with no temporaries; one
    compiled pass (kernels/fixed_point.py `widen_bf16`), else this numpy code, the reference.
    `compiled` None: as `use_numba()` says (tests/engine/test_kernels.py compares the two)."""
    if use_numba() if compiled is None else compiled:
        fixed_point_kernels().widen_bf16(data, bits)
        return
    np.copyto(bits, data)
    np.left_shift(bits, 16, out=bits)


def wire_dtype(dtype: Dtype) -> np.dtype:
    return WIRE_DTYPES[dtype]


def elems_per_param_packet(lanes: int, dtype: Dtype) -> int:
    """Values per PARAM packet: as many as fit in an aggregation packet's payload with the
    trailer (docs/protocol.md 3.7)."""
    return (4 * lanes - TRAILER_LEN) // DTYPE_ITEMSIZE[dtype]


def as_float32(data: np.ndarray, dtype: Dtype) -> np.ndarray:
    if dtype == Dtype.BF16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)
