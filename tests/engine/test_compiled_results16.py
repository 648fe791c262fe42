"""The compiled RESULT pass of a FIXED16 sum (dataplane/kernels/fixed16_rows.py
`absorb_fixed16_results`, run by dataplane/engine/collective.py `_compiled_results16`) against the
numpy code it shortcuts (`on_results` with reductions.py `_decode16`).

Two real FIXED16 allreduces (`AllreduceOp`, grad_format "fixed16", on a meta and a data
`CollectiveSession` over loopback UDP sockets) get the same RESULT batches, one with
`LUWU_KERNELS=reference`, one compiled: after every batch the window, the send stream's delivery
state, the counts and the output bits must be identical. RESULTs are real sums of N encoded
contributions (check words and exponent lanes as the switch leaves them); batches hold
duplicates, gaps, descending runs, stale ops' rows, SATURATED rows, corrupted rows and the short
last chunk, and the sequence numbers wrap across 2^32.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_compiled_results import _feed, _kernels

from luwu.dataplane import fixed16
from luwu.dataplane import quantize as Q
from luwu.dataplane.engine.collective import CollectiveSession
from luwu.dataplane.engine.handles import Handle
from luwu.dataplane.engine.reductions import AllreduceOp
from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy
from luwu.dataplane.integrity import FIXED16_BLOCK as B
from luwu.dataplane.kernels import numba_available
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.protocol import HEADER_LEN, Dtype, Flag, MsgType, header_view, ver_type
from luwu.dataplane.session import SessionSpec

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed: no compiled pass to compare")

WINDOW, N = 16, 3
ROW = (2 * (B + 1) + 8 + 6) // 2  # lanes: two blocks per packet, 6 slots of padding, the 4 check lanes
NB, PER = fixed16.layout(ROW)
AGREE = fixed16.agreement_lanes(ROW)


def _headers(seqs, tensors, offsets, counts, flags, numel: int, session: int) -> np.ndarray:
    k = len(seqs)
    rows = np.zeros((k, HEADER_LEN + 4 * ROW), dtype=np.uint8)
    h = header_view(rows)
    h["ver_type"] = ver_type(MsgType.RESULT)
    h["session"], h["seq"], h["tensor"], h["offset"], h["count"] = session, seqs, tensors, offsets, counts
    h["flags"], h["numel"], h["dtype"], h["slot"] = flags, numel, int(Dtype.FIXED16), 5
    return rows


def _sums(xs, exps, seqs, tensors, chunks, flags, numel: int) -> np.ndarray:
    """RESULTs of chunks `chunks`: the switch's sum (int32 lanes, wrapping) of N contributions,
    each encoded as a worker encodes it, all with the same header (flags, in which SATURATED
    changes no check word)."""
    chunks = np.asarray(chunks, dtype=np.int64)
    counts = np.clip(numel - chunks * PER, 0, PER)
    total = None
    for x in xs:
        rows = _headers(seqs, tensors, chunks * PER, counts, 0, numel, 2)
        for i, c in enumerate(chunks.tolist()):
            fixed16.encode_rows(x, exps, N, ROW, rows[i:i + 1], c)
        lanes = rows[:, HEADER_LEN:].view(">i4").astype(np.int64)
        total = lanes if total is None else total + lanes
    rows = _headers(seqs, tensors, chunks * PER, counts, flags, numel, 2)
    rows[:, HEADER_LEN:].view(">u4")[...] = total & 0xFFFFFFFF
    return rows


class _Side:
    """One worker's FIXED16 sum on its own meta and data sessions, sequence numbers from `start`."""

    def __init__(self, mode: str, start: int, x: np.ndarray, exps: np.ndarray):
        self.mode = mode
        self.socks = [BatchSocket(udp_socket(), batch=8, max_len=HEADER_LEN + 4 * ROW, peers=1) for _ in range(2)]
        rto = RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01, maximum=1.0))
        self.meta, self.data = (CollectiveSession(SessionSpec(sid, "collective", 1, 0, WINDOW, N, ROW, purpose=p),
                                                  0, sock, rto, 0.0)
                                for sid, p, sock in ((1, "meta", self.socks[0]), (2, "data", self.socks[1])))
        for s in (self.meta, self.data):
            s.window.ack = start
            st_ = s.send
            st_.ack = st_.next_seq = st_.send_next = st_.sack_high = st_.burst_end = start
        self.handle = Handle()
        self.op = AllreduceOp(x, "sum", N, self.handle,
                              exps=AllreduceOp.local_exponents(x, "sum", ROW, "fixed16"), out=np.zeros_like(x),
                              grad_format="fixed16")
        with _kernels(mode):
            self.op.start(self.meta, self.data)
            k = -(-len(exps) // AGREE)
            seqs = (start + np.arange(k)) & 0xFFFFFFFF
            rows = _headers(seqs, [0] * k, np.arange(k) * AGREE, np.clip(len(exps) - np.arange(k) * AGREE, 0, AGREE),
                            int(Flag.MAX), len(exps), 1)
            fixed16.encode_agreement_rows(exps, ROW, rows, 0)
            _feed(self.meta, rows, 0.0)
        assert self.op.exps is not None and self.op.exps.tolist() == exps.tolist(), "the agreement completed"
        snd = self.data.send
        snd.high = snd.next_seq  # as if every chunk had been sent

    def feed(self, rows: np.ndarray, now: float) -> None:
        with _kernels(self.mode):
            _feed(self.data, rows, now)

    def state(self):
        s, w, snd = self.data, self.data.window, self.data.send
        ops = {i: (o.got, o.saturated, [c.tolist() for c in o.saturated_chunks]) for i, o in s.ops.items()}
        done = self.handle.done()
        return (w.bits.tolist(), w.ack, w.duplicates, dict(s.stats), ops, self.op.dest.view(np.uint32).tolist(),
                sorted(self.op.corrupt), done, self.handle.saturated if done else None, snd.ack, snd.sack_high,
                snd.rack_xmit, snd.lost.tolist(), dict(snd.stats))

    def close(self):
        for sock in self.socks:
            sock.close()


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 20 * PER), st.sampled_from([0, 5, 2**32 - 7, 2**32 - 40]))
def test_compiled_fixed16_pass_matches_the_reference_state_for_state(data, numel, start):
    rng = np.random.default_rng(numel + start)
    xs = [(rng.standard_normal(numel) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32) for _ in range(N)]
    exps = np.max([Q.block_exponents(x, B) for x in xs], axis=0).astype(np.int32)
    chunks = -(-numel // PER)
    sides = [_Side(m, start, xs[0], exps) for m in ("reference", "numba")]
    try:
        assert sides[0].state() == sides[1].state()
        now, stale = 0.0, False
        for _ in range(data.draw(st.integers(1, 8))):
            offs = data.draw(st.lists(st.integers(0, chunks - 1), min_size=1, max_size=10))
            if data.draw(st.booleans()):
                offs = sorted(set(offs))  # the common batch: ascending, no repeats
            tensors = [0 if data.draw(st.integers(0, 15)) else 7 for _ in offs]  # 7: an op that is gone
            stale |= 7 in tensors
            flags = [int(Flag.SATURATED) if data.draw(st.integers(0, 20)) == 0 else 0 for _ in offs]
            rows = _sums(xs, exps, (start + np.array(offs, dtype=np.int64)) & 0xFFFFFFFF, tensors, offs, flags, numel)
            if data.draw(st.integers(0, 10)) == 0:  # a lane corrupted after the switch: dropped, resent
                rows[0, HEADER_LEN + data.draw(st.integers(0, 4 * ROW - 1))] ^= 0x04
            now += 0.001
            for side in sides:
                side.feed(rows.copy(), now)
            assert sides[0].state() == sides[1].state()
        for first in range(0, chunks, WINDOW // 2):  # then everything in order: the op completes on both
            offs = list(range(first, min(chunks, first + WINDOW // 2)))
            rows = _sums(xs, exps, (start + np.array(offs, dtype=np.int64)) & 0xFFFFFFFF, [0] * len(offs), offs,
                         [0] * len(offs), numel)
            now += 0.001
            for side in sides:
                side.feed(rows.copy(), now)
            assert sides[0].state() == sides[1].state()
        if not stale:
            assert all(side.handle.done() for side in sides)
    finally:
        for side in sides:
            side.close()


def test_the_common_fixed16_batch_takes_the_compiled_pass():
    """An in-order batch of plain FIXED16 sums runs compiled (else the test above compares the
    reference with itself), and decodes within the format's bound; a SATURATED one does not."""
    rng = np.random.default_rng(3)
    numel = 6 * PER - 5
    xs = [rng.standard_normal(numel).astype(np.float32) for _ in range(N)]
    exps = np.max([Q.block_exponents(x, B) for x in xs], axis=0).astype(np.int32)
    side = _Side("numba", 0, xs[0], exps)
    try:
        for offs, flags, taken in (([0, 1, 2], [0, 0, 0], True), ([3, 4, 5], [0, int(Flag.SATURATED), 0], False)):
            rows = _sums(xs, exps, np.array(offs), [0] * 3, offs, flags, numel)
            side.data._verified(np.arange(3), rows, header_view(np.ascontiguousarray(rows[:, :HEADER_LEN])))
            hb = np.ascontiguousarray(rows[:, :HEADER_LEN])
            with _kernels("numba"):
                assert side.data._compiled_results(rows, header_view(hb), 0.001) == taken
        assert side.data.window.ack == 3 and side.data.ops[0].got == 3
        # valid check words, but a header in_bounds refuses (another numel, a count past a packet,
        # an offset off a chunk): left to the reference, nothing changed
        bad = [_sums(xs, exps, np.array([3]), [0], [3], [0], numel + 1)]
        bad.append(_sums(xs, exps, np.array([3]), [0], [3], [0], numel))
        header_view(bad[-1])["count"] = PER + 1
        bad.append(_sums(xs, exps, np.array([3]), [0], [3], [0], numel))
        header_view(bad[-1])["offset"] = 3 * PER + 1
        for rows in bad:
            with _kernels("numba"):
                assert not side.data._compiled_results16(side.data.ops[0], rows, header_view(
                    np.ascontiguousarray(rows[:, :HEADER_LEN])), 0.003)
        assert side.data.window.ack == 3 and side.data.ops[0].got == 3
        got = side.op.dest[:3 * PER].astype(np.float64)
        exact = np.sum([x[:3 * PER].astype(np.float64) for x in xs], axis=0)
        assert (np.abs(got - exact) <= Q.error_bound16(side.op.dest[:3 * PER], exps[:3 * PER // B], B, N)).all()
    finally:
        side.close()
