"""inf, NaN and float32 overflow through real engines and the software switch (docs/protocol.md 5.1).

The engine never returns a clipped fixed-point sum: a chunk whose RESULT carries SATURATED reads NaN
and the handle says `saturated`; with the torch backend's exact fallback (ExactFallback over real
TCP channels) every element equals the IEEE reference: saturated chunks the float64 rank-order sum
rounded once, the others within the fixed-point bound. MAX/MIN propagate NaN like np.maximum.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.protocol import Dtype
from luwu.dataplane.quantize import chunk_exponents, error_bound
from luwu.worker.backend.fallback import ExactFallback
from luwu.worker.p2p import P2PChannel

LANES = data_lanes(64, Dtype.FIXED32)  # elements per packet in tofino mode (2 lanes are check words)
N = 3
SPECIALS = (np.inf, -np.inf, np.nan, np.float32(3e38), np.float32(-2.5e38))  # the last two: |x| >= 2^127


def _saturated_chunks(xs: list[np.ndarray]) -> np.ndarray:
    """Chunks some contributor cannot put in fixed point: non-finite, or |x| >= 2^127 (exponent 128)."""
    bad = np.zeros(xs[0].size, bool)
    for x in xs:
        bad |= ~(np.abs(x.astype(np.float64)) < 2.0**127)
    chunks = -(-xs[0].size // LANES)
    padded = np.zeros(chunks * LANES, bool)
    padded[: bad.size] = bad
    return padded.reshape(chunks, LANES).any(axis=1)


def _in_chunks(mask: np.ndarray, numel: int) -> np.ndarray:
    return np.repeat(mask, LANES)[:numel]


def test_engine_marks_saturated_chunks_nan_and_keeps_the_rest():
    rng = np.random.default_rng(3)
    xs = [(rng.standard_normal(5 * LANES + 7) * 50).astype(np.float32) for _ in range(N)]
    xs[0][LANES + 1] = np.inf
    xs[1][3 * LANES] = np.nan
    xs[2][5 * LANES + 2] = np.float32(3e38)
    with star(N) as (_, _, engines):
        hs = [e.allreduce(x) for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in hs]
        clean = [h.wait(60) for h in [e.allreduce(np.ones(LANES, np.float32)) for e in engines]]
    sat = _in_chunks(_saturated_chunks(xs), xs[0].size)
    assert sat.sum() == 2 * LANES + 7
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    exps = np.max([chunk_exponents(x, LANES) for x in xs], axis=0)
    for h, r in zip(hs, results):
        assert h.saturated
        assert np.isnan(r[sat]).all(), "a saturated chunk must never come back as a number"
        bound = error_bound(r, exps, LANES, N)
        assert (np.abs(r[~sat] - exact[~sat]) <= bound[~sat]).all()
    for r in clean:  # the next operation is unaffected
        np.testing.assert_array_equal(r, np.full(LANES, N, np.float32))


def test_max_min_propagate_nan_and_order_infinities():
    xs = [np.array([np.nan, -np.inf, np.inf, 1, -2, 0, -np.nan, 3], np.float32),
          np.array([1, 5, 2, -np.inf, np.nan, -0.0, 7, np.inf], np.float32),
          np.array([0.5, -1, -np.inf, 2, 3, 0, 1, -np.inf], np.float32)]
    with star(N) as (_, _, engines):
        mx = [h.wait(60) for h in [e.allreduce(x, "max") for e, x in zip(engines, xs)]]
        mn = [h.wait(60) for h in [e.allreduce(x, "min") for e, x in zip(engines, xs)]]
    for r in mx:
        np.testing.assert_array_equal(r, np.maximum.reduce(xs))  # NaN-propagating, as torch.maximum
    for r in mn:
        np.testing.assert_array_equal(r, np.minimum.reduce(xs))


@pytest.fixture(scope="module")
def group():
    """N engines on one software switch and N TCP channels, each with its exact fallback."""
    store = dist.HashStore()
    with star(N) as (_, _, engines):
        chans = [None] * N
        import threading

        def open_chan(r):
            chans[r] = P2PChannel(store, r, N, "127.0.0.1", timedelta(seconds=30))

        ts = [threading.Thread(target=open_chan, args=(r,)) for r in range(N)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        try:
            yield engines, [ExactFallback(c, r, N) for r, c in enumerate(chans)]
        finally:
            for c in chans:
                if c is not None:
                    c.close()


@st.composite
def sprinkled(draw):
    numel = draw(st.integers(1, 4 * LANES + 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = 10.0 ** draw(st.floats(-6, 30))
    xs = [(rng.standard_normal(numel) * scale).astype(np.float32) for _ in range(N)]
    for _ in range(draw(st.integers(0, 6))):
        r, i = draw(st.integers(0, N - 1)), draw(st.integers(0, numel - 1))
        xs[r][i] = draw(st.sampled_from(SPECIALS))
    return xs, draw(st.sampled_from(["sum", "avg"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=sprinkled())
def test_sprinkled_nonfinite_matches_ieee_reference(group, case):
    xs, op = case
    engines, fallbacks = group
    hs = [f.guard(e.allreduce(x, op), x, op) for e, f, x in zip(engines, fallbacks, xs)]
    results = [h.wait(60) for h in hs]
    with np.errstate(invalid="ignore", over="ignore"):
        ref64 = np.sum([x.astype(np.float64) for x in xs], axis=0) / (N if op == "avg" else 1)
        ref = ref64.astype(np.float32)  # the IEEE reference: NaN/inf by IEEE rules, overflow to inf
    sat = _in_chunks(_saturated_chunks(xs), xs[0].size)
    exps = np.max([chunk_exponents(x, LANES) for x in xs], axis=0)
    for r in results:
        np.testing.assert_array_equal(r, results[0])  # identical on every rank
        np.testing.assert_array_equal(r[sat], ref[sat])  # the exact path (NaN == NaN here)
        ok = ~sat & np.isfinite(ref)
        k = N if op == "avg" else 1  # avg: the sum's bound / N, plus the division's rounding
        with np.errstate(over="ignore"):
            bound = error_bound(r * np.float32(k), exps, LANES, N) / k + (k > 1) * np.spacing(np.abs(r))
        assert (np.abs(r[ok].astype(np.float64) - ref64[ok]) <= bound[ok]).all()
        np.testing.assert_array_equal(np.isnan(r), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(r) * np.sign(r), np.isinf(ref) * np.sign(ref))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=sprinkled())
def test_in_place_sums_keep_the_inputs_the_exact_path_needs(group, case):
    """out=x (the torch backend reduces a tensor in its own storage): the result overwrites the
    input, so the engine keeps this worker's inputs of saturated chunks (reductions.py) and the
    exact path gives the same bits as with a separate output."""
    xs, op = case
    engines, fallbacks = group
    ys = [x.copy() for x in xs]
    hs = [f.guard(e.allreduce(y, op, out=y), y, op) for e, f, y in zip(engines, fallbacks, ys)]
    results = [h.wait(60) for h in hs]
    ref = [h.wait(60) for h in [f.guard(e.allreduce(x, op), x, op) for e, f, x in zip(engines, fallbacks, xs)]]
    for r, y, want in zip(results, ys, ref):
        assert r is y, "an in-place sum must land in the caller's array, not a new one"
        np.testing.assert_array_equal(r, want)  # NaN == NaN here


def test_grad_path_gives_the_node_nan_for_saturated_chunks_never_a_clipped_number():
    """Model in the network: a GRAD sum with an inf contribution reaches the node's sink flagged and NaN
    in that chunk (the node's check then rejects it as non-finite), the other chunks exact."""
    import threading

    from luwu.dataplane.engine import Engine
    from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
    from luwu.mininet.paramstore import SgdParamStore

    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64)
    numel = 3 * LANES + 1
    got, arrived = {}, threading.Event()

    store = SgdParamStore({5: np.zeros(numel, np.float32)}, lr=0.5)

    def sink(tensor: int, grad: np.ndarray, saturated: bool) -> None:
        got[tensor] = (grad.copy(), saturated)
        arrived.set()

    grads = [np.ones(numel, np.float32), np.ones(numel, np.float32)]
    grads[0][LANES + 2] = np.inf
    with LoopbackSwitch(plan, seed=1):
        node = Engine(plan.node_plan(0), provider=store, on_gradient=sink)
        store.engine = node
        node.start()
        engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
        try:
            for e in engines:  # binds the node session, as a job's first pull does
                e.pull(plan.node_session(0), 5, 0).wait(60)
            for h in [e.push(plan.node_session(0), 5, g) for e, g in zip(engines, grads)]:
                h.wait(60)
            assert arrived.wait(60), "the node never got the summed gradient"
        finally:
            for e in engines:
                e.close()
            node.close()
    grad, saturated = got[5]
    assert saturated
    assert np.isnan(grad[LANES:2 * LANES]).all()
    np.testing.assert_array_equal(np.delete(grad, np.s_[LANES:2 * LANES]), np.full(numel - LANES, 2, np.float32))
