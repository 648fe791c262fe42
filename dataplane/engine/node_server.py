"""The optimizer node's side of a `node` session: summed gradients in (AGG, or GRAD marked
FALLBACK to aggregate in software), parameters out (PARAM, answering PULLs).

The node acknowledges the gradient stream with heartbeats that the switch multicasts to the
workers, and paces its parameter stream by the workers' heartbeats, which the switch
min-aggregates into one (docs/protocol.md 6.4, 7).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

import numpy as np

from .. import fixed16
from ..integrity import TRAILER_LEN, fixed16_blocks, trailers_ok
from ..protocol import HEADER_LEN, NODE, PULL_REQUEST, Dtype, Flag, MsgType, header_view, ver_type
from ..quantize import dequantize_rows_into, fixed16_bits, num_chunks, sum_shift
from ..session import SessionSpec
from .collective import CHECK, CORRUPT_TRIES, FailedChecks
from .heartbeats import HeartbeatPolicy, HeartbeatSender
from .node_worker import WIRE_DTYPES, elems_per_param_packet
from .packets import check_words_of, in_bounds, param_fill, payload_int32
from .send_stream import RtoEstimator, SendStream, sdiff
from .window import RecvWindow

_ALL, _ANY = np.logical_and.reduce, np.logical_or.reduce  # without the ndarray methods' wrappers (per batch)


class ParamProvider(Protocol):
    """What the node serves. `lookup` returns (flat array, wire dtype) once `tensor` has had
    `version` optimizer steps, None while it has not; KeyError for a tensor it does not hold."""

    def lookup(self, tensor: int, version: int) -> tuple[np.ndarray, Dtype] | None: ...


GradientSink = Callable[[int, np.ndarray, bool], None]  # (tensor, summed float32 gradient, saturated)


class GradAssembly:
    def __init__(self, numel: int, lanes: int, n: int):
        self.numel = numel
        self.chunks = num_chunks(numel, lanes)
        self.buf = np.empty((self.chunks, lanes), dtype=np.float32)
        self.got = 0
        self.n = n
        self.saturated = False

    def absorb(self, chunk: np.ndarray, rows: np.ndarray, sel: np.ndarray, exps: np.ndarray, flags: np.ndarray) -> bool:
        shift = sum_shift(exps, self.n)
        # past 2^128 the sum is inf, as IEEE rounds it
        dequantize_rows_into(rows, sel, HEADER_LEN, self.buf.shape[1], shift, chunk, self.buf)
        self.got += len(chunk)
        sat = (flags & int(Flag.SATURATED)) != 0
        any_sat = bool(_ANY(sat))
        if any_sat:
            # a contributor clipped (inf/NaN, or |x| >= 2^127): the fixed-point sum of the chunk is not
            # the sum, so it reaches the node as NaN, never as a plausible number (docs/protocol.md 5.1)
            self.buf[chunk[sat]] = np.float32(np.nan)
        # |sum| < 2^(e + c): finite in float32 unless that passes 2^128. Anything else that could
        # be non-finite was clipped by a quantiser, which set SATURATED; so an unsaturated sum is
        # finite by construction and the node can skip its NaN/Inf pass.
        self.saturated |= any_sat or bool(_ANY(shift + 31 > 128))
        return self.got >= self.chunks


class GradAssembly16:
    """A layer's FIXED16 gradient as its AGGs arrive: each verified (check words, exponent lanes /
    n) and decoded into the flat float32 `buf` (dataplane/fixed16.py). A saturated packet, or one
    whose check fails, makes its elements NaN: the node's finiteness check then rejects the
    gradient, never a step from a clipped or corrupted sum (docs/protocol.md 5.1, 5.2)."""

    def __init__(self, numel: int, lanes: int, n: int):
        self.numel = numel
        self.lanes = lanes
        self.per = fixed16.layout(lanes)[1]
        self.chunks = num_chunks(numel, self.per)
        self.buf = np.empty(numel, dtype=np.float32)
        self.got = 0
        self.n = n
        self.saturated = False
        self.corrupt = 0  # packets whose check words failed

    def absorb(self, chunk: np.ndarray, rows: np.ndarray, sel: np.ndarray, _exps: np.ndarray,
               flags: np.ndarray) -> bool:
        ok = fixed16.decode_rows(rows, sel, self.lanes, self.n, self.buf)
        self.got += len(chunk)
        bad = ((flags & int(Flag.SATURATED)) != 0) | ~ok
        self.corrupt += int((~ok).sum())
        for c in chunk[bad].tolist():
            self.buf[c * self.per:(c + 1) * self.per] = np.float32(np.nan)
        # a sum past 2^128 decodes to inf: flagged for the node's finiteness check, as FIXED32 does
        nb = fixed16.layout(self.lanes)[0]
        e = fixed16.unpack_slots(rows[sel[ok], HEADER_LEN:HEADER_LEN + 4 * -(-nb // 2)].view(">i4"))[:, :nb] // self.n
        self.saturated |= bool(bad.any()) or bool(e.size and int(e.max()) + fixed16_bits(self.n) > 128)
        return self.got >= self.chunks


class ServedPulls:
    """Pull ids seen so far (they are issued densely from 0): a low-water mark plus a set."""

    def __init__(self):
        self.low = 0
        self.above: set[int] = set()

    def __contains__(self, pull_id: int) -> bool:
        return sdiff(pull_id, self.low) < 0 or pull_id in self.above

    def add(self, pull_id: int) -> None:
        self.above.add(pull_id)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low = (self.low + 1) & 0xFFFFFFFF


class FallbackAggregator:
    """Software aggregation of GRAD packets the switch could not aggregate (ATP-style)."""

    def __init__(self, n: int, lanes: int):
        self.n = n
        self.lanes = lanes
        self.pending: dict[int, list] = {}  # seq -> [bitmap, int32 sum, exponent, flags, header row]
        self.rejected = 0  # packets claiming a rank outside 0..n-1

    def absorb(self, rows: np.ndarray, h: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
        done = []
        for i in idx:
            seq, worker = int(h["seq"][i]), int(h["worker"][i])
            if worker >= self.n:  # no rank of this job: a switch passes FALLBACK GRADs of ranks it does not
                self.rejected += 1  # know (protocol.md 6.8), so only this check keeps forged ones out of the sum
                continue
            lanes = payload_int32(rows[i:i + 1], self.lanes)[0].astype(np.int32)  # (FIXED16 too: packed int16 pairs)
            entry = self.pending.get(seq)
            if entry is None:
                self.pending[seq] = [1 << worker, lanes, int(h["exponent"][i]), int(h["flags"][i]),
                                     rows[i, :HEADER_LEN].copy()]
                entry = self.pending[seq]
            elif entry[0] & (1 << worker):
                continue
            else:
                entry[0] |= 1 << worker
                entry[1] = np.maximum(entry[1], lanes) if int(h["flags"][i]) & Flag.MAX else entry[1] + lanes
                entry[2] = max(entry[2], int(h["exponent"][i]))
                entry[3] |= int(h["flags"][i]) & Flag.SATURATED
            if bin(entry[0]).count("1") >= self.n:
                del self.pending[seq]
                row = np.zeros(HEADER_LEN + 4 * self.lanes, dtype=np.uint8)
                row[:HEADER_LEN] = entry[4]
                hv = header_view(row[None])
                hv["ver_type"] = ver_type(MsgType.AGG)
                hv["worker"] = NODE
                hv["exponent"] = entry[2]
                hv["flags"] = entry[3] & ~int(Flag.FALLBACK) & 0xFF
                row[HEADER_LEN:].view(">i4")[:] = entry[1]
                done.append(row)
        return done


class NodeServerSession:
    def __init__(self, spec: SessionSpec, sock, rto: RtoEstimator, hb: HeartbeatPolicy, now: float,
                 provider: ParamProvider | None = None, on_gradient: GradientSink | None = None):
        self.spec = spec
        self.id = spec.session
        self.sock = sock
        # an AGG's last CHECK lanes are its check words (docs/protocol.md 3.6): `lanes` gradient
        # elements per packet; PARAM packets fill all `row_lanes` * 4 bytes
        self.row_lanes = spec.lanes
        self.lanes = spec.lanes - CHECK
        self._failures = FailedChecks()  # AGGs that failed their check words, per seq
        self.grad_window = RecvWindow(spec.pool_size)
        self.hb = HeartbeatSender(sock, spec.session, NODE, self.grad_window, hb)
        # refill: a pull's fill reads a served copy that is never written again while the fill holds
        # it (served.py), so a resend may fill again; on a shm port the PARAM rows are then written
        # straight into the up ring (no copy in the stream's own ring first: two 64 KiB copies per row)
        self.params = SendStream(sock, spec.param_window, rto, HEADER_LEN + 4 * spec.lanes, now, refill=True)
        self.provider = provider
        self.on_gradient = on_gradient
        self.assemblies: dict[int, GradAssembly | GradAssembly16] = {}
        self.fallback = FallbackAggregator(spec.num_workers, spec.lanes)  # (every lane, check words too)
        self.served = ServedPulls()
        self.waiting: dict[int, tuple[int, int]] = {}  # pull id -> (tensor, version) not ready yet
        self.stats = {"agg_packets": 0, "agg_duplicates": 0, "fallback_packets": 0, "gradients": 0,
                      "pulls_served": 0, "pull_requests": 0, "bad_pulls": 0, "bad_packets": 0, "unbound": 0,
                      "dropped.bad_check": 0, "rejected.corrupt": 0}

    def bind(self, provider: ParamProvider, on_gradient: GradientSink) -> None:
        """Attach the job this session serves; until then its traffic is counted and dropped
        (senders retransmit, so nothing is lost)."""
        self.provider = provider
        self.on_gradient = on_gradient

    @property
    def bound(self) -> bool:
        return self.provider is not None and self.on_gradient is not None

    # -- gradients ------------------------------------------------------------------------------
    def on_agg(self, idx: np.ndarray, rows: np.ndarray, h: np.ndarray, now: float) -> None:
        if not self.bound:
            self.stats["unbound"] += len(idx)
            return
        idx = self._verified(idx, rows, h, self.spec.num_workers)
        if len(idx):
            idx = in_bounds(idx, h, self.stats, self._chunk_of)
        new = self.grad_window.accept(h["seq"][idx])
        dups = int(len(idx) - new.sum())
        if dups:
            self.stats["agg_duplicates"] += dups
            self.hb.nudge()
            idx = idx[new]
        ok = h["dtype"][idx] == int(Dtype.FIXED32)
        if not _ALL(ok):
            ok |= h["dtype"][idx] == int(Dtype.FIXED16)
        if not _ALL(ok):
            self.stats["bad_packets"] += int((~ok).sum())
            idx = idx[ok]
        self.stats["agg_packets"] += len(idx)
        tensors = h["tensor"][idx]
        # the common batch is one layer's packets: no grouping (np.unique sorts, a dozen calls)
        groups = [tensors[0]] if len(idx) and _ALL(tensors == tensors[0]) else np.unique(tensors)
        completed = False
        for t in groups:
            sel = idx if len(groups) == 1 else idx[tensors == t]
            t = int(t)
            numel = int(h["numel"][sel[0]])
            asm = self.assemblies.get(t)
            kind = GradAssembly16 if h["dtype"][sel[0]] == int(Dtype.FIXED16) else GradAssembly
            if asm is None or asm.numel != numel or not isinstance(asm, kind):
                asm = self.assemblies[t] = kind(numel, self.row_lanes if kind is GradAssembly16 else self.lanes,
                                                self.spec.num_workers)
            per = asm.per if isinstance(asm, GradAssembly16) else self.lanes
            chunk = (h["offset"][sel] // per).astype(np.int64)
            if asm.absorb(chunk, rows, sel, h["exponent"][sel], h["flags"][sel]):
                del self.assemblies[t]
                self.stats["gradients"] += 1
                if isinstance(asm, GradAssembly16) and asm.corrupt:
                    self.stats["bad_check"] = self.stats.get("bad_check", 0) + asm.corrupt
                self.on_gradient(t, asm.buf.reshape(-1)[:numel], asm.saturated)
                completed = True
        self.grad_window.advance()
        if completed:
            # a worker's push completes on this acknowledgement and its step() waits for the last one:
            # tell the workers now (after min_gap), not at the next interval, which a gradient shorter
            # than a quarter window otherwise waited for (`luwu demo`'s critical path: 2-5 ms "push
            # wait" per step with a 2 ms interval, 25 ms with a 12 ms one)
            self.hb.nudge()

    def _chunk_of(self, t: int, hs: np.ndarray, mine: np.ndarray) -> tuple[int, int, bool]:
        """What an AGG of layer `t` must name (packets.in_bounds): a chunk of its assembly, in its
        numel and format (or, for a new one, those of the batch's first packet of the layer), a
        packet's elements per chunk. A layer's size and format never change in a job."""
        asm = self.assemblies.get(t)
        if asm is not None:
            want, want16 = asm.numel, isinstance(asm, GradAssembly16)
        else:
            first = int(np.flatnonzero(mine)[0])
            want, want16 = int(hs["numel"][first]), int(hs["dtype"][first]) == int(Dtype.FIXED16)
        if want16 and fixed16_blocks(self.row_lanes) < 1:
            # a switch too narrow for FIXED16 has no FIXED16 layer: every such packet is out of bounds
            return self.lanes, want, False
        return (fixed16.layout(self.row_lanes)[1] if want16 else self.lanes), want, want16

    def on_fallback(self, idx: np.ndarray, rows: np.ndarray, h: np.ndarray, now: float) -> None:
        if not self.bound:
            self.stats["unbound"] += len(idx)
            return
        self.stats["fallback_packets"] += len(idx)
        idx = self._verified(idx, rows, h, 1, reject=False)  # one contribution each, not summed yet
        fresh = np.array([not self.grad_window.received(int(s)) for s in h["seq"][idx]], dtype=bool)
        if not fresh.all():
            self.hb.nudge()
        done = self.fallback.absorb(rows, h, idx[fresh])
        if done:
            out = np.stack(done)
            self.on_agg(np.arange(len(out)), out, header_view(out), now)

    def _verified(self, idx: np.ndarray, rows: np.ndarray, h: np.ndarray, n: int, reject: bool = True) -> np.ndarray:
        """The packets among `idx` whose check words hold for a sum of `n` (docs/protocol.md 3.6).
        A failed one is dropped and counted, as if lost (the workers' resends get the switch's
        stored copy). With `reject`, a chunk that fails CORRUPT_TRIES times in a row has a wrong
        stored sum: it is let through flagged SATURATED, so its layer's gradient reaches the node
        as non-finite and is rejected like one (counted `rejected.corrupt`), never stepped on."""
        if not len(idx):
            return idx
        hs = h[idx]
        at = HEADER_LEN + 4 * self.lanes
        got = rows[idx, at:at + 4 * CHECK].view(">u4").astype(np.uint64)
        ok = (got == check_words_of(rows, idx, self.lanes, hs, int(Dtype.FIXED32), n)).all(axis=1)
        f16 = hs["dtype"] == int(Dtype.FIXED16)
        if f16.any():  # packed int16 slots, 4 16-bit check words: dataplane/fixed16.py
            ok[f16] = fixed16.verify_rows(rows, idx[f16], self.row_lanes, n)
        ok |= (hs["dtype"] != int(Dtype.FIXED32)) & ~f16  # (anything else is counted bad_packets by on_agg)
        if _ALL(ok):
            if reject and self._failures:
                self._failures.passed(hs["seq"].tolist())
            return idx
        keep = ok.copy()
        for j in np.flatnonzero(~ok).tolist():
            if not reject or not self._failures.failed(int(hs["seq"][j])):
                self.stats["dropped.bad_check"] += 1
                continue
            self.stats["rejected.corrupt"] += 1
            i = int(idx[j])
            rows[i, 1] |= np.uint8(Flag.SATURATED)
            h["flags"][i] |= np.uint8(Flag.SATURATED)
            print(f"luwu node: session {self.id} layer {int(hs['tensor'][j])}: the sum of chunk at offset "
                  f"{int(hs['offset'][j])} failed its check words {CORRUPT_TRIES} times (a corrupted "
                  "contribution): the layer's gradient is rejected", file=sys.stderr)
            keep[j] = True
        if reject:
            self._failures.passed(hs["seq"][ok].tolist())
        return idx[keep]

    # -- parameters ------------------------------------------------------------------------------
    def on_workers_heartbeat(self, ack: int, credit: int, now: float) -> None:
        self.params.on_ack(ack, credit, now)

    def on_pull(self, idx: np.ndarray, rows: np.ndarray, lens: np.ndarray, h: np.ndarray, now: float) -> None:
        if not self.bound:
            self.stats["unbound"] += len(idx)
            return
        # the batch's counts and lengths as Python ints at once: a field view and an element read
        # per packet cost more than the usual PULL's one request
        ok = trailers_ok(rows, idx, lens[idx])  # the trailer (docs/protocol.md 3.7): a failed PULL is lost, retried
        for i, count, n, good in zip(idx.tolist(), h["count"][idx].tolist(), lens[idx].tolist(), ok.tolist()):
            if not good:
                self.stats["dropped.bad_trailer"] = self.stats.get("dropped.bad_trailer", 0) + 1
                continue
            if HEADER_LEN + count * PULL_REQUEST.itemsize + TRAILER_LEN > n:
                self.stats["bad_pulls"] += 1
                continue
            self.stats["pull_requests"] += 1
            reqs = rows[i, HEADER_LEN:HEADER_LEN + count * PULL_REQUEST.itemsize].view(PULL_REQUEST)
            for pull_id, tensor, version in reqs.tolist():
                if pull_id in self.served or pull_id in self.waiting:
                    continue
                self.waiting[pull_id] = (tensor, version)
        self.retry_waiting()

    def retry_waiting(self) -> None:
        if not self.bound:
            return
        waiting = self.waiting
        if not waiting:
            return
        # in pull-id order (a lone waiting pull, the usual case, needs no sort)
        for pull_id, (tensor, version) in (sorted(waiting.items()) if len(waiting) > 1 else list(waiting.items())):
            try:
                found = self.provider.lookup(tensor, version)
            except KeyError:
                self.stats["bad_pulls"] += 1
                del self.waiting[pull_id]
                self.served.add(pull_id)
                continue
            if found is None:
                continue
            del self.waiting[pull_id]
            self.served.add(pull_id)
            self._serve(pull_id, tensor, *found)

    def _serve(self, pull_id: int, tensor: int, data: np.ndarray, dtype: Dtype) -> None:
        epp = elems_per_param_packet(self.row_lanes, dtype)
        data = np.ascontiguousarray(data).reshape(-1)
        if data.dtype.itemsize != WIRE_DTYPES[dtype].itemsize:
            raise TypeError(f"tensor {tensor}: {data.dtype} does not match wire dtype {dtype.name}")
        chunks = max(1, num_chunks(data.size, epp))
        # the fill (and with it the served copy) is let go once the workers acknowledge the pull: the
        # stream keeps acknowledged segments for a while, and a copy referenced there cannot be recycled
        # by the node (served.py), which then faulted in a fresh buffer for the layer's next version
        box = []
        seg = self.params.reserve(chunks, on_acked=box.clear)
        box.append(param_fill(seg_start=seg.start, session=self.id, pull_id=pull_id, tensor=tensor, data=data,
                              dtype=dtype, elems_per_packet=epp))
        seg.ready(lambda i0, i1, rows, lens: box[0](i0, i1, rows, lens))
        self.stats["pulls_served"] += 1

    # -- engine loop hooks ----------------------------------------------------------------------
    def pump(self, now: float) -> int:
        sent = self.params.pump(now)
        self.hb.maybe_send(now)
        return sent

    def on_timer(self, now: float) -> None:
        self.params.check_timeout(now)

    def wake_at(self) -> float:
        """The next retransmission or heartbeat: the engine sleeps until then."""
        return min(self.params.deadline(), self.hb.due_at())

    def busy(self) -> bool:
        return bool(self.waiting) or not self.params.idle() or bool(self.assemblies)

    def hello(self, now: float) -> None:
        self.hb.send(now)
