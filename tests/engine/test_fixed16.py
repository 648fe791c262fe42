"""FIXED16 (docs/protocol.md 5.2): the quantiser's bound, the packet codec against integrity.py's
reference check words, and the compiled kernels bit for bit against the numpy reference.

* `quantize16`/`dequantize16`: a sum of n quantised contributions decodes within `error_bound16`
  of the exact sum; saturation is flagged exactly for non-finite values and |x| >= 2^e.
* `fixed16.encode_rows` writes exponent slots, data, padding and the check words that
  `integrity.check_words` gives, two int16 slots per int32 lane; the switch's plain int32 lane sum
  of n such packets passes `decode_rows`, any single corrupted byte fails it.
* numba (`LUWU_KERNELS=numba`) and the reference (`LUWU_KERNELS=reference`) write the same bytes and
  decode the same bits and verdicts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.dataplane import fixed16, integrity
from luwu.dataplane import quantize as Q
from luwu.dataplane.engine import EngineConfig
from luwu.dataplane.integrity import FIXED16_BLOCK as B
from luwu.dataplane.kernels import numba_available
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.process.usage import UserError
from luwu.dataplane.protocol import DATA_HEADER, HEADER_LEN, Dtype, Flag, MsgType, header_view, ver_type

LANES = (2 * (B + 1) + 8 + 6) // 2  # two blocks per packet and 6 slots of padding before the checks
SLOTS = 2 * LANES
SPECIAL_BITS = [0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x80000001, 0x7F7FFFFF, 0x00000000, 0x3F800000]


def _float32s(min_size=1, max_size=200):
    word = st.one_of(st.integers(0, 0xFFFFFFFF), st.sampled_from(SPECIAL_BITS))
    return st.lists(word, min_size=min_size, max_size=max_size).map(
        lambda ws: np.array(ws, dtype=np.uint32).view(np.float32))


def _headers(k, i0, numel, msg_type=MsgType.ALLREDUCE, flags=0, lanes=LANES, session=7, tensor=3, seq0=100):
    _nb, data = fixed16.layout(lanes)
    rows = np.zeros((k, HEADER_LEN + 4 * lanes), dtype=np.uint8)
    h = header_view(rows)
    p = np.arange(i0, i0 + k)
    h["ver_type"] = ver_type(msg_type)
    h["flags"] = flags
    h["session"] = session
    h["worker"] = 1
    h["count"] = np.clip(numel - p * data, 0, data)
    h["seq"] = seq0 + p
    h["slot"] = 5 + p
    h["tensor"] = tensor
    h["offset"] = p * data
    h["dtype"] = int(Dtype.FIXED16)
    h["numel"] = numel
    return rows


def _hdict(row):
    h = row[:HEADER_LEN].copy().view(DATA_HEADER)[0]
    d = {name: int(h[name]) for name in DATA_HEADER.names if name not in ("ver_type",)}
    d["type"] = int(h["ver_type"]) & 0xF
    return d


def _lanes(row, lanes=LANES):
    """The int16 slots of a packet row (its int32 lanes unpacked)."""
    return fixed16.unpack_slots(row[HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4")[None])[0]


def test_pack_slots_sums_exactly():
    """Packed lanes sum as int32 to the packed slot sums, and unpack to them, whenever each slot's
    sum fits int16: the property the switch's plain int32 sum relies on."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 255):
        lim = (2**15 - 1) // n
        slots = rng.integers(-lim, lim + 1, (n, 64))
        slots[0, :4] = [lim, -lim, -1, 0]
        packed = np.stack([fixed16.pack_slots(s[None])[0] for s in slots]).astype(np.int64)
        total = (packed.sum(axis=0) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
        assert fixed16.unpack_slots(total[None])[0].tolist() == slots.sum(axis=0).tolist()
        assert np.array_equal(fixed16.pack_slots(slots.sum(axis=0)[None])[0], total)


@pytest.fixture(params=["reference", "numba"])
def kernels(request, monkeypatch):
    monkeypatch.setenv("LUWU_KERNELS", request.param)
    if request.param == "numba" and not numba_available():
        pytest.skip("numba is not installed")
    return request.param


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 150), st.floats(-30, 30), st.data())
def test_sum_within_bound(n, numel, log_scale, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs = [(rng.standard_normal(numel) * 2.0 ** log_scale).astype(np.float32) for _ in range(n)]
    xs[0][rng.integers(0, numel)] = 0  # zero blocks and zeros inside blocks
    exps = np.max([Q.block_exponents(x, B) for x in xs], axis=0)
    qs = []
    for x in xs:
        q, sat = Q.quantize16(x, exps, B, n)
        assert not sat.any()
        qs.append(q.astype(np.int64))
    total = np.sum(qs, axis=0)
    assert np.abs(total).max() <= 2**15 - 1  # the headroom: the sum fits int16
    got = Q.dequantize16(total, exps, B, n, numel)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert (np.abs(got.astype(np.float64) - exact) <= Q.error_bound16(got, exps, B, n)).all()


def test_saturation_exactly_for_nonfinite_and_out_of_range():
    x = np.array([1.0, -0.5, np.inf, 0.25] + [0.0] * (B - 4) + [3.0, np.nan] + [0.0] * (B - 2)
                 + [0.999999] * B, dtype=np.float32)
    exps = np.array([1, 2, 0], dtype=np.int32)  # block 0: 1.0 < 2^1 fits, inf does not; block 2: 0.999999 < 2^0
    q, sat = Q.quantize16(x, exps, B, 2)
    assert sat.tolist() == [True, True, False]
    assert q[2] == 2**14 - 1 and q[B + 1] == 0  # inf clipped, NaN -> 0
    assert q[2 * B] == 2**14 - 1  # rounds up to 2^14: clipped to the limit, not flagged (one quantum of error)
    x2 = np.full(B, 2.0, dtype=np.float32)
    assert Q.quantize16(x2, np.array([1]), B, 2)[1].tolist() == [True]  # |x| >= 2^e


def test_too_many_contributors_is_a_named_error():
    with pytest.raises(ValueError, match="fixed32"):
        Q.quantize16(np.ones(3, np.float32), np.array([1]), B, 256)


def test_header_and_exponent_terms_match_integrity(kernels):
    rows = _headers(3, 4, 500, flags=int(Flag.SET) | int(Flag.SATURATED))
    rows[1, 0] = ver_type(MsgType.RESULT)
    rows[2, 0] = ver_type(MsgType.GRAD)
    got = fixed16.header_terms(rows)
    for r in range(3):
        assert got[r].tolist() == integrity.header_term(_hdict(rows[r]), Dtype.FIXED16).tolist()
    # any header bytes (every type, flag and exponent), a few rows and many, whole packet rows or
    # just their headers: what integrity.header_terms gives for FIXED16
    rng = np.random.default_rng(11)
    wide = rng.integers(0, 256, (40, HEADER_LEN + 8), dtype=np.uint8)
    wide[:16, 0] = (wide[:16, 0] & 0xF0) | np.arange(16)
    for part in (wide, wide[:5], wide[:, :HEADER_LEN], wide[7:8]):
        h = np.ascontiguousarray(part[:, :HEADER_LEN]).view(DATA_HEADER).reshape(-1)
        assert fixed16.header_terms(part).tolist() == integrity.header_terms(h, Dtype.FIXED16).tolist()
    e = np.array([[-128, 0, 5, 127], [3, -7, 0, 0]])
    terms = fixed16.exponent_terms(e)
    for r in range(2):
        assert terms[r].tolist() == [integrity.exponent_term(e[r], j) for j in range(4)]


def _encode(x, exps, n, i0, k, lanes=LANES, **hdr):
    rows = _headers(k, i0, x.size, lanes=lanes, **hdr)
    sat = fixed16.encode_rows(x, exps, n, lanes, rows, i0)
    return rows, sat


def test_encode_matches_integrity_check_words(kernels):
    nb, data = fixed16.layout(LANES)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(2 * data + 40) * 1e-3).astype(np.float32)
    exps = Q.block_exponents(x, B) + 1
    rows, sat = _encode(x, exps, 3, 0, 3)
    assert not sat.any()
    for r in range(3):
        lane = _lanes(rows[r])
        e = np.zeros(nb, dtype=np.int64)
        blocks = exps[r * nb:(r + 1) * nb]
        e[:blocks.size] = blocks
        assert lane[:nb].tolist() == e.tolist()
        assert (lane[nb + data:SLOTS - 8] == 0).all()  # padding
        q, _ = Q.quantize16(x[r * data:(r + 1) * data], blocks, B, 3)
        assert lane[nb:nb + q.size].tolist() == q.tolist()
        want = integrity.check_words(lane[:SLOTS - 8], _hdict(rows[r]), Dtype.FIXED16, 1, e)
        assert (lane[SLOTS - 8::2] & 0xFFFF).tolist() == want.tolist()  # high halves of the last 4 lanes
        assert (lane[SLOTS - 7::2] == 0).all()


@settings(max_examples=150, deadline=None)
@given(_float32s(1, 3 * 2 * B), st.integers(1, 20), st.integers(-2, 2))
def test_encode_numba_is_reference(x, n, bump):
    if not numba_available():
        pytest.skip("numba is not installed")
    exps = np.clip(Q.block_exponents(x, B) + bump, Q.EXP_MIN, Q.EXP_MAX).astype(np.int32)
    k = fixed16.packets(x.size, LANES)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for mode in ("reference", "numba"):
            mp.setenv("LUWU_KERNELS", mode)
            out[mode] = _encode(x, exps, n, 0, k)
            if k > 1:  # a later block of the same buffer, alone
                out[mode + "1"] = _encode(x, exps, n, 1, k - 1)
    for a, b in (("reference", "numba"), ("reference1", "numba1")):
        if a in out:
            assert np.array_equal(out[a][0], out[b][0])
            assert out[a][1].tolist() == out[b][1].tolist()


def _switch_sum(contribs, lanes=LANES):
    """The switch's aggregation, FIXED16 as any dtype: int32 lanes summed, wrapping; the first
    contribution's header turned into a RESULT."""
    res = contribs[0].copy()
    total = np.sum([r[HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4").astype(np.int64) for r in contribs], axis=0)
    res[HEADER_LEN:HEADER_LEN + 4 * lanes].view(">u4")[...] = total & 0xFFFFFFFF
    res[0] = ver_type(MsgType.RESULT)
    return res


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3 * 2 * B), st.data())
def test_sum_of_packets_verifies_and_decodes(n, numel, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    xs = [(rng.standard_normal(numel) * 10.0 ** rng.uniform(-5, 5, numel)).astype(np.float32) for _ in range(n)]
    exps = np.max([Q.block_exponents(x, B) for x in xs], axis=0).astype(np.int32)
    k = fixed16.packets(numel, LANES)
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        for mode in ("reference", "numba"):
            mp.setenv("LUWU_KERNELS", mode)
            if mode == "numba" and not numba_available():
                continue
            enc = [_encode(x, exps, n, 0, k, flags=int(Flag.SET))[0] for x in xs]
            rows = np.stack([_switch_sum([e[p] for e in enc]) for p in range(k)])
            out = np.full(numel, np.nan, dtype=np.float32)
            ok = fixed16.decode_rows(rows, np.arange(k), LANES, n, out)
            assert ok.all()
            results[mode] = out
            # rows verified already (collective.py `_verified`): decoded in one pass, the same bits
            assert fixed16.verify_rows(rows, np.arange(k), LANES, n).all()
            once = np.full(numel, np.nan, dtype=np.float32)
            assert fixed16.decode_rows(rows, np.arange(k), LANES, n, once, checked=True).all()
            assert np.array_equal(once.view(np.uint32), out.view(np.uint32))
            if n > 1:  # an exponent lane that is no multiple of n still fails a checked row
                odd = rows.copy()
                odd[0, HEADER_LEN:HEADER_LEN + 2].view(">i2")[0] += 1
                assert fixed16.decode_rows(odd, np.arange(k), LANES, n, once, checked=True).tolist() == \
                    [False] + [True] * (k - 1)
            # any one bit changed (a data, exponent, padding or check slot, either half) fails that row only
            byte = int(data.draw(st.integers(0, 4 * LANES - 1)))
            bad = rows.copy()
            bad[0, HEADER_LEN + byte] ^= 1 << int(data.draw(st.integers(0, 7)))
            assert fixed16.decode_rows(bad, np.arange(k), LANES, n, out.copy()).tolist() == [False] + [True] * (k - 1)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    ref = results["reference"]
    assert (np.abs(ref.astype(np.float64) - exact) <= Q.error_bound16(ref, exps, B, n)).all()
    if "numba" in results:
        assert np.array_equal(ref.view(np.uint32), results["numba"].view(np.uint32))


def test_a_contributor_with_other_exponents_fails_the_check(kernels):
    _nb, data = fixed16.layout(LANES)
    x = np.linspace(-1, 1, data).astype(np.float32)
    e = Q.block_exponents(x, B)
    a = _encode(x, e, 2, 0, 1)[0][0]
    # the exponent lanes still sum to a multiple of 2 (e-1 + e+1), the data quantised accordingly
    e2 = e.copy()
    e2[0] += 1
    e3 = e.copy()
    e3[0] -= 1
    b = _encode(x, e2, 2, 0, 1)[0][0]
    c = _encode(x, e3, 2, 0, 1)[0][0]
    assert fixed16.decode_rows(_switch_sum([a, a])[None], np.arange(1), LANES, 2, np.zeros(data, np.float32)).all()
    assert not fixed16.decode_rows(_switch_sum([b, c])[None], np.arange(1), LANES, 2, np.zeros(data, np.float32)).any()


def test_loopback_layout_bytes_per_param():
    nb, data = fixed16.layout(16000)
    assert (nb, data) == (283, 31696)
    assert (fixed16.row_len(16000) + 42) / data < 2.1  # luwu header + UDP/IP/Ethernet


def test_unknown_format_is_a_user_error(monkeypatch):
    with star(1, mode=300) as (_, _, engines), pytest.raises(UserError, match="fixed16"):
        engines[0].allreduce(np.ones(3, np.float32), grad_format="fp8")
    monkeypatch.setenv("LUWU_GRAD_FORMAT", "fixed16")
    assert EngineConfig().grad_format == "fixed16"
    monkeypatch.setenv("LUWU_GRAD_FORMAT", "int4")
    with pytest.raises(UserError, match="LUWU_GRAD_FORMAT"):
        EngineConfig()


def test_agreement_lanes_max_is_the_max_and_self_checking():
    """The exponent agreement: a lane-wise int32 MAX of packed lanes is the packed MAX; the check lanes
    are T_j << 16 (equal on every contributor, so the max keeps them); a wrong tag or check fails."""
    lanes = LANES
    per = fixed16.agreement_lanes(lanes)
    rng = np.random.default_rng(3)
    es = [rng.integers(Q.EXP_MIN, Q.EXP_MAX + 1, 2 * per + 5) for _ in range(3)]
    k = 3
    rows = []
    for e in es:
        r = _headers(k, 0, e.size, flags=int(Flag.MAX) | int(Flag.SET), lanes=lanes)
        fixed16.encode_agreement_rows(e, lanes, r, 0)
        rows.append(r)
    res = rows[0].copy()
    lane = np.max([r[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4") for r in rows], axis=0)
    res[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4")[...] = lane
    res[:, 0] = ver_type(MsgType.RESULT)
    for r in range(k):  # the check lanes are integrity's check words of a MAX packet
        h = _hdict(res[r])
        want = integrity.check_words(np.zeros(2 * lanes - 8), h, Dtype.FIXED16)
        got = res[r, HEADER_LEN + 4 * per:HEADER_LEN + 4 * lanes].view(">u4")
        assert got.tolist() == [int(w) << 16 for w in want]
    out = np.zeros(es[0].size, np.int32)
    assert fixed16.decode_agreement_rows(res, np.arange(k), lanes, np.arange(k), out)
    np.testing.assert_array_equal(out, np.max(es, axis=0))
    for byte in (HEADER_LEN + 3, HEADER_LEN + 4 * (lanes - 1)):  # a tag bit, a check lane
        bad = res.copy()
        bad[0, byte] ^= 0x04
        assert not fixed16.decode_agreement_rows(bad, np.arange(k), lanes, np.arange(k), out.copy())


def test_verify_rows_accepts_sums_and_agreements_and_rejects_corruption():
    """`verify_rows` (the receive path's check before decoding): a sum of n packets and a short
    agreement packet (padding lanes are zeros, not tagged) pass; one changed lane fails."""
    nb, data = fixed16.layout(LANES)
    xs = [np.linspace(-1, 1, data + 3).astype(np.float32) * (r + 1) for r in range(2)]
    e = np.max([Q.block_exponents(x, B) for x in xs], axis=0)
    k = fixed16.packets(data + 3, LANES)
    enc = [_encode(x, e, 2, 0, k)[0] for x in xs]
    sums = np.stack([_switch_sum([c[p] for c in enc]) for p in range(k)])
    agree = _headers(1, 0, 5, flags=int(Flag.MAX), lanes=LANES)
    fixed16.encode_agreement_rows(np.array([1, -2, 3, 0, 127]), LANES, agree, 0)
    rows = np.concatenate([sums, agree])
    assert fixed16.verify_rows(rows, np.arange(k + 1), LANES, 2).all()
    for row, byte in ((0, HEADER_LEN + 2 * nb + 1), (k, HEADER_LEN + 3)):
        bad = rows.copy()
        bad[row, byte] ^= 0x01
        want = [True] * (k + 1)
        want[row] = False
        assert fixed16.verify_rows(bad, np.arange(k + 1), LANES, 2).tolist() == want


def test_exponent_lane_tables_give_the_computed_bits():
    """The agreement lanes are looked up in a table of the 256 valid lanes (integrity.py); packing and
    unpacking (with its tag verdict) give exactly the bits of computing each lane with exp_tag, for
    every exponent, any lane value, and out-of-range input."""
    rng = np.random.default_rng(5)
    e = np.concatenate([np.arange(-128, 128), rng.integers(-128, 128, 5000)])
    for dtype in (np.int8, np.int32, np.int64):
        assert np.array_equal(integrity.pack_exponents(e.astype(dtype)), integrity._pack32(e))
    wide = rng.integers(-40000, 40000, 500)  # outside the table: computed
    assert np.array_equal(integrity.pack_exponents(wide), integrity._pack32(wide))
    for v32 in (np.concatenate([rng.integers(-2**31, 2**31, 20000), integrity._pack32(e)]).astype(np.int32),
                integrity._pack32(e) ^ 1):  # lanes of exponents past the table, and tags off by a bit
        got_e, got_ok = integrity.unpack_exponents(v32)
        want_e = v32.astype(np.int64) >> 16
        assert np.array_equal(got_e, want_e) and got_e.dtype == np.int32
        assert np.array_equal(got_ok, (v32.astype(np.int64) & 0xFFFF).astype(np.uint32) == integrity.exp_tag(want_e))


def test_a_slot_sum_past_int16_fails_the_check(kernels):
    """Contributors that left no headroom (quantised for n = 1, summed as 2): their slots' sums pass
    int16, so the low halves carry into the high ones and the lanes no longer split into the true
    sums. The check words see the carry; the rows are never decoded as a plausible number."""
    _nb, data = fixed16.layout(LANES)
    x = np.full(2 * data, 0.99, dtype=np.float32)  # every value near the top of its block's range
    e = Q.block_exponents(x, B)
    k = fixed16.packets(x.size, LANES)
    enc = [_encode(x, e, 1, 0, k)[0] for _ in range(2)]
    sums = np.stack([_switch_sum([c[p] for c in enc]) for p in range(k)])
    out = np.full(x.size, np.nan, dtype=np.float32)
    assert not fixed16.decode_rows(sums, np.arange(k), LANES, 2, out).any()
    assert np.isnan(out).all()
    assert not fixed16.verify_rows(sums, np.arange(k), LANES, 2).any()
