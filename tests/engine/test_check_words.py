"""Check words (docs/protocol.md 3.6) end to end through the software switch: every aggregation
packet's last two lanes carry a linear code of its lanes that the switch sums like data.

* a lane of a RESULT corrupted after the switch: the RESULT is dropped and counted
  (`dropped.bad_check`), the resend gets the switch's stored copy, the result is exact;
* a lane of a contribution corrupted before the switch: the stored sum is wrong, every resend
  fails, and after three the chunk takes the exact path (a float sum: NaN there and `saturated`,
  which the torch backend recomputes exactly; an int32 sum: CorruptResult, never a number).
"""

from __future__ import annotations

import numpy as np
import pytest

from luwu.dataplane.engine.handles import CorruptResult
from luwu.dataplane.integrity import check_words, headers_ok, seal_headers
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.protocol import DATA_HEADER, HEADER_LEN, Dtype, Flag, MsgType, Packet, header_view

LANES = 64  # tofino mode: 62 data lanes and 2 check lanes per packet
DATA = LANES - 2


def _flip_lane(rows: np.ndarray, idx, mtype: int, budget: list[int], dtype: int | None = None) -> None:
    """Flip one bit of data lane 3 of the first `budget[0]` packets of type `mtype` (and dtype)
    among rows `idx`, their header check sealed again (a payload corrupted, the header intact)."""
    for i in np.asarray(idx).tolist():
        h = rows[i:i + 1, :HEADER_LEN]
        if (budget[0] and rows[i, 0] & 0xF == mtype and (dtype is None or rows[i, 25] == dtype)
                and headers_ok(h).all()):
            rows[i, HEADER_LEN + 4 * 3 + 3] ^= 0x10
            seal_headers(h)
            budget[0] -= 1


def _bad_checks(engines) -> int:
    return sum(s.get("dropped.bad_check", 0) for e in engines for s in e.session_stats().values())


def _corrupt_chunks(engines) -> int:
    return sum(s.get("corrupt_chunks", 0) for e in engines for s in e.session_stats().values())


def test_the_sender_writes_the_reference_check_words():
    """A packet as the engine sends it carries `integrity.check_words` of its lanes and header."""
    x = np.arange(3 * DATA + 5, dtype=np.int32) * 1000 - 7
    seen = []
    with star(1, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        run = sw.pipeline.run

        def spy(b):
            for i in range(len(b)):
                seen.append(b.rows[i, b.off:b.off + b.length[i]].tobytes())
            return run(b)

        sw.pipeline.run = spy
        np.testing.assert_array_equal(engines[0].allreduce(x).wait(60), x)
    contributions = [Packet.unpack(d) for d in seen if d[0] & 0xF == MsgType.ALLREDUCE and len(d) > HEADER_LEN]
    assert len(contributions) >= 4
    for p in contributions:
        lanes = p.lanes()
        h = {name: getattr(p, name) for name in ("session", "seq", "slot", "tensor", "offset", "count", "numel",
                                                   "flags", "exponent")}
        h["type"] = p.type
        want = check_words(lanes[:DATA], h, p.dtype)
        assert lanes[DATA:].view(np.uint32).tolist() == want.tolist()
        assert p.count <= DATA and p.offset % DATA == 0


@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_a_result_corrupted_after_the_switch_is_dropped_and_resent_exact(dtype):
    rng = np.random.default_rng(3)
    if dtype == "int32":
        xs = [rng.integers(-2**31, 2**31, 4 * DATA + 9, dtype=np.int64).astype(np.int32) for _ in range(2)]
    else:
        xs = [rng.standard_normal(4 * DATA + 9).astype(np.float32) for _ in range(2)]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        clean = [h.wait(60) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]  # the loss-free bits
        budget = [2]
        emit = sw.emit

        def corrupting_emit(b, em):
            _flip_lane(b.rows[:, b.off:], np.unique(em.pkt), MsgType.RESULT, budget,
                       None if dtype == "int32" else Dtype.FIXED32)
            return emit(b, em)

        sw.emit = corrupting_emit
        results = [h.wait(60) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]
        bad, corrupt = _bad_checks(engines), _corrupt_chunks(engines)
    assert budget == [0]
    for r, c in zip(results, clean):
        np.testing.assert_array_equal(r, c)
    assert bad == 2 * 2 and corrupt == 0, (bad, corrupt)  # each RESULT row went to both workers


def test_a_float_contribution_corrupted_before_the_switch_takes_the_exact_path():
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(4 * DATA + 9).astype(np.float32) for _ in range(2)]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        turn = sw.handle_turn
        budget = [1]

        def corrupting_turn(rx, segments):  # the first FIXED32 contribution, first transmission only
            _flip_lane(rx.turn_rows(rx.filled), np.arange(rx.filled), MsgType.ALLREDUCE, budget, Dtype.FIXED32)
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn
        handles = [e.allreduce(x) for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in handles]
        corrupt = _corrupt_chunks(engines)
        bad = _bad_checks(engines)
    assert budget == [0]
    exact = (xs[0].astype(np.float64) + xs[1]).astype(np.float32)
    for h, r in zip(handles, results):
        assert h.saturated, "the corrupted chunk goes to the exact path"
        nan = np.isnan(r)
        assert nan.sum() == DATA, "exactly one chunk is handed to the exact path"
        np.testing.assert_allclose(r[~nan], exact[~nan], rtol=1e-5, atol=1e-5)
    # each worker: 2 counted drops, then the exact path (a late extra copy of the wrong sum is dropped too)
    assert corrupt == 2 and bad >= 2 * 2, (corrupt, bad)


def test_an_int32_contribution_corrupted_before_the_switch_raises():
    xs = [np.arange(3 * DATA, dtype=np.int32) + r for r in range(2)]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        turn = sw.handle_turn
        budget = [1]

        def corrupting_turn(rx, segments):
            _flip_lane(rx.turn_rows(rx.filled), np.arange(rx.filled), MsgType.ALLREDUCE, budget, Dtype.INT32)
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn
        handles = [e.allreduce(x) for e, x in zip(engines, xs)]
        for h in handles:
            with pytest.raises(CorruptResult, match="check words") as e:
                h.wait(60)
            # named, with what an exact recomputation needs (the torch backend's: worker/backend/fallback.py)
            assert len(e.value.chunks) == 1 and e.value.per == DATA, (e.value.chunks, e.value.per)
            good = np.ones(xs[0].size, bool)
            good[e.value.chunks[0] * DATA:(e.value.chunks[0] + 1) * DATA] = False
            np.testing.assert_array_equal(e.value.result[good], (xs[0] + xs[1])[good])
    assert budget == [0]


def test_a_corrupt_fingerprint_agreement_is_counted_and_the_checked_data_stands():
    """An int32 allreduce's fingerprint rides one INT32 MAX packet on the meta session, whose check
    words are its header terms (docs/protocol.md 3.6); one of them corrupted before the switch fails
    on every resend: the fingerprint proves nothing either way (like a lane whose tag fails), it is
    counted, and the data, checked by its own check words, is the result on every worker."""
    from luwu.dataplane.loopback.plan import META_SESSION

    xs = [np.arange(3 * DATA, dtype=np.int32) * (r + 2) for r in range(2)]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        turn = sw.handle_turn
        budget = [1]

        def corrupting_turn(rx, segments):  # the first contribution on the meta session only
            rows = rx.turn_rows(rx.filled)
            meta = np.flatnonzero(rows[:rx.filled, 2].astype(int) * 256 + rows[:rx.filled, 3] == META_SESSION)
            for i in meta.tolist():  # its first check word (the lanes past DATA)
                h = rows[i:i + 1, :HEADER_LEN]
                if budget[0] and rows[i, 0] & 0xF == MsgType.ALLREDUCE and headers_ok(h).all():
                    rows[i, HEADER_LEN + 4 * DATA + 3] ^= 0x10
                    seal_headers(h)
                    budget[0] -= 1
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn
        check = np.array([7, 3, 3 * DATA], dtype=np.int32)
        handles = [e.allreduce(x, check=check) for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in handles]
        corrupt = _corrupt_chunks(engines)
        counted = sum(s.get("agreement.corrupt", 0) for e in engines for s in e.session_stats().values())
    assert budget == [0]
    for h, r in zip(handles, results):
        np.testing.assert_array_equal(r, xs[0] + xs[1])
        assert h.info.get("agreement_corrupt"), "the corrupt agreement is marked on the handle"
    assert corrupt == 2 and counted == 2, (corrupt, counted)


def test_header_terms_match_the_reference():
    rng = np.random.default_rng(0)
    from luwu.dataplane.integrity import check_words_rows

    for dtype in (Dtype.INT32, Dtype.FIXED32, Dtype.ORDERED32, Dtype.FIXED16):
        hb = rng.integers(0, 256, (6, HEADER_LEN)).astype(np.uint8)
        h = hb.view(DATA_HEADER)[:, 0]
        hb[:, 0] = (2 << 4) | rng.choice([1, 2, 3, 4], 6)
        lo, hi = (-2**15, 2**15) if dtype == Dtype.FIXED16 else (-2**31, 2**31)
        vals = rng.integers(lo, hi, (6, 40))
        for n in (1, 5):
            got = check_words_rows(vals, h, dtype, n)
            for i in range(6):
                d = {name: int(header_view(hb[i:i + 1])[name][0]) for name in DATA_HEADER.names}
                d["type"] = int(hb[i, 0]) & 0xF
                assert got[i].tolist() == check_words(vals[i], d, dtype, n).tolist()


def _node_run(corrupt):
    """Two workers push one layer to the node through the switch, `corrupt(sw)` patching the
    switch first; (the node's session stats, the store, the expected SGD step)."""
    from node_star import node_star

    from luwu.dataplane.loopback import StarPlan
    from luwu.mininet.paramstore import SgdParamStore

    rng = np.random.default_rng(9)
    layer = rng.standard_normal(3 * DATA + 5).astype(np.float32)
    grads = [(rng.standard_normal(layer.size) * 0.01).astype(np.float32) for _ in range(2)]
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64, transport="udp")
    server = SgdParamStore({4: layer.copy()}, lr=0.5)
    sid = plan.node_session(0)
    with node_star(plan, server) as star:
        corrupt(star.switch._sw)
        for h in [e.push(sid, 4, g) for e, g in zip(star.engines, grads)]:
            h.wait(60)
        stats = star.node.session_stats()[f"session {sid}"]
    want = layer.astype(np.float64) - 0.5 * (grads[0].astype(np.float64) + grads[1])
    return stats, server, want


def test_an_agg_corrupted_after_the_switch_is_dropped_and_resent():
    budget = [2]

    def corrupt(sw):
        emit = sw.emit

        def corrupting_emit(b, em):
            _flip_lane(b.rows[:, b.off:], np.unique(em.pkt), MsgType.AGG, budget)
            return emit(b, em)

        sw.emit = corrupting_emit

    stats, server, want = _node_run(corrupt)
    assert budget == [0]
    assert stats["dropped.bad_check"] == 2 and stats["rejected.corrupt"] == 0, stats
    assert not server.saturated and server.gradients == 1
    np.testing.assert_allclose(server.params[4], want, atol=1e-4)


def test_a_grad_corrupted_before_the_switch_rejects_the_layers_gradient():
    budget = [1]

    def corrupt(sw):
        turn = sw.handle_turn

        def corrupting_turn(rx, segments):
            _flip_lane(rx.turn_rows(rx.filled), np.arange(rx.filled), MsgType.GRAD, budget, Dtype.FIXED32)
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn

    stats, server, _want = _node_run(corrupt)
    assert budget == [0]
    assert stats["rejected.corrupt"] == 1 and stats["dropped.bad_check"] >= 2, stats
    assert server.saturated, "the corrupted chunk reaches the node as non-finite, never as a plausible sum"
    assert np.isnan(server.params[4]).sum() == DATA  # (the plain SGD store applies it: the optimizer node skips it)


@pytest.mark.parametrize("kernels", ["numba", "reference"])
def test_the_compiled_lane_sums_are_the_reference(kernels, monkeypatch):
    from luwu.dataplane.engine.packets import check_words_of
    from luwu.dataplane.integrity import check_words_rows
    from luwu.dataplane.kernels import numba_available

    if kernels == "numba" and not numba_available():
        pytest.skip("numba is not installed")
    monkeypatch.setenv("LUWU_KERNELS", kernels)
    rng = np.random.default_rng(11)
    lanes = 300
    rows = rng.integers(0, 256, (9, HEADER_LEN + 4 * (lanes + 2))).astype(np.uint8)
    rows[:, 0] = (2 << 4) | MsgType.RESULT
    rows[:, 1] &= 0x07  # no MAX
    h = header_view(np.ascontiguousarray(rows[:, :HEADER_LEN]))
    idx = np.array([0, 3, 4, 8])
    for dtype in (Dtype.INT32, Dtype.FIXED32, Dtype.ORDERED32):
        got = check_words_of(rows, idx, lanes, h[idx], int(dtype), 3)
        want = check_words_rows(rows[idx, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4"), h[idx], int(dtype), 3)
        np.testing.assert_array_equal(got, want)


def test_a_corrupted_contribution_ends_in_the_backends_exact_sum():
    """The whole chain the torch backend runs: the engine hands the chunk whose stored sum is
    corrupt as NaN + saturated, and worker/backend/fallback.py's ExactFallback recomputes those
    elements over TCP: the result is the exact (float64, rounded once) sum there, and the
    fixed-point sum within its bound elsewhere."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from luwu.dataplane.quantize import chunk_exponents, error_bound
    from luwu.worker.backend.fallback import ExactFallback
    from luwu.worker.p2p import P2PChannel

    n = 2
    rng = np.random.default_rng(21)
    xs = [rng.standard_normal(4 * DATA + 9).astype(np.float32) for _ in range(n)]
    store = dist.HashStore()
    chans: list = [None] * n
    with star(n, transport="udp") as (_, lsw, engines):
        ts = [threading.Thread(target=lambda r=r: chans.__setitem__(
            r, P2PChannel(store, r, n, "127.0.0.1", timedelta(seconds=30)))) for r in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        try:
            sw = lsw._sw
            turn = sw.handle_turn
            budget = [1]

            def corrupting_turn(rx, segments):
                _flip_lane(rx.turn_rows(rx.filled), np.arange(rx.filled), MsgType.ALLREDUCE, budget, Dtype.FIXED32)
                return turn(rx, segments)

            sw.handle_turn = corrupting_turn
            fallbacks = [ExactFallback(c, r, n) for r, c in enumerate(chans)]
            hs = [f.guard(e.allreduce(x), x, "sum") for e, f, x in zip(engines, fallbacks, xs)]
            results = [h.wait(60) for h in hs]
            corrupt = _corrupt_chunks(engines)
            exchanged = sum(f.stats["elements"] for f in fallbacks)
        finally:
            for c in chans:
                if c is not None:
                    c.close()
    assert budget == [0] and corrupt == n and exchanged == n * DATA
    exact = (xs[0].astype(np.float64) + xs[1]).astype(np.float32)
    exps = np.max([chunk_exponents(x, DATA) for x in xs], axis=0)
    for r in results:
        assert not np.isnan(r).any()
        bound = error_bound(r, exps, DATA, n)
        assert (np.abs(r.astype(np.float64) - exact) <= bound).all()
    np.testing.assert_array_equal(results[0], results[1])  # every rank the same bits


@pytest.mark.parametrize("op", ["max", "min"])
def test_a_max_below_a_workers_own_value_is_refused(op):
    """MAX lanes carry no check words of their data; each worker checks the result is not below
    what it sent (in the op's order): a lowered lane fails the op with CorruptResult."""
    xs = [np.arange(3 * DATA, dtype=np.float32) + r for r in range(2)]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        emit = sw.emit
        budget = [1]

        def corrupting_emit(b, em):
            rows = b.rows[:, b.off:]
            for i in np.unique(em.pkt).tolist():
                if budget[0] and rows[i, 0] & 0xF == MsgType.RESULT and rows[i, 25] == Dtype.ORDERED32:
                    # the lowest key (a max) or, min being a max of negated keys, the same
                    rows[i, HEADER_LEN + 4 * 3:HEADER_LEN + 4 * 4] = np.frombuffer(b"\x80\x00\x00\x00", np.uint8)
                    budget[0] -= 1
            return emit(b, em)

        sw.emit = corrupting_emit
        handles = [e.allreduce(x, op) for e, x in zip(engines, xs)]
        for h in handles:
            with pytest.raises(CorruptResult, match="below this worker's own"):
                h.wait(60)
    assert budget == [0]


@pytest.mark.parametrize("kernels", ["numba", "reference"])
def test_the_compiled_fill_and_check_are_the_reference(kernels, monkeypatch):
    """packets.write_check_words (a fill) writes the reference's words, and check_words_hold (every
    RESULT) holds exactly for the rows that carry the reference's words of a sum of n."""
    from luwu.dataplane.engine.packets import check_words_hold, write_check_words
    from luwu.dataplane.integrity import check_words_rows
    from luwu.dataplane.kernels import numba_available

    if kernels == "numba" and not numba_available():
        pytest.skip("numba is not installed")
    monkeypatch.setenv("LUWU_KERNELS", kernels)
    rng = np.random.default_rng(12)
    lanes = 257
    for dtype in (Dtype.INT32, Dtype.FIXED32, Dtype.ORDERED32):
        rows = rng.integers(0, 256, (12, HEADER_LEN + 4 * (lanes + 2))).astype(np.uint8)
        rows[:, 0] = (2 << 4) | rng.choice([int(MsgType.GRAD), int(MsgType.ALLREDUCE)], 12)
        rows[:, 1] &= 0x07  # no MAX
        h = header_view(np.ascontiguousarray(rows[:, :HEADER_LEN]))
        want1 = check_words_rows(rows[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4"), h, int(dtype), 1)
        write_check_words(rows, lanes, h, int(dtype))
        got = rows[:, HEADER_LEN + 4 * lanes:].view(">u4").astype(np.uint64)
        np.testing.assert_array_equal(got, want1)
        # a receiver's check of a sum of 3: the rows given the reference's words hold, a flipped bit does not
        idx = np.array([1, 4, 5, 11])
        hs = h[idx]
        want3 = check_words_rows(rows[idx, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4"), hs, int(dtype), 3)
        rows[idx, HEADER_LEN + 4 * lanes:] = want3.astype(">u4").view(np.uint8).reshape(len(idx), 8)
        assert check_words_hold(rows, idx, lanes, hs, int(dtype), 3).all()
        rows[4, HEADER_LEN + 4 * 7] ^= 0x20  # a lane of row 4
        rows[11, HEADER_LEN + 4 * lanes + 6] ^= 0x01  # the second check word of row 11
        np.testing.assert_array_equal(check_words_hold(rows, idx, lanes, hs, int(dtype), 3),
                                      [True, False, True, False])
        if dtype != Dtype.INT32:  # (INT32's header term is 0: its words do not depend on n)
            assert not check_words_hold(rows, idx[:1], lanes, hs[:1], int(dtype), 2).any()  # the wrong n


@pytest.mark.parametrize("cut", [17, 100])  # 100: the last chunk's packet is short (256 of 303 lanes)
def test_the_fused_quantise_and_check_fill_is_the_reference(monkeypatch, cut):
    """A FIXED32 fill with check lanes (packets.aggregation_fill over QuantizedLanes): compiled, the
    check words are written in the quantising pass (kernels/fixed_point.py `quantize_rows_checked`),
    the headers flagged, sealed and copied by `seal_rows32`; every byte of every row (saturated, NaN and short-tail chunks included) is the reference's."""
    import functools

    from luwu.dataplane.engine.packets import QuantizedLanes, aggregation_fill
    from luwu.dataplane.kernels import numba_available

    if not numba_available():
        pytest.skip("numba is not installed")
    from luwu.dataplane.kernels import fixed_point

    lanes, chunks = 301, 9
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(lanes * chunks - cut) * 50).astype(np.float32)
    x[lanes + 3] = np.nan
    x[2 * lanes + 8] = 1e9  # past the agreed exponent: the chunk saturates
    x[4 * lanes + 1] = -np.inf
    exps = np.full(chunks, 10, np.int32)  # |x| < 2^10: only the 3 chunks below saturate
    exps[6] = 20
    out = {}
    for mode in ("reference", "numba"):
        monkeypatch.setenv("LUWU_KERNELS", mode)
        told = []
        lanes_of = QuantizedLanes(x, exps, lanes, 3, on_saturated=functools.partial(told.append, 1))
        fill = aggregation_fill(seg_start=5, msg_type=MsgType.ALLREDUCE, session=2, worker=1, pool_base=0,
                                pool_size=8, lanes=lanes, tensor=4, numel=x.size, dtype=Dtype.FIXED32,
                                lanes_of=lanes_of, exponents=exps, row_lanes=lanes + 2)
        rows = np.full((chunks, 32 + 4 * (lanes + 2) + 12), 0xAB, dtype=np.uint8)  # wider rows: a ring's
        lens = np.zeros(chunks, dtype=np.int64)
        fill(0, 2, rows[:2], lens[:2])  # (a few rows: the scalar headers)
        fill(2, chunks, rows[2:], lens[2:])
        out[mode] = (rows, lens, len(told))
    np.testing.assert_array_equal(out["numba"][0], out["reference"][0])
    np.testing.assert_array_equal(out["numba"][1], out["reference"][1])
    assert (out["numba"][1][-1] < 32 + 4 * (lanes + 2)) == (cut == 100)
    assert out["numba"][2] == out["reference"][2] > 0
    sat = (header_view(out["numba"][0])["flags"] & int(Flag.SATURATED)) != 0
    np.testing.assert_array_equal(np.flatnonzero(sat), [1, 2, 4])
    assert fixed_point.quantize_rows_checked.signatures, "the compiled fill ran the fused pass"
    assert fixed_point.seal_rows32.signatures, "and sealed its headers compiled"
