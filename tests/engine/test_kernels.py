"""The fixed-point fast paths, bit for bit against their references (dataplane/quantize.py).

* Scaling by a power of two with float32 multiplies (`scale_pow2`) is exactly `np.ldexp`, for
  every shift the protocol can produce, on any float32 (subnormals, inf, NaN included).
* The numpy `quantize` is exactly the ldexp formulation it replaced (kept here as the oracle).
* The numba kernels (dataplane/kernels/fixed_point.py) write the same packet bytes and saturated
  flags as the numpy path (`LUWU_KERNELS=reference`), decode the same float32 bits, and find the
  same per-chunk maxima (hence exponents).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.dataplane import quantize as Q
from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.kernels import use_numba
from luwu.dataplane.protocol import Dtype

HEADER = 32  # a packet row: some header bytes, then the lanes (word-aligned, as in the engine)
SPECIAL_BITS = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x00000001, 0x80000001, 0x007FFFFF,
                0x7F7FFFFF, 0xFF7FFFFF, 0x00000000, 0x80000000, 0x3F000000, 0x3FC00000, 0xBFC00000]


def _float32s(min_size: int = 0, max_size: int = 200):
    """float32 arrays drawn as raw bits (every class of value), mixed with ties and specials."""
    word = st.one_of(st.integers(0, 0xFFFFFFFF), st.sampled_from(SPECIAL_BITS))
    return st.lists(word, min_size=min_size, max_size=max_size).map(
        lambda ws: np.array(ws, dtype=np.uint32).view(np.float32))


def _ldexp_quantize(x, exps, lanes, n):
    """The formulation before the fast path: np.ldexp per element (the oracle)."""
    c = Q.contributor_bits(n)
    lim = float(2 ** (31 - c) - 1)
    chunks = Q.num_chunks(x.size, lanes)
    padded = np.zeros(chunks * lanes, dtype=np.float32)
    padded[: x.size] = x
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.ldexp(padded.reshape(chunks, lanes), (31 - c - exps.astype(np.int32))[:, None])
        np.rint(scaled, out=scaled)
        bad = ~(np.abs(scaled) <= lim)
    saturated = bad.any(axis=1)
    if saturated.any():
        scaled[np.isnan(scaled)] = 0
        np.clip(scaled, -lim, lim, out=scaled)
    with np.errstate(invalid="ignore"):  # n = 1 clips to 2^31 (lim rounds up in float32): wraps, as before
        return scaled.astype(np.int32).reshape(-1), saturated


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@settings(max_examples=300, deadline=None)
@given(_float32s(1, 64), st.integers(-159, 159))
def test_scale_pow2_is_ldexp(x, k):
    got = x.copy().reshape(1, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        Q.scale_pow2(got, np.array([k]))
        want = np.ldexp(x, np.int32(k)).reshape(1, -1)
    assert _same_bits(got, want), (k, x[~(got.view(np.uint32) == want.view(np.uint32))[0]])


def _case():
    """(x, agreed exponents, lanes, n): exponents are either the buffer's own (the normal case),
    raised (another worker had larger values) or lowered (forces saturation)."""
    return st.tuples(_float32s(1, 120), st.integers(1, 24), st.integers(1, 32), st.integers(-3, 3), st.data())


def _exps(x, lanes, bump, data):
    own = Q.chunk_exponents(x, lanes).astype(np.int64)
    extra = data.draw(st.lists(st.integers(0, abs(bump)), min_size=own.size, max_size=own.size))
    e = own + np.sign(bump) * np.array(extra, dtype=np.int64)
    return np.clip(e, Q.EXP_MIN, Q.EXP_MAX).astype(np.int32)


@settings(max_examples=300, deadline=None)
@given(_case())
def test_quantize_is_the_ldexp_formulation(case):
    x, lanes, n, bump, data = case
    exps = _exps(x, lanes, bump, data)
    with np.errstate(over="ignore", invalid="ignore"):
        q, sat = Q.quantize(x, exps, lanes, n)
    q0, sat0 = _ldexp_quantize(x, exps, lanes, n)
    assert np.array_equal(q, q0) and np.array_equal(sat, sat0)


def _rows_for(chunks: int, lanes: int) -> np.ndarray:
    return np.full((chunks, HEADER + 4 * lanes + 8), 0xA5, dtype=np.uint8)  # garbage the fill must overwrite


@settings(max_examples=300, deadline=None)
@given(case=_case())
def test_quantize_into_rows_kernel_matches_reference(case, monkeypatch_module):
    x, lanes, n, bump, data = case
    exps = _exps(x, lanes, bump, data)
    chunks = exps.size
    out = {}
    for mode in ("reference", "numba"):
        monkeypatch_module.setenv("LUWU_KERNELS", mode)
        rows = _rows_for(chunks, lanes)
        with np.errstate(over="ignore", invalid="ignore"):
            sat = Q.quantize_into_rows(x, exps, lanes, n, rows, HEADER)
        out[mode] = (rows, sat)
        if mode == "numba":  # the per-buffer factors a caller may pass give the same packets
            rows_f = _rows_for(chunks, lanes)
            with np.errstate(over="ignore", invalid="ignore"):
                sat_f = Q.quantize_into_rows(x, exps, lanes, n, rows_f, HEADER, Q.quantize_factors(exps, n))
            assert np.array_equal(rows_f, rows) and np.array_equal(sat_f, sat)
    (r0, s0), (r1, s1) = out["reference"], out["numba"]
    assert np.array_equal(r0, r1) and np.array_equal(s0, s1)
    q, sat = _ldexp_quantize(x, exps, lanes, n)  # and both are the packets of the oracle's values
    assert np.array_equal(r1[:, HEADER:HEADER + 4 * lanes].view(">i4").reshape(-1), q)
    assert np.array_equal(s1, sat)


@settings(max_examples=300, deadline=None)
@given(lanes=st.integers(1, 24), k=st.integers(1, 12), data=st.data())
def test_dequantize_rows_kernel_matches_reference(lanes, k, data, monkeypatch_module):
    words = data.draw(st.lists(st.one_of(st.integers(0, 0xFFFFFFFF), st.sampled_from([0, 1, 0x7FFFFFFF, 0x80000000])),
                               min_size=k * lanes, max_size=k * lanes))
    rows = _rows_for(k, lanes)
    rows[:, HEADER:HEADER + 4 * lanes].view(">u4")[...] = np.array(words, dtype=np.uint32).reshape(k, lanes)
    sel = np.array(data.draw(st.permutations(range(k))), dtype=np.int64)
    chunk = np.arange(k, dtype=np.int64)
    shift = np.array(data.draw(st.lists(st.integers(-160, 101), min_size=k, max_size=k)), dtype=np.int64)
    outs = {}
    for mode in ("reference", "numba"):
        monkeypatch_module.setenv("LUWU_KERNELS", mode)
        out = np.full((k, lanes), np.float32(7), dtype=np.float32)
        Q.dequantize_rows_into(rows, sel, HEADER, lanes, shift, chunk, out)
        outs[mode] = out
    assert _same_bits(outs["reference"], outs["numba"])
    lanes_of = rows[sel, HEADER:HEADER + 4 * lanes].view(">i4").astype(np.float32)
    with np.errstate(over="ignore"):
        want = np.ldexp(lanes_of, shift[:, None].astype(np.int32))
    assert _same_bits(outs["numba"], want)


@settings(max_examples=300, deadline=None)
@given(x=_float32s(1, 200), lanes=st.integers(1, 24))
def test_chunk_absmax_kernel_matches_reference(x, lanes, monkeypatch_module):
    got = {}
    for mode in ("reference", "numba"):
        monkeypatch_module.setenv("LUWU_KERNELS", mode)
        got[mode] = (Q._chunked_absmax(x, lanes), Q.chunk_exponents(x, lanes))
    (a0, e0), (a1, e1) = got["reference"], got["numba"]
    nan = np.isnan(a0)
    assert np.array_equal(nan, np.isnan(a1)) and _same_bits(a0[~nan], a1[~nan])  # NaN: any NaN
    assert np.array_equal(e0, e1)


@pytest.mark.skipif(not use_numba(), reason="numba is not installed: only the reference path exists")
@pytest.mark.parametrize("epp,numel,c0,n", [(8, 40, 0, 5), (8, 37, 0, 5), (8, 37, 3, 2), (6, 1, 0, 1), (4, 9, 2, 1)])
def test_bf16_widen_kernel_matches_the_reference(epp, numel, c0, n, monkeypatch):
    """A pull's bf16 PARAM rows widened into a float32 buffer (node_worker._decode_run): the
    compiled pass writes exactly the reference's bits, the short last packet stopping at numel,
    and nothing outside the packets' chunks."""
    from luwu.dataplane.engine.node_worker import PullBuffer, _decode_run, wire_dtype
    from luwu.dataplane.protocol import Dtype

    rng = np.random.default_rng(epp * 1000 + numel)
    rows = rng.integers(0, 256, size=(n + 3, HEADER + 2 * epp + 4), dtype=np.uint8)
    got = {}
    for mode in ("reference", "numba"):
        monkeypatch.setenv("LUWU_KERNELS", mode)
        out = np.full(numel, 7.5, dtype=np.float32)
        _decode_run(PullBuffer(1, numel, Dtype.BF16, out, direct=True), rows, 2, c0, n, wire_dtype(Dtype.BF16), epp)
        got[mode] = out.view(np.uint32).copy()
    assert np.array_equal(got["numba"], got["reference"])
    lo, hi = c0 * epp, min(numel, (c0 + n) * epp)
    assert np.all(got["reference"][:lo] == np.float32(7.5).view(np.uint32))  # untouched outside the run
    assert np.all(got["reference"][hi:] == np.float32(7.5).view(np.uint32))
    first = rows[2, HEADER:HEADER + 2].tolist()  # the first value: big-endian bf16 -> a float32's top half
    assert got["reference"][lo] == (first[0] << 24) | (first[1] << 16)


@pytest.mark.parametrize("lanes", [1, 3, 64])
def test_chunk_exponents_kernel_every_exponent_class(lanes, monkeypatch):
    """The compiled exponents are read off the bits: every biased exponent (zero, subnormals,
    normals, the largest, inf/NaN), both signs, against the numpy (frexp) reference."""
    biased = np.arange(256, dtype=np.uint32)[:, None] << 23
    mant = np.array([0, 1, 2, 0x400000, 0x7FFFFF, 12345], dtype=np.uint32)[None, :]
    words = (biased | mant).reshape(-1)
    x = np.concatenate([words, words | 0x80000000]).view(np.float32)
    got = {}
    for mode in ("reference", "numba"):
        monkeypatch.setenv("LUWU_KERNELS", mode)
        got[mode] = Q.chunk_exponents(x, lanes)
    assert got["numba"].dtype == got["reference"].dtype == np.int32
    assert np.array_equal(got["numba"], got["reference"])
    if lanes == 1:  # one value a chunk: zero, the smallest subnormals and the largest normals reach both clips
        assert got["reference"].min() == Q.EXP_MIN and got["reference"].max() == Q.EXP_MAX


def test_kernel_mode_switch(monkeypatch):
    """LUWU_KERNELS picks the path; a typo is a clear error, not a silent fallback."""
    monkeypatch.setenv("LUWU_KERNELS", "reference")
    assert not use_numba()
    monkeypatch.setenv("LUWU_KERNELS", "numba")
    assert use_numba()
    monkeypatch.setenv("LUWU_KERNELS", "fast")
    with pytest.raises(Exception, match="LUWU_KERNELS"):
        use_numba()


@pytest.fixture(scope="module")
def monkeypatch_module():
    """hypothesis runs many examples per test function: one monkeypatch for them all."""
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("mode", ["tofino", "loopback"])
def test_allreduce_through_the_switch_is_the_same_with_either_path(monkeypatch, mode):
    """End to end, real engines and switch: the compiled and the reference datapath give the
    same bits, including a chunk with inf (saturated: NaN, never a clipped number) and a ragged
    last chunk."""
    from luwu.dataplane.loopback import local_star

    rng = np.random.default_rng(5)
    with local_star(3, mode=mode) as (plan, _, engines):
        d = data_lanes(plan.lanes, Dtype.FIXED32)  # elements per packet: its last lanes are check words
        numel = 3 * d + 17
        xs = [(rng.standard_normal(numel) * 10.0 ** rng.uniform(-30, 30)).astype(np.float32) for _ in engines]
        xs[1][d + 2] = np.inf
        got = {}
        for kernels in ("reference", "numba"):
            monkeypatch.setenv("LUWU_KERNELS", kernels)
            handles = [e.allreduce(x) for e, x in zip(engines, xs)]
            got[kernels] = [h.wait(60) for h in handles]
            assert all(h.saturated for h in handles)
        for a, b in zip(got["reference"], got["numba"]):
            assert _same_bits(a, b)
        assert np.isnan(got["numba"][0][d:2 * d]).all()
        assert np.isfinite(got["numba"][0][:d]).all() and np.isfinite(got["numba"][0][2 * d:]).all()


@pytest.mark.parametrize("n", [2, 5])
def test_row_decoding_matches_the_readable_dequantize(n, monkeypatch):
    """The engine's and the node's decode of packet rows (dequantize_rows_into with sum_shift) is
    quantize.dequantize, the reference, bit for bit: one formula for the scale, in both modes."""
    rng = np.random.default_rng(n)
    lanes, k = 16, 6
    x = (rng.standard_normal(k * lanes) * 2.0 ** rng.integers(-20, 20, k * lanes)).astype(np.float32)
    exps = Q.chunk_exponents(x, lanes)
    q, _ = Q.quantize(x, exps, lanes, n)
    want = Q.dequantize(q, exps, lanes, n, x.size)
    rows = _rows_for(k, lanes)
    rows[:, HEADER:HEADER + 4 * lanes].view(">i4")[...] = q.reshape(k, lanes)
    for mode in ("reference", "numba"):
        monkeypatch.setenv("LUWU_KERNELS", mode)
        out = np.zeros((k, lanes), dtype=np.float32)
        Q.dequantize_rows_into(rows, np.arange(k), HEADER, lanes, Q.sum_shift(exps, n), np.arange(k), out)
        assert _same_bits(out.reshape(-1), want), mode


@pytest.mark.skipif(not use_numba(), reason="numba is not installed: only the reference path exists")
@pytest.mark.parametrize("numel", [0, 1, 7, 4099])
def test_staged_bf16_widen_kernel_matches_the_reference(numel):
    """A staged pull's bf16 values widened into its float32 output (node_worker._complete): the
    compiled pass writes exactly the reference's bits, every uint16 pattern included."""
    from luwu.dataplane.engine.node_worker import widen_staged_bf16

    rng = np.random.default_rng(numel)
    data = rng.integers(0, 1 << 16, size=numel, dtype=np.uint16)
    data[:min(numel, 4)] = np.array([0, 0xFFFF, 0x7F80, 0x8001], dtype=np.uint16)[:min(numel, 4)]
    got = {}
    for compiled in (False, True):
        out = np.full(numel, 7.5, dtype=np.float32)
        widen_staged_bf16(data, out.view(np.uint32), compiled)
        got[compiled] = out.view(np.uint32).copy()
    assert np.array_equal(got[True], got[False])
    assert np.array_equal(got[False], data.astype(np.uint32) << 16)
