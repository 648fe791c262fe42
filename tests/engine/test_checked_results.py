"""The whole-batch RESULT pass (dataplane/kernels/fixed_point.py `absorb_checked_results`, run by
dataplane/engine/collective.py `on_result_batch` from dispatch.py `_dispatch`) against the numpy
code it shortcuts: `_dispatch`'s header checks and grouping, `_handle`'s length check and
short-packet widening, then `on_results` (`_verified`'s check words, `in_bounds`, the window, the
op's decode).

Two real float-sum allreduces (`AllreduceOp` on a meta and a data `CollectiveSession` on loopback
UDP sockets, FIXED32 RESULTs with their header-weighted check words) get the same received
batches through `_dispatch`, one with `LUWU_KERNELS=reference`, one compiled: after every batch
the window, the send stream's delivery state, every count (dropped.bad_header, rx_bad,
rx_unexpected, dropped.bad_check, dropped.out_of_bounds, duplicates, stale), the failed-check runs
and the output bits must be identical. The switch has more lanes than LANE_CHUNK, so the last
chunk travels short (its check lanes moved up, the rest of its ring row garbage), and batches
hold corrupted headers, lanes and check words, wrong lengths, foreign sessions and types, stale
ops, bad offsets, counts and numels, SATURATED rows, duplicates, gaps and rows past the window,
with sequence numbers wrapping across 2^32.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.dataplane.engine.collective import CollectiveSession
from luwu.dataplane.engine.dispatch import DispatchMixin
from luwu.dataplane.engine.handles import Handle
from luwu.dataplane.engine.packets import shorten_rows
from luwu.dataplane.engine.reductions import AllreduceOp
from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy
from luwu.dataplane.integrity import check_words_rows, pack_exponents, seal_headers
from luwu.dataplane.kernels import ENV, numba_available
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.protocol import HEADER_LEN, LANE_CHUNK, Dtype, Flag, MsgType, header_view, ver_type
from luwu.dataplane.session import SessionSpec

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed: no compiled pass to compare")

ROW = 2 * LANE_CHUNK + 2  # the switch's lanes: a short last chunk travels in 64 or 128 of them
LANES = ROW - 2  # data lanes per packet; the last 2 are check words (docs/protocol.md 3.6)
WINDOW, N = 16, 3
WIDTH = HEADER_LEN + 4 * ROW + 8  # a receive ring's row: wider than the packet


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


def _rows(seqs, tensors, offsets, counts, flags, payload: np.ndarray, numel: int, dtype: int,
          rng: np.random.Generator, session: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """RESULT packets of session `session` as a switch sends them (lanes past `count` zero, then the check words of a
    sum of N, shortened to their wire length) in receive rows whose bytes past each packet are
    garbage; returns (rows, lengths)."""
    k = len(seqs)
    rows = np.zeros((k, WIDTH), dtype=np.uint8)
    h = header_view(rows)
    h["ver_type"] = ver_type(MsgType.RESULT)
    h["seq"], h["tensor"], h["offset"], h["flags"], h["numel"] = seqs, tensors, offsets, flags, numel
    h["count"], h["dtype"], h["session"] = counts, dtype, session
    lanes = rows[:, HEADER_LEN:HEADER_LEN + 4 * ROW].view(">i4")
    data = payload.reshape(k, LANES).copy()
    data[np.arange(LANES)[None, :] >= np.asarray(counts)[:, None]] = 0
    lanes[:, :LANES] = data
    lanes[:, LANES:] = check_words_rows(lanes[:, :LANES], h, dtype, N).astype(np.uint32).view(np.int32)
    lens = np.full(k, HEADER_LEN + 4 * ROW, dtype=np.int64)
    shorten_rows(rows, lens, h["count"], dtype, h["flags"], ROW)
    for i, n in enumerate(lens.tolist()):
        rows[i, n:] = rng.integers(0, 256, WIDTH - n, dtype=np.uint8)
    seal_headers(rows)  # the header check (docs/protocol.md 3.5), over the final headers
    return rows, lens


class _Engine(DispatchMixin):
    """The engine's receive dispatch (dispatch.py) over a batch handed to it as a transport's."""

    def __init__(self):
        self.stats = {"rx_bad": 0, "rx_unexpected": 0, "dropped.bad_header": 0}
        self.sessions = {}
        self.sock = SimpleNamespace(rx=None, rx_len=None)


def _feed(engine: _Engine, rows: np.ndarray, lens: np.ndarray, now: float) -> None:
    engine.sock.rx, engine.sock.rx_len = rows, lens
    engine._dispatch(len(rows), now)


class _Side:
    """One worker's float sum on its own meta and data sessions, its sequence numbers from `start`."""

    def __init__(self, mode: str, start: int, x: np.ndarray, exps: np.ndarray, resent: np.ndarray | None = None):
        self.mode = mode
        self.engine = _Engine()
        self.socks = [BatchSocket(udp_socket(), batch=8, max_len=WIDTH, peers=1) for _ in range(2)]
        rto = RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01, maximum=1.0))
        self.meta, self.data = (CollectiveSession(SessionSpec(sid, "collective", 1, 0, WINDOW, N, ROW, purpose=p),
                                                  0, sock, rto, 0.0)
                                for sid, p, sock in ((1, "meta", self.socks[0]), (2, "data", self.socks[1])))
        for s in (self.meta, self.data):  # as if this stream had run for a while: near 2^32
            s.window.ack = start
            self.engine.sessions[s.id] = s
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
            rows, lens = _rows(seqs, [0] * meta_chunks, np.arange(meta_chunks) * LANES, [LANES] * meta_chunks,
                               [0] * meta_chunks, payload, chunks, int(Dtype.INT32), np.random.default_rng(0), 1)
            _feed(self.engine, rows, lens, 0.0)
        assert self.op.scale is not None, "the exponents' RESULTs completed the meta op"
        snd = self.data.send
        snd.high = snd.next_seq  # as if every chunk had been sent: some of them resent, in this order
        if resent is not None:
            snd.retx[:] = resent
            snd.xmit_no[:] = np.arange(len(resent))[::-1]

    def feed(self, rows: np.ndarray, lens: np.ndarray, now: float) -> None:
        with _kernels(self.mode):
            _feed(self.engine, rows, lens, now)

    def state(self):
        s, w, snd = self.data, self.data.window, self.data.send
        ops = {i: (o.got, o.saturated, [c.tolist() for c in o.saturated_chunks]) for i, o in s.ops.items()}
        out = self.op.dest.view(np.uint32).tolist()
        tail = None if self.op.tail is None else self.op.tail.view(np.uint32).tolist()
        done = self.handle.done()
        # the send stream's decisions, not how many calls brought them: `_handle` gives a batch's
        # delivery news in two calls when it holds a short packet (the rest, then the widened
        # copy), the whole-batch pass in one (the same holes marked lost, counted once, one RTT sample)
        news = {k: v for k, v in snd.stats.items() if k not in ("fast_retransmits", "rtt_samples", "rtt_seconds")}
        return (w.bits.tolist(), w.ack, w.duplicates, dict(s.stats), dict(s._failures._runs), ops, out, tail, done,
                self.handle.saturated if done else None, snd.ack, snd.sack_high, snd.rack_xmit, snd.lost.tolist(),
                news, dict(self.engine.stats))

    def close(self):
        for sock in self.socks:
            sock.close()


_SPOILS = ("lane", "header", "length", "offset", "numel", "count", "session", "type")


def _spoil(rows: np.ndarray, lens: np.ndarray, i: int, how: str, rng: np.random.Generator) -> None:
    """Make packet i of a batch wrong in one way the references count and drop."""
    h = header_view(rows[:, :HEADER_LEN])
    if how == "lane":  # a bit flip in its lanes: its check words fail
        j = int(rng.integers(HEADER_LEN, lens[i]))
        rows[i, j] ^= np.uint8(1 << int(rng.integers(0, 8)))
    elif how == "header":  # a bit flip in its header: its header check fails
        j = int(rng.integers(0, HEADER_LEN))
        rows[i, j] ^= np.uint8(1 << int(rng.integers(0, 8)))
        return
    elif how == "length":
        lens[i] -= 4 * LANE_CHUNK if lens[i] > HEADER_LEN + 4 * LANE_CHUNK else 4
    elif how == "offset":
        h["offset"][i] += 1
    elif how == "numel":
        h["numel"][i] += LANES
    elif how == "count":
        h["count"][i] = LANES + 1
    elif how == "session":  # another session's (no such session here: rx_unexpected)
        h["session"][i] = 9
    elif how == "type":  # a PARAM, which a collective session does not take
        h["ver_type"][i] = ver_type(MsgType.PARAM)
    seal_headers(rows[i:i + 1])  # a header sent so: the checks past the header check must catch it


@settings(max_examples=120, deadline=None)
@given(st.data(), st.integers(1, 9 * LANES), st.sampled_from([0, 5, 2**32 - 7, 2**32 - 40]))
def test_whole_batch_pass_matches_the_references_state_for_state(data, numel, start):
    rng = np.random.default_rng(numel + start)
    x = rng.standard_normal(numel).astype(np.float32)
    chunks = -(-numel // LANES)
    exps = np.array(data.draw(st.lists(st.sampled_from([-126, -60, -3, 0, 2, 40, 100]),
                                       min_size=chunks, max_size=chunks)), dtype=np.int32)
    resent = np.array(data.draw(st.lists(st.integers(0, 9), min_size=WINDOW, max_size=WINDOW))) == 0
    sides = [_Side(m, start, x, exps, resent) for m in ("reference", "numba")]
    fixed = int(Dtype.FIXED32)

    def batch(offs, tensors, flags):
        counts = [max(0, min(LANES, numel - o * LANES)) for o in offs]
        payload = rng.integers(-2**31, 2**31, size=len(offs) * LANES, dtype=np.int64).astype(np.int32)
        return _rows((start + np.array(offs, dtype=np.int64)) & 0xFFFFFFFF, tensors, np.array(offs) * LANES, counts,
                     flags, payload, numel, fixed, rng)

    try:
        assert sides[0].state() == sides[1].state()
        now, stale = 0.0, False
        for _ in range(data.draw(st.integers(1, 10))):
            offs = data.draw(st.lists(st.integers(0, chunks - 1), min_size=1, max_size=10))
            if data.draw(st.integers(0, 3)):
                offs = sorted(set(offs))  # the common batch: ascending, no repeats
            tensors = [0 if data.draw(st.integers(0, 40)) else 7 for _ in offs]  # 7: an op that is gone
            stale |= 7 in tensors
            flags = [int(Flag.SATURATED) if data.draw(st.integers(0, 40)) == 0 else 0 for _ in offs]
            rows, lens = batch(offs, tensors, flags)
            if data.draw(st.integers(0, 2)) == 0:  # a third of the batches: one packet spoilt
                how = data.draw(st.sampled_from(list(_SPOILS)))
                _spoil(rows, lens, data.draw(st.integers(0, len(offs) - 1)), how, rng)
            now += 0.001
            for side in sides:
                side.feed(rows.copy(), lens.copy(), now)
            assert sides[0].state() == sides[1].state()
        # then everything in order, as a lossless path delivers it: the op completes on both
        for first in range(0, chunks, WINDOW // 2):
            offs = list(range(first, min(chunks, first + WINDOW // 2)))
            rows, lens = batch(offs, [0] * len(offs), [0] * len(offs))
            now += 0.001
            for side in sides:
                side.feed(rows.copy(), lens.copy(), now)
            assert sides[0].state() == sides[1].state()
        if not stale:  # a stale op's row takes its seq: that chunk's own RESULT is then a duplicate
            assert all(side.handle.done() for side in sides)
            assert sides[1].op.dest.view(np.uint32).tolist() == sides[0].op.dest.view(np.uint32).tolist()
    finally:
        for side in sides:
            side.close()


def test_the_common_batch_takes_the_whole_batch_pass():
    """An in-order batch of a float sum, its short last chunk included, runs compiled in one pass
    (else the test above compares the references with themselves); one bad row sends the whole
    batch to the references with nothing changed first but the decode of the rows before it."""
    numel = 3 * LANES + 10  # the last chunk's packet: 64 lanes of a switch's 130
    x = np.arange(numel, dtype=np.float32)
    rng = np.random.default_rng(1)
    side = _Side("numba", 0, x, np.full(4, 12, np.int32))
    try:
        payload = rng.integers(-2**20, 2**20, size=4 * LANES, dtype=np.int64).astype(np.int32)
        counts = [LANES, LANES, LANES, 10]
        rows, lens = _rows(np.arange(4), [0] * 4, np.arange(4) * LANES, counts, [0] * 4, payload, numel,
                           int(Dtype.FIXED32), rng)
        assert lens[3] == HEADER_LEN + 4 * LANE_CHUNK
        h = header_view(np.ascontiguousarray(rows[:, :HEADER_LEN]))
        for how in _SPOILS:
            bad_rows, bad_lens = rows.copy(), lens.copy()
            _spoil(bad_rows, bad_lens, 3, how, rng)
            bad_h = header_view(np.ascontiguousarray(bad_rows[:, :HEADER_LEN]))
            with _kernels("numba"):
                assert not side.data.on_result_batch(bad_rows, bad_lens, bad_h, 0.001, checked=False), how
            assert side.data.window.ack == 0 and side.data.ops[0].got == 0 and not side.data.window.bits.any()
            assert not side.op.tail.any(), "the spoilt row (the short last chunk) was never decoded"
        with _kernels("numba"):
            assert side.data.on_result_batch(rows, lens, h, 0.002, checked=False)
        assert side.handle.done() and side.data.window.ack == 4
        s1, s2 = side.op.scale
        want = payload.reshape(4, LANES).astype(np.float32) * s1[:, None] * s2[:, None]
        assert side.op.dest.tolist() == want.reshape(-1)[:numel].tolist()
    finally:
        side.close()


def test_wire_lanes_on_ints_is_the_array_arithmetic():
    """integrity.wire_lanes of one packet on Python ints (a lone packet's length check, a lone
    row's shortening) is what its numpy arithmetic gives, for every dtype, MAX or not."""
    from luwu.dataplane.integrity import wire_lanes

    counts = np.arange(0, 3 * LANE_CHUNK + 3, dtype=np.int64)
    for lanes in (64, ROW, 2048, 16000):
        for dtype in Dtype:
            for flags in (0, int(Flag.MAX), int(Flag.SET | Flag.SATURATED)):
                want = wire_lanes(counts, int(dtype), np.full(len(counts), flags, np.uint8), lanes)
                got = [wire_lanes(int(c), int(dtype), flags, lanes) for c in counts.tolist()]
                assert got == want.tolist(), (lanes, dtype, flags)
