"""In-network allreduce through the software switch: exact for int32, within the fixed-point
bound for float32, exact for max/min; every size from empty to multi-packet; several ops in
flight; loss, duplication and reordering on every port."""

from __future__ import annotations

import numpy as np
import pytest

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.protocol import Dtype
from luwu.dataplane.quantize import chunk_exponents, error_bound

# tofino mode keeps packet counts high for small buffers: 64 lanes, the last 2 check words
# (docs/protocol.md 3.6), so 62 elements per packet
LANES = data_lanes(64, Dtype.FIXED32)


def _float_inputs(n, numel, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(numel) * 10.0 ** rng.uniform(-4, 4)).astype(np.float32) for _ in range(n)]


def _int_inputs(n, numel, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32) for _ in range(n)]


def _check_float_sum(results, xs, lanes=LANES):
    n = len(xs)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    exps = np.max([chunk_exponents(x, lanes) for x in xs], axis=0) if xs[0].size else np.zeros(0, np.int32)
    for r in results:
        assert r.shape == exact.shape and r.dtype == np.float32
        if r.size:
            bound = error_bound(r, exps, lanes, n)
            err = np.abs(r.astype(np.float64) - exact)
            assert (err <= bound).all(), f"worst error {err.max()} vs bound {bound[err.argmax()]}"


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("numel", [0, 1, LANES - 1, LANES, LANES + 1, 5 * LANES + 17])
def test_int32_sum_is_bit_exact(n, numel):
    xs = _int_inputs(n, numel, seed=numel + n)
    expected = xs[0].copy()
    for x in xs[1:]:
        expected += x  # numpy int32 addition wraps, like the switch
    with star(n) as (_, _, engines):
        results = [h.wait(60) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]
    for r in results:
        np.testing.assert_array_equal(r, expected)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_float32_sum_within_bound(n):
    xs = _float_inputs(n, 3 * LANES + 5, seed=n)
    xs[0][:LANES] = 0  # an all-zero chunk for worker 0 only
    with star(n) as (_, _, engines):
        results = [h.wait(60) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]
    _check_float_sum(results, xs)


def test_avg_max_min():
    xs = _float_inputs(3, 200, seed=5)
    ints = _int_inputs(3, 200, seed=6)
    with star(3) as (_, _, engines):
        avg = [h.wait(60) for h in [e.allreduce(x, "avg") for e, x in zip(engines, xs)]]
        mx = [h.wait(60) for h in [e.allreduce(x, "max") for e, x in zip(engines, xs)]]
        mn = [h.wait(60) for h in [e.allreduce(x, "min") for e, x in zip(engines, xs)]]
        imx = [h.wait(60) for h in [e.allreduce(x, "max") for e, x in zip(engines, ints)]]
        imn = [h.wait(60) for h in [e.allreduce(x, "min") for e, x in zip(engines, ints)]]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0) / 3
    for r in avg:
        np.testing.assert_allclose(r, exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())
    for r in mx:
        np.testing.assert_array_equal(r, np.max(xs, axis=0))
    for r in mn:
        np.testing.assert_array_equal(r, np.min(xs, axis=0))
    for r in imx:
        np.testing.assert_array_equal(r, np.max(ints, axis=0))
    for r in imn:
        np.testing.assert_array_equal(r, np.min(ints, axis=0))


def test_many_ops_in_flight_keep_their_order():
    """Ops submitted back to back (as DDP buckets are) share the sequence space without mixing."""
    n, ops = 3, 12
    data = [[_int_inputs(1, 50 + 37 * k, seed=100 * r + k)[0] for k in range(ops)] for r in range(n)]
    with star(n, data_pool=16) as (_, _, engines):
        handles = [[e.allreduce(data[r][k]) for k in range(ops)] for r, e in enumerate(engines)]
        results = [[h.wait(60) for h in hs] for hs in handles]
    for k in range(ops):
        expected = data[0][k].copy()
        for r in range(1, n):
            expected += data[r][k]
        for r in range(n):
            np.testing.assert_array_equal(results[r][k], expected)


@pytest.mark.parametrize("loss", [0.01, 0.05, 0.10])
def test_exact_under_loss_duplication_and_reordering(loss):
    n = 4
    drop = {"ingress": loss, "egress": loss, "duplicate": 0.02, "reorder": 0.02}
    ints = _int_inputs(n, 40 * LANES + 3, seed=11)
    floats = _float_inputs(n, 25 * LANES + 9, seed=12)
    expected = ints[0].copy()
    for x in ints[1:]:
        expected += x
    with star(n, drop=drop, seed=int(loss * 1000), data_pool=32) as (_, sw, engines):
        ri = [h.wait(120) for h in [e.allreduce(x) for e, x in zip(engines, ints)]]
        rf = [h.wait(120) for h in [e.allreduce(x) for e, x in zip(engines, floats)]]
        counters = sw.counters()
        stats = [e.session_stats() for e in engines]
    for r in ri:
        np.testing.assert_array_equal(r, expected)
    _check_float_sum(rf, floats)
    from luwu.dataplane.protocol import DropReason

    assert counters["drops"].get(int(DropReason.SIMULATED_LOSS), (0, 0))[0] > 0, "the drop simulator dropped nothing"
    went_back = sum(s["session 2"]["send_stream"]["timeouts"] + s["session 2"]["send_stream"]["fast_retransmits"]
                    for s in stats)
    assert went_back > 0, "no sender ever went back N"


def test_64_mib_buffers_sum_exactly():
    """The largest size of the acceptance: 64 MiB per worker (16 Mi int32), jumbo packets."""
    n, numel = 2, (64 << 20) // 4
    xs = _int_inputs(n, numel, seed=64)
    expected = xs[0] + xs[1]
    with star(n, mode="jumbo") as (_, _, engines):
        results = [h.wait(300) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]
    for r in results:
        np.testing.assert_array_equal(r, expected)


@pytest.mark.parametrize("numel", [0, 1, 3 * LANES, 5 * LANES + 17])
def test_out_gets_the_new_arrays_bits_also_in_place(numel):
    """allreduce(out=y) decodes into y (whole chunks straight, a short last chunk through a
    scratch row) the very bits of the default new array, and out=x works in place."""
    xs = _float_inputs(3, numel, seed=numel)
    if numel > LANES:
        xs[1][-1] = np.inf  # a saturated chunk (NaN), in the short last chunk when there is one
    ints = _int_inputs(3, numel, seed=numel + 1)
    cases = [(xs, op) for op in ("sum", "avg", "max", "min")] + [(ints, op) for op in ("sum", "max", "min")]
    with star(3) as (_, _, engines):
        for inputs, op in cases:
            fresh = [h.wait(60) for h in [e.allreduce(x, op) for e, x in zip(engines, inputs)]]
            outs = [np.full_like(x, 7) for x in inputs]
            hs = [e.allreduce(x, op, out=y) for e, x, y in zip(engines, inputs, outs)]
            assert all(h.wait(60) is y for h, y in zip(hs, outs))
            mine = [x.copy() for x in inputs]
            hs = [e.allreduce(x, op, out=x) for e, x in zip(engines, mine)]
            assert all(h.wait(60) is x for h, x in zip(hs, mine))
            for a, b, c in zip(fresh, outs, mine):
                assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist() == c.view(np.uint32).tolist(), op
        with pytest.raises(ValueError, match="out= must be"):
            engines[0].allreduce(xs[0], "sum", out=np.empty(numel + 1, np.float32))
