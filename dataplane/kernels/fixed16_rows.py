"""numba kernels of the FIXED16 format (docs/protocol.md 5.2; dataplane/fixed16.py is the reference
of each; int16 slots two per 32-bit lane, `hi * 2^16 + lo`, so a writer borrows one from a high
slot whose low slot is negative (`_borrow`) and a reader gives it back (`_unpack_row`)): a buffer's packets quantised into send-ring rows (`quantize16_rows`), received sums
verified and decoded (`dequantize16_rows`), a RESULT batch of a sum verified, decoded and entered
in the window in one call (`absorb_fixed16_results`, the FIXED16 twin of fixed_point.py
`absorb_fixed_results`; dataplane/engine/collective.py `on_results` is its reference), and the
header terms of the check words (`header_terms16`).

Bit for bit the reference's results (tests/engine/test_fixed16.py, test_compiled_results16.py):
uint32 arithmetic where the reference reduces mod 2^32 or 2^16, scaling by exact powers of two,
rint, no fastmath. Rows are passed as flat native uint16 words of a C-contiguous buffer.
Imported only when kernels are on (dataplane/kernels), compiled on first call, cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .fixed_point import _be32

# The check words are sums mod 2^16 of lane * weight, weight = (k+1)^j. Each product and the
# running sums are taken mod 2^32 in uint32 (which vectorises; 64-bit multiplies do not on AVX2) and
# reduced mod 2^16 at the end: the same residues. The weights are computed in the loop ((k+1),
# (k+1)^2, (k+1)^3 mod 2^32: two multiplies) rather than loaded from three tables, in the same pass
# that moves the lanes between the uint32 scratch and the big-endian row.

@njit(cache=True, inline="always")
def _bswap16(v):
    return np.uint16(((v & 0xFF) << 8) | ((v >> 8) & 0xFF))


@njit(cache=True, nogil=True, inline="always")
def _mix(x):
    x ^= x >> np.uint32(15)
    x = np.uint32(x * np.uint32(0x2C1B3C6D))
    return x ^ (x >> np.uint32(13))


@njit(cache=True, nogil=True)
def _exponent_terms(exps, nb):
    """dataplane/integrity.py `exponent_term(exps[:nb], j)` for j = 0..3 (mod 2^16, as uint64), in
    uint32 arithmetic: every step of the reference is taken mod 2^32, so wrapping gives its bits."""
    g0 = np.uint32(0)
    g1 = np.uint32(0)
    g2 = np.uint32(0)
    g3 = np.uint32(0)
    k3 = np.uint32(0xC2B2AE3D)
    for b in range(nb):
        base = np.uint32(np.uint32(b + 1) * np.uint32(0x9E3779B1)
                         + np.uint32(np.int32(exps[b] + 1024)) * np.uint32(0x85EBCA77))
        g0 = np.uint32(g0 + _mix(base))
        g1 = np.uint32(g1 + _mix(np.uint32(base + k3)))
        g2 = np.uint32(g2 + _mix(np.uint32(base + np.uint32(2) * k3)))
        g3 = np.uint32(g3 + _mix(np.uint32(base + np.uint32(3) * k3)))
    m = np.uint32(0xFFFF)
    return np.uint64(g0 & m), np.uint64(g1 & m), np.uint64(g2 & m), np.uint64(g3 & m)


@njit(cache=True, nogil=True, inline="always")
def _store_sums(vals, dst):
    """dst[k] = vals[k]'s low 16 bits big-endian, and (sum v, sum (k+1) v, sum (k+1)^2 v,
    sum (k+1)^3 v) mod 2^32 of the uint32 lane values vals (two's complement), in one pass."""
    s0 = np.uint32(0)
    s1 = np.uint32(0)
    s2 = np.uint32(0)
    s3 = np.uint32(0)
    for k in range(vals.size):
        v = vals[k]
        dst[k] = np.uint16(((v & np.uint32(0xFF)) << np.uint32(8)) | ((v >> np.uint32(8)) & np.uint32(0xFF)))
        a = np.uint32(k + 1)
        b = np.uint32(a * a)
        s0 = np.uint32(s0 + v)
        s1 = np.uint32(s1 + np.uint32(a * v))
        s2 = np.uint32(s2 + np.uint32(b * v))
        s3 = np.uint32(s3 + np.uint32(np.uint32(b * a) * v))
    return s0, s1, s2, s3


@njit(cache=True, nogil=True, inline="always")
def _put_checks(dst, nv, c0, c1, c2, c3):
    """The 4 check words into the high halves of the last 4 lanes (slots nv, nv + 2, ...), low halves 0."""
    dst[nv] = _bswap16(np.uint16(c0 & np.uint64(0xFFFF)))
    dst[nv + 2] = _bswap16(np.uint16(c1 & np.uint64(0xFFFF)))
    dst[nv + 4] = _bswap16(np.uint16(c2 & np.uint64(0xFFFF)))
    dst[nv + 6] = _bswap16(np.uint16(c3 & np.uint64(0xFFFF)))
    dst[nv + 1] = 0
    dst[nv + 3] = 0
    dst[nv + 5] = 0
    dst[nv + 7] = 0


@njit(cache=True, inline="always")
def _bswap32(v):
    return ((v & np.uint32(0xFF)) << np.uint32(24)) | ((v & np.uint32(0xFF00)) << np.uint32(8)) \
        | ((v >> np.uint32(8)) & np.uint32(0xFF00)) | (v >> np.uint32(24))


@njit(cache=True, nogil=True, inline="always")
def _borrow(dst, nv):
    """Slots [0, nv) of a row as written (big-endian int16 values, nv even, 4-byte aligned) made
    packed lanes (fixed16.py `pack_slots`): each lane's big-endian value V less 2^16 where its low
    slot is negative, `V - ((V & 0x8000) << 1)`, one uint32 word at a time (vectorises)."""
    d = dst[:nv].view(np.uint32)
    for k in range(d.size):
        v = _bswap32(d[k])
        d[k] = _bswap32(np.uint32(v - ((v & np.uint32(0x8000)) << np.uint32(1))))


@njit(cache=True, nogil=True, inline="always")
def _unpack_row(src, nv, sc):
    """Slots [0, nv) of a received row of packed lanes (big-endian words `src`) as int16 values
    into `sc` (fixed16.py `unpack_slots`): each lane's value given back the 2^16 its negative low
    slot borrowed, `V + ((V & 0x8000) << 1)`, then split into its two int16 halves."""
    d = src[:nv].view(np.uint32)
    for k in range(d.size):
        v = _bswap32(d[k])
        v = np.uint32(v + ((v & np.uint32(0x8000)) << np.uint32(1)))
        sc[2 * k] = np.int16(np.uint16(v >> np.uint32(16)))
        sc[2 * k + 1] = np.int16(np.uint16(v & np.uint32(0xFFFF)))


@njit(cache=True, nogil=True, inline="always")
def _unpack_sums(src, nv, sc):
    """`_unpack_row` and the check words' sums of its slots in the same pass (as `_store_sums`' on the write side): (sum v, sum (k+1) v,
    sum (k+1)^2 v, sum (k+1)^3 v) mod 2^32 over the unpacked slots v_k."""
    d = src[:nv].view(np.uint32)
    s0 = np.uint32(0)
    s1 = np.uint32(0)
    s2 = np.uint32(0)
    s3 = np.uint32(0)
    for k in range(d.size):
        v = _bswap32(d[k])
        v = np.uint32(v + ((v & np.uint32(0x8000)) << np.uint32(1)))
        hi = np.int32(np.int16(np.uint16(v >> np.uint32(16))))
        lo = np.int32(np.int16(np.uint16(v & np.uint32(0xFFFF))))
        sc[2 * k] = np.int16(hi)
        sc[2 * k + 1] = np.int16(lo)
        uh = np.uint32(hi)
        ul = np.uint32(lo)
        a = np.uint32(2 * k + 1)
        b = np.uint32(a + np.uint32(1))
        a2 = np.uint32(a * a)
        b2 = np.uint32(b * b)
        s0 = np.uint32(s0 + uh + ul)
        s1 = np.uint32(s1 + np.uint32(a * uh) + np.uint32(b * ul))
        s2 = np.uint32(s2 + np.uint32(a2 * uh) + np.uint32(b2 * ul))
        s3 = np.uint32(s3 + np.uint32(np.uint32(a2 * a) * uh) + np.uint32(np.uint32(b2 * b) * ul))
    return s0, s1, s2, s3


@njit(cache=True, nogil=True, inline="always")
def _checks_match(src, nv, nn, t0, t1, t2, t3, c0, c1, c2, c3, g0, g1, g2, g3):
    """A sum of nn's check lanes (slots nv.. of `src`): high halves the expected words, low halves 0."""
    msk = np.uint64(0xFFFF)
    return ((np.uint64(c0) + nn * (np.uint64(t0) + g0)) & msk) == np.uint64(_bswap16(src[nv])) \
        and ((np.uint64(c1) + nn * (np.uint64(t1) + g1)) & msk) == np.uint64(_bswap16(src[nv + 2])) \
        and ((np.uint64(c2) + nn * (np.uint64(t2) + g2)) & msk) == np.uint64(_bswap16(src[nv + 4])) \
        and ((np.uint64(c3) + nn * (np.uint64(t3) + g3)) & msk) == np.uint64(_bswap16(src[nv + 6])) \
        and src[nv + 1] == 0 and src[nv + 3] == 0 and src[nv + 5] == 0 and src[nv + 7] == 0


@njit(cache=True, nogil=True)
def header_terms16(hrows, at, width, mult, dtype, grad, agg, out):
    """dataplane/fixed16.py `header_terms` (integrity.header_terms with FIXED16, the reference):
    out[r, j] = sum_f mult[j, f] * field_f mod 2^32, then mod 2^16, of the uint8 header rows
    `hrows` (K, >= 32). Fields 0..6 are big-endian of `width[f]` bytes at `at[f]` (session, seq,
    slot, tensor, offset, count, numel), then `dtype` (the format's code, not the row's byte),
    flags & (SET | MAX) (at[8], the mask in width[8]), the exponent byte (at[9]) and the stream (1
    when the type at[10] is `grad` or `agg`, else 3). uint32 products and sums wrap mod 2^32, as
    the reference's are reduced."""
    for r in range(hrows.shape[0]):
        row = hrows[r]
        t0 = np.uint32(0)
        t1 = np.uint32(0)
        t2 = np.uint32(0)
        t3 = np.uint32(0)
        for f in range(11):
            if f < 7:
                v = np.uint32(0)
                for q in range(width[f]):
                    v = np.uint32((v << np.uint32(8)) | np.uint32(row[at[f] + q]))
            elif f == 7:
                v = np.uint32(dtype)
            elif f == 9:
                v = np.uint32(row[at[f]])
            elif f == 8:
                v = np.uint32(row[at[f]]) & np.uint32(width[f])
            else:
                ty = row[at[f]] & 0xF
                v = np.uint32(1) if ty in (grad, agg) else np.uint32(3)
            t0 = np.uint32(t0 + np.uint32(mult[0, f] * v))
            t1 = np.uint32(t1 + np.uint32(mult[1, f] * v))
            t2 = np.uint32(t2 + np.uint32(mult[2, f] * v))
            t3 = np.uint32(t3 + np.uint32(mult[3, f] * v))
        m = np.uint32(0xFFFF)
        out[r, 0] = t0 & m
        out[r, 1] = t1 & m
        out[r, 2] = t2 & m
        out[r, 3] = t3 & m
    return out


@njit(cache=True, nogil=True)
def quantize16_rows(x, exps, s1, s2, top, lim, words, row_words, col, slots, nb, block, i0, terms, saturated):
    """FIXED16 packets i0.. into rows (flat big-endian uint16 `words`, `row_words` apart, `slots`
    int16 slots from word `col`) (dataplane/fixed16.py `encode_rows` is the reference): nb exponent
    slots (the blocks' `exps`, 0 past the buffer), nb * block data slots quantised with each block's factors
    s1 * s2 (rint, clipped to +-lim, NaN -> 0; saturated[r] where a value was non-finite or not
    below `top` after scaling), zero padding, then the 4 check words with `terms[r]` (the header's
    T_j) and the exponents' G_j added, in the high halves of the last 4 lanes; then the slots are
    packed into lanes (`_borrow`). A whole row whose values all scale below `top` is quantised,
    stored and summed in one pass (a loop per block, its factor a scalar); any other row is built
    in a scratch of uint32 (its bad values redone carefully), then swapped into the row and summed
    in one loop (`_store_sums`). The loops vectorise."""
    n = x.size
    data = nb * block
    blocks = exps.size
    nv = slots - 8
    vals = np.zeros(nv, dtype=np.uint32)  # padding slots stay 0
    eb = np.zeros(nb, dtype=np.int64)
    for r in range(saturated.size):
        p = i0 + r
        dst = words[r * row_words + col:r * row_words + col + slots]
        b0 = p * nb
        bad = False
        e0 = p * data
        full = b0 + nb <= blocks and e0 + data <= n
        if full:  # a whole row of unsplit factors (s2 = 1): one long loop over the row's elements
            for b in range(nb):
                full &= s2[b0 + b] == 1
        if full:  # quantise, store and sum in one pass (the scratch only if the row needs its redo)
            flag = False
            c0 = np.uint32(0)
            c1 = np.uint32(0)
            c2 = np.uint32(0)
            c3 = np.uint32(0)
            for b in range(nb):
                eb[b] = exps[b0 + b]
                u = np.uint32(np.int32(exps[b0 + b]))
                dst[b] = np.uint16(((u & np.uint32(0xFF)) << np.uint32(8)) | ((u >> np.uint32(8)) & np.uint32(0xFF)))
                k1 = np.uint32(b + 1)
                k2 = np.uint32(k1 * k1)
                c0 = np.uint32(c0 + u)
                c1 = np.uint32(c1 + np.uint32(k1 * u))
                c2 = np.uint32(c2 + np.uint32(k2 * u))
                c3 = np.uint32(c3 + np.uint32(np.uint32(k2 * k1) * u))
            for b in range(nb):
                a = s1[b0 + b]
                src = x[e0 + b * block:e0 + (b + 1) * block]
                base = nb + b * block
                out = dst[base:base + block]
                for j in range(block):
                    v = src[j] * a
                    flag |= not (abs(v) < top)
                    q = np.rint(v)
                    q = q if q < lim else lim
                    q = q if q > -lim else -lim
                    u = np.uint32(np.int32(q))
                    out[j] = np.uint16(((u & np.uint32(0xFF)) << np.uint32(8)) | ((u >> np.uint32(8)) & np.uint32(0xFF)))
                    k1 = np.uint32(base + j + 1)
                    k2 = np.uint32(k1 * k1)
                    c0 = np.uint32(c0 + u)
                    c1 = np.uint32(c1 + np.uint32(k1 * u))
                    c2 = np.uint32(c2 + np.uint32(k2 * u))
                    c3 = np.uint32(c3 + np.uint32(np.uint32(k2 * k1) * u))
            if not flag:
                for k in range(nb + data, nv):  # zero padding (adds nothing to the sums)
                    dst[k] = 0
                g0, g1, g2, g3 = _exponent_terms(eb, nb)
                saturated[r] = False
                _put_checks(dst, nv, np.uint64(c0) + np.uint64(terms[r, 0]) + g0,
                            np.uint64(c1) + np.uint64(terms[r, 1]) + g1,
                            np.uint64(c2) + np.uint64(terms[r, 2]) + g2, np.uint64(c3) + np.uint64(terms[r, 3]) + g3)
                _borrow(dst, nv)
                continue
            flag = False
            for b in range(nb):
                eb[b] = exps[b0 + b]
                vals[b] = np.uint32(np.int32(exps[b0 + b]))
                a = s1[b0 + b]
                src = x[e0 + b * block:e0 + (b + 1) * block]
                out = vals[nb + b * block:nb + (b + 1) * block]
                for j in range(block):
                    v = src[j] * a
                    flag |= not (abs(v) < top)
                    q = np.rint(v)
                    q = q if q < lim else lim
                    q = q if q > -lim else -lim
                    out[j] = np.uint32(np.int32(q))
            if flag:  # redo the row's bad values carefully (NaN -> 0)
                bad = True
                src = x[e0:e0 + data]
                out = vals[nb:nb + data]
                for j in range(data):
                    q = np.rint(src[j] * s1[b0 + j // block])
                    if q != q:
                        out[j] = 0
                    elif not (abs(q) <= lim):
                        out[j] = np.uint32(np.int32(lim if q > 0 else -lim))
        for b in range(nb if not full else 0):
            gb = b0 + b
            lo = nb + b * block
            out = vals[lo:lo + block]
            if gb >= blocks:
                eb[b] = 0
                vals[b] = 0
                for j in range(block):
                    out[j] = 0
                continue
            eb[b] = exps[gb]
            vals[b] = np.uint32(np.int32(exps[gb]))
            a = s1[gb]
            f = s2[gb]
            i = e0 + b * block
            cnt = min(block, max(0, n - i))
            src = x[i:i + cnt]
            flag = False
            for j in range(cnt):  # branch-free selects (vectorise); a block with a bad value is redone
                v = (src[j] * a) * f
                flag |= not (abs(v) < top)
                q = np.rint(v)
                q = q if q < lim else lim
                q = q if q > -lim else -lim
                out[j] = np.uint32(np.int32(q))
            if flag:
                bad = True
                for j in range(cnt):
                    q = np.rint((src[j] * a) * f)
                    if q != q:
                        q = np.float32(0.0)
                    elif q > lim:
                        q = lim
                    elif q < -lim:
                        q = -lim
                    out[j] = np.uint32(np.int32(q))
            for j in range(cnt, block):
                out[j] = 0
        c0, c1, c2, c3 = _store_sums(vals, dst[:nv])
        g0, g1, g2, g3 = _exponent_terms(eb, nb)
        saturated[r] = bad
        _put_checks(dst, nv, np.uint64(c0) + np.uint64(terms[r, 0]) + g0, np.uint64(c1) + np.uint64(terms[r, 1]) + g1,
                    np.uint64(c2) + np.uint64(terms[r, 2]) + g2, np.uint64(c3) + np.uint64(terms[r, 3]) + g3)
        _borrow(dst, nv)
    return saturated


@njit(cache=True, nogil=True)
def dequantize16_rows(words, row_words, col, slots, nb, block, n, sel, terms, pow2, pow2_at, out, starts, ok,
                      checked=False):
    """Verify and decode FIXED16 sums of `n` contributions (dataplane/fixed16.py `decode_rows` is the
    reference): row sel[i]'s slots (`slots` of them, unpacked from its lanes) hold exponent slots
    that are multiples of n (e = slot / n), and its check lanes the words
    `sum_k (k+1)^j v_k + n * (terms[i, j] + G_j(e))` mod 2^16 over high halves, low halves 0;
    ok[i] says so. A row that passes has its data slots decoded, slot * 2^(e + c - 15) rounded
    once to float32 (pow2[e + pow2_at] = 2^(e + c - 15); an exponent outside the table fails the
    row), into out[starts[i]:], up to the end of `out`. `checked`: the rows' check words were
    verified already (`fixed16.verify_rows` on these very rows): only the exponent slots are
    checked before decoding (`terms` unused)."""
    nv = slots - 8
    eb = np.zeros(nb, dtype=np.int64)
    sc = np.empty(nv, dtype=np.int16)
    nn = np.uint64(n)
    for i in range(sel.size):
        src = words[sel[i] * row_words + col:sel[i] * row_words + col + slots]
        if checked:
            _unpack_row(src, nv, sc)
        else:
            c0, c1, c2, c3 = _unpack_sums(src, nv, sc)
        good = _exps16(sc, nb, n, pow2.size, pow2_at, eb)  # n equal exponents, each in the protocol's range
        if good and not checked:
            g0, g1, g2, g3 = _exponent_terms(eb, nb)
            good = _checks_match(src, nv, nn, terms[i, 0], terms[i, 1], terms[i, 2], terms[i, 3],
                                 c0, c1, c2, c3, g0, g1, g2, g3)
        ok[i] = good
        if good:  # each slot * 2^(e + c - 15), a power of two within float32's range (subnormals
            # included), so the float32 product of the slot (|v| <= 2^15, exact) and it is the
            # exact product rounded once, as in float64
            _decode16_row(sc, nb, block, eb, pow2, pow2_at, out, starts[i])
    return ok


@njit(cache=True, nogil=True, inline="always")
def _exps16(sc, nb, n, pow2_size, pow2_at, eb):
    """eb[b] = the exponent of block b of a FIXED16 sum of n (its slot / n, `sc` the row's unpacked
    slots); False when a slot is no multiple of n or an exponent is outside the table (pow2_size
    entries from -pow2_at). The quotient is the slot times 1/n rounded (|slot| < 2^15, n < 2^8:
    within 2^-30 of it when the slot is a multiple of n, which q * n == slot then confirms
    exactly): an integer division per block cost more than the row's check sums."""
    good = True
    inv = 1.0 / n
    lo = -pow2_at
    hi = pow2_size - pow2_at
    for b in range(nb):
        s = np.int64(sc[b])
        q = np.int64(np.rint(np.float64(s) * inv))
        good &= (q * n == s) & (q >= lo) & (q < hi)
        eb[b] = q
    return good


@njit(cache=True, nogil=True, inline="always")
def _decode16_row(sc, nb, block, eb, pow2, pow2_at, out, o):
    """The data slots of one FIXED16 row (`sc`, unpacked; block b scaled by pow2[eb[b] + pow2_at])
    into out[o:], up to the end of `out`."""
    m = out.size
    for b in range(nb):
        f = np.float32(pow2[eb[b] + pow2_at])
        lo = o + b * block
        hi = min(lo + block, m)
        if hi <= lo:
            break
        dst = out[lo:hi]
        v = sc[nb + b * block:nb + b * block + (hi - lo)]
        for j in range(dst.size):
            dst[j] = np.float32(v[j]) * f


@njit(cache=True, nogil=True)
def absorb_fixed16_results(hb, hstride, k, seq_at, tensor_at, offset_at, flags_at, dtype_at, count_at, numel_at,
                           skip_flags, fixed16, bits, ack, op_id, numel, per, chunks, words, row_words, col, slots, nb,
                           block, n, terms, pow2, pow2_at, out, retx, xmit_no, sack_high, fresh_seqs, info):
    """`absorb_fixed_results` for a FIXED16 sum, verification included (dataplane/engine/collective.py
    `on_results`: `_verified` with fixed16.verify_rows, `in_bounds`, the window, reductions.py
    `_decode16`, is the reference). First, changing nothing, every row must be in the window,
    ascending, op `op_id`'s, flagged none of `skip_flags` (SATURATED, MAX), of dtype `fixed16`,
    a whole chunk of `per` elements below `chunks` (offset a multiple of per, count at most per,
    numel the op's), its exponent lanes n equal exponents in range and its check words those of
    a sum of n (`dequantize16_rows`' verdict; `terms[i]`: row i's header term T_j): otherwise -1,
    and the caller runs the reference. Then the window and delivery bookkeeping of
    `absorb_fixed_results`, each fresh row decoded (as `dequantize16_rows`) into the flat `out`
    from its header's element offset. Rows are flat uint16 `words`, `row_words` apart."""
    size = bits.size
    prev = np.int64(-1)
    eb = np.zeros(nb, dtype=np.int64)
    nv = slots - 8
    sc = np.empty(nv, dtype=np.int16)
    nn = np.uint64(n)
    for i in range(k):
        b = i * hstride
        d = (_be32(hb, b + seq_at) - ack) & 0xFFFFFFFF
        if d >= size or d <= prev:
            return -1
        prev = d
        if _be32(hb, b + tensor_at) != op_id or hb[b + flags_at] & skip_flags or hb[b + dtype_at] != fixed16:
            return -1
        off = _be32(hb, b + offset_at)
        count = (np.int64(hb[b + count_at]) << 8) | np.int64(hb[b + count_at + 1])
        if off % per != 0 or off // per >= chunks or count > per or _be32(hb, b + numel_at) != numel:
            return -1
        src = words[i * row_words + col:i * row_words + col + slots]
        c0, c1, c2, c3 = _unpack_sums(src, nv, sc)
        if not _exps16(sc, nb, n, pow2.size, pow2_at, eb):
            return -1
        g0, g1, g2, g3 = _exponent_terms(eb, nb)
        if not _checks_match(src, nv, nn, terms[i, 0], terms[i, 1], terms[i, 2], terms[i, 3],
                             c0, c1, c2, c3, g0, g1, g2, g3):
            return -1
    fresh = 0
    mask = size - 1
    smask = retx.size - 1
    in_order = 1
    newest = np.int64(-1)
    newest_d = np.int64(-1)
    rack = np.int64(-1)
    for i in range(k):
        b = i * hstride
        seq = _be32(hb, b + seq_at)
        j = seq & mask
        if bits[j]:
            continue  # a duplicate
        bits[j] = True
        src = words[i * row_words + col:i * row_words + col + slots]
        _unpack_row(src, nv, sc)
        _exps16(sc, nb, n, pow2.size, pow2_at, eb)
        _decode16_row(sc, nb, block, eb, pow2, pow2_at, out, _be32(hb, b + offset_at))
        fresh_seqs[fresh] = seq
        fresh += 1
        d = (seq - sack_high) & 0xFFFFFFFF
        if d >= 0x80000000 or retx[seq & smask]:
            in_order = 0
        elif d > newest_d:
            newest_d = d
            newest = seq
        x = xmit_no[seq & smask]
        rack = x if x > rack else rack
    pos = ack & mask
    m = 0
    while m < size and bits[(pos + m) & mask]:
        m += 1
    for q in range(m):
        bits[(pos + q) & mask] = False
    info[0] = m
    info[1] = in_order
    info[2] = newest
    info[3] = rack
    return fresh
