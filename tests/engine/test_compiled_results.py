"""The compiled RESULT pass (dataplane/kernels/fixed_point.py `absorb_fixed_results`, run by
dataplane/engine/collective.py `_compiled_results`) against the numpy code it shortcuts.

Two real float-sum allreduces (`AllreduceOp` on a meta and a data `CollectiveSession` on loopback
UDP sockets) get the same RESULT batches, one with `LUWU_KERNELS=reference`, one compiled: after
every batch the window (bits, ack), the send stream's delivery state, the session's and op's
counts and the output bits must be identical, with some rows of the send ring marked resent. Batches hold duplicates, gaps, rows past the
window, descending runs, stale ops' rows, SATURATED rows and the short last chunk, and the
sequence numbers wrap across 2^32.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.dataplane.engine.collective import CollectiveSession
from luwu.dataplane.engine.handles import Handle
from luwu.dataplane.engine.reductions import AllreduceOp
from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy
from luwu.dataplane.integrity import check_words_rows, pack_exponents
from luwu.dataplane.kernels import ENV, numba_available
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.protocol import HEADER_LEN, Flag, MsgType, header_view, ver_type
from luwu.dataplane.session import SessionSpec

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed: no compiled pass to compare")

LANES, WINDOW, N = 4, 16, 3
ROW = LANES + 2  # a packet's lanes: LANES of data, then 2 check words (docs/protocol.md 3.6)


@contextmanager
def _kernels(mode: str):
    old = os.environ.get(ENV)
    os.environ[ENV] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = old


def _rows(seqs, tensors, offsets, flags, payload: np.ndarray, numel: int = 0) -> np.ndarray:
    """RESULT packets as the engine's receive rows: header (numel: the op's, which the engine
    checks) then big-endian lanes, then the check words of a sum of N contributions."""
    k = len(seqs)
    rows = np.zeros((k, HEADER_LEN + 4 * ROW), dtype=np.uint8)
    h = header_view(rows)
    h["ver_type"] = ver_type(MsgType.RESULT)
    h["seq"], h["tensor"], h["offset"], h["flags"], h["numel"] = seqs, tensors, offsets, flags, numel
    lanes = rows[:, HEADER_LEN:].view(">i4")
    lanes[:, :LANES] = payload.reshape(k, LANES)
    lanes[:, LANES:] = check_words_rows(lanes[:, :LANES], h, 0, N).astype(np.uint32).view(np.int32)
    return rows


def _feed(s: CollectiveSession, rows: np.ndarray, now: float) -> None:
    hb = np.ascontiguousarray(rows[:, :HEADER_LEN])  # as the engine's _dispatch gathers them
    s.on_results(np.arange(len(rows)), rows, header_view(hb), now)


class _Side:
    """One worker's float sum on its own meta and data sessions, its sequence numbers from `start`."""

    def __init__(self, mode: str, start: int, x: np.ndarray, exps: np.ndarray, resent: np.ndarray | None = None):
        self.mode = mode
        self.socks = [BatchSocket(udp_socket(), batch=8, max_len=HEADER_LEN + 4 * ROW, peers=1) for _ in range(2)]
        rto = RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01, maximum=1.0))
        self.meta, self.data = (CollectiveSession(SessionSpec(sid, "collective", 1, 0, WINDOW, N, ROW, purpose=p),
                                                  0, sock, rto, 0.0)
                                for sid, p, sock in ((1, "meta", self.socks[0]), (2, "data", self.socks[1])))
        for s in (self.meta, self.data):  # as if this stream had run for a while: near 2^32
            s.window.ack = start
            st_ = s.send
            st_.ack = st_.next_seq = st_.send_next = st_.sack_high = st_.burst_end = start
        self.handle = Handle()
        self.op = AllreduceOp(x, "sum", N, self.handle, exps=AllreduceOp.local_exponents(x, "sum", LANES),
                              out=np.zeros_like(x))
        with _kernels(mode):
            self.op.start(self.meta, self.data)
            if self.op.tail is not None:
                self.op.tail[...] = 0  # scratch for the short last chunk: compared before it is written
            chunks = len(exps)
            meta_chunks = -(-chunks // LANES)
            payload = np.zeros(meta_chunks * LANES, np.int32)
            payload[:chunks] = pack_exponents(exps)  # the agreement's self-checking lanes (protocol.md 3.8)
            seqs = (start + np.arange(meta_chunks)) & 0xFFFFFFFF
            _feed(self.meta, _rows(seqs, [0] * meta_chunks, np.arange(meta_chunks) * LANES, [0] * meta_chunks,
                                   payload, chunks), 0.0)
        assert self.op.scale is not None, "the exponents' RESULTs completed the meta op"
        snd = self.data.send
        snd.high = snd.next_seq  # as if every chunk had been sent: some of them resent, in this order
        if resent is not None:
            snd.retx[:] = resent
            snd.xmit_no[:] = np.arange(len(resent))[::-1]

    def feed(self, rows: np.ndarray, now: float) -> None:
        with _kernels(self.mode):
            _feed(self.data, rows, now)

    def state(self):
        s, w, snd = self.data, self.data.window, self.data.send
        ops = {i: (o.got, o.saturated, [c.tolist() for c in o.saturated_chunks]) for i, o in s.ops.items()}
        out = self.op.dest.view(np.uint32).tolist()
        tail = None if self.op.tail is None else self.op.tail.view(np.uint32).tolist()
        done = self.handle.done()
        return (w.bits.tolist(), w.ack, w.duplicates, dict(s.stats), ops, out, tail, done,
                self.handle.saturated if done else None, snd.ack, snd.sack_high, snd.rack_xmit, snd.lost.tolist(),
                dict(snd.stats), snd.rto.srtt)

    def close(self):
        for sock in self.socks:
            sock.close()


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 30 * LANES), st.sampled_from([0, 5, 2**32 - 7, 2**32 - 40]))
def test_compiled_pass_matches_the_reference_state_for_state(data, numel, start):
    rng = np.random.default_rng(numel + start)
    x = rng.standard_normal(numel).astype(np.float32)
    chunks = -(-numel // LANES)
    exps = np.array(data.draw(st.lists(st.sampled_from([-128, -126, -60, -3, 0, 2, 40, 100, 127]),
                                       min_size=chunks, max_size=chunks)), dtype=np.int32)
    resent = np.array(data.draw(st.lists(st.integers(0, 9), min_size=WINDOW, max_size=WINDOW))) == 0
    sides = [_Side(m, start, x, exps, resent) for m in ("reference", "numba")]
    try:
        assert sides[0].state() == sides[1].state()
        now, stale = 0.0, False
        for _ in range(data.draw(st.integers(1, 12))):
            offs = data.draw(st.lists(st.integers(0, chunks - 1), min_size=1, max_size=12))
            if data.draw(st.booleans()):
                offs = sorted(set(offs))  # the common batch: ascending, no repeats
            k = len(offs)
            tensors = [0 if data.draw(st.integers(0, 15)) else 7 for _ in offs]  # 7: an op that is gone
            stale |= 7 in tensors
            flags = [int(Flag.SATURATED) if data.draw(st.integers(0, 20)) == 0 else 0 for _ in offs]
            payload = rng.integers(-2**31, 2**31, size=k * LANES, dtype=np.int64).astype(np.int32)
            rows = _rows((start + np.array(offs, dtype=np.int64)) & 0xFFFFFFFF, tensors,
                         np.array(offs) * LANES, flags, payload, numel)
            now += 0.001
            for side in sides:
                side.feed(rows.copy(), now)
            assert sides[0].state() == sides[1].state()
        # then everything in order, as a lossless path delivers it: the op completes on both
        for first in range(0, chunks, WINDOW // 2):
            offs = list(range(first, min(chunks, first + WINDOW // 2)))
            payload = rng.integers(-2**31, 2**31, size=len(offs) * LANES, dtype=np.int64).astype(np.int32)
            rows = _rows((start + np.array(offs, dtype=np.int64)) & 0xFFFFFFFF, [0] * len(offs),
                         np.array(offs) * LANES, [0] * len(offs), payload, numel)
            now += 0.001
            for side in sides:
                side.feed(rows.copy(), now)
            assert sides[0].state() == sides[1].state()
        if not stale:  # a stale op's row takes its seq: that chunk's own RESULT is then a duplicate
            assert all(side.handle.done() for side in sides)
    finally:
        for side in sides:
            side.close()


def test_the_common_batch_takes_the_compiled_pass():
    """The in-order, one-op batch of a float sum does run compiled (else the test above compares
    the reference with itself)."""
    x = np.arange(10 * LANES, dtype=np.float32)
    side = _Side("numba", 0, x, np.full(10, 6, np.int32))
    try:
        rows = _rows(np.arange(4), [0] * 4, np.arange(4) * LANES, [0] * 4, np.arange(4 * LANES, dtype=np.int32))
        hb = np.ascontiguousarray(rows[:, :HEADER_LEN])
        with _kernels("numba"):
            assert side.data._compiled_results(rows, header_view(hb), 0.001)
        assert side.data.window.ack == 4 and side.data.ops[0].got == 4
        # the next four in order, one of them SATURATED: the reference's, and nothing changed first
        rows = _rows(np.arange(4, 8), [0] * 4, np.arange(4, 8) * LANES, [0, 0, int(Flag.SATURATED), 0],
                     np.zeros(4 * LANES, dtype=np.int32))
        hb = np.ascontiguousarray(rows[:, :HEADER_LEN])
        with _kernels("numba"):
            assert not side.data._compiled_results(rows, header_view(hb), 0.002)
        assert side.data.window.ack == 4 and side.data.ops[0].got == 4
    finally:
        side.close()
