"""numba kernels for the endpoint's fixed-point datapath (the compiled twins of dataplane/quantize.py).

Each kernel does in one pass what the numpy reference does in several: quantise float32 lanes
and write them big-endian straight into send-ring rows (`quantize_rows`), and read big-endian
lanes out of received rows, convert and scale them into the result buffer (`dequantize_rows`),
or do that for a whole RESULT batch of a float sum along with its window and delivery bookkeeping
(`absorb_fixed_results`, the compiled twin of dataplane/engine/collective.py `on_results`), and
widen a pull's bf16 PARAM rows into its float32 buffer (`widen_bf16_rows`).
Bit for bit the reference's results (tests/engine/test_kernels.py): the scaling is a float32
multiply by exact powers of two (`s1` then `s2`, as dataplane/quantize.py `pow2_split` explains),
rounding is rint (half to even), the limit is compared in float32, and no fastmath (no
contraction, no reassociation). Rows are passed as flat uint32 words of a C-contiguous buffer
(`row_words` apart, lanes from word `col`) so that the inner loops see unit strides and vectorise.
Imported only when kernels are on (dataplane/kernels), compiled on first call, cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _bswap32(v):
    return ((v & 0xFF) << 24) | ((v & 0xFF00) << 8) | ((v >> 8) & 0xFF00) | ((v >> 24) & 0xFF)


@njit(cache=True, nogil=True)
def _quantize_row(x, i0, count, a, b, limf, words, off, lanes):
    """One chunk: words[off:off+lanes] = big-endian rint(x[i0:i0+count] * a * b), zeros past count.
    Returns True when a value was non-finite or past +-limf (the caller then redoes the row)."""
    src = x[i0:i0 + count]  # slices: loop indices numba knows are in bounds vectorise
    dst = words[off:off + lanes]
    bad = 0
    for j in range(count):
        v = np.rint((src[j] * a) * b)
        bad |= np.int32(not (abs(v) <= limf))
        dst[j] = np.uint32(_bswap32(np.uint32(np.int32(v))))
    for j in range(count, lanes):
        dst[j] = 0
    return bad != 0


@njit(cache=True, nogil=True)
def quantize_rows(x, s1, s2, limf, words, row_words, col, lanes, saturated):
    """x (float32 values of len(s1) chunks; short at the buffer's tail) -> chunk r's lanes as
    big-endian int32 at words[r * row_words + col:...]; saturated[r] where a value had to be
    clipped: non-finite or past +-limf, with NaN -> 0, as the reference does."""
    for r in range(s1.size):
        saturated[r] = _quantize_chunk(x, r, s1[r], s2[r], limf, words, r * row_words + col, lanes)
    return saturated


@njit(cache=True, nogil=True, inline="always")
def _quantize_chunk(x, r, a, b, limf, words, off, lanes):
    """`quantize_rows` of chunk r into words[off:off + lanes]; True where it saturated."""
    i0 = r * lanes
    count = min(lanes, max(0, x.size - i0))
    bad = _quantize_row(x, i0, count, a, b, limf, words, off, lanes)
    if bad:  # rare: the careful scalar pass over this row
        dst = words[off:off + lanes]
        for j in range(count):
            v = np.rint((x[i0 + j] * a) * b)
            if not (abs(v) <= limf):
                if np.isnan(v):
                    v = np.float32(0.0)
                elif v > limf:
                    v = limf
                else:
                    v = -limf
            dst[j] = np.uint32(_bswap32(np.uint32(np.int32(v))))
    return bad


@njit(cache=True, nogil=True)
def dequantize_rows(words, row_words, col, lanes, sel, s1, s2, chunk, out):
    """out[chunk[i] * lanes + j] = float32(big-endian int32 word col + j of row sel[i]) * s1[i] * s2[i]."""
    for i in range(sel.size):
        src = words[sel[i] * row_words + col:sel[i] * row_words + col + lanes]
        dst = out[chunk[i] * lanes:(chunk[i] + 1) * lanes]
        a = s1[i]
        b = s2[i]
        for j in range(lanes):
            u = np.int32(_bswap32(src[j]))
            dst[j] = (np.float32(u) * a) * b


@njit(cache=True, nogil=True, inline="always")
def _magnitude_bits(src):
    """The bits of max |x| over float32 `src` given as uint32 (see `chunk_absmax`)."""
    m = np.uint32(0)
    for j in range(src.size):
        v = src[j] & np.uint32(0x7FFFFFFF)
        m = v if v > m else m
    return m


@njit(cache=True, nogil=True)
def chunk_absmax(words, lanes, out):
    """out[r] = the bits of max |x[r * lanes:(r + 1) * lanes]| for float32 x given as its uint32
    `words` (the last chunk may be short), in one read of x and without numpy's `abs` temporary.
    With the sign bit cleared, IEEE bit patterns order as the magnitudes do and every NaN lies
    above inf, so an integer maximum (which vectorises; a float one does not without fastmath)
    is the largest magnitude, or a NaN where the chunk holds one: what `np.abs(chunk).max()` gives."""
    n = words.size
    for r in range(out.size):
        out[r] = _magnitude_bits(words[r * lanes:min(n, (r + 1) * lanes)])
    return out


@njit(cache=True, nogil=True)
def chunk_exponents(words, lanes, exp_min, exp_max, out):
    """out[r] = dataplane/quantize.py `chunk_exponents` of chunk r of float32 x given as its uint32
    `words`: the exponent e of frexp(max |chunk|) (max |chunk| < 2^e), exp_min for an all-zero
    chunk, exp_max for one holding inf or NaN, clipped to [exp_min, exp_max]. Read off the
    largest magnitude's bits (as `chunk_absmax` finds them): a normal value with biased exponent
    E is 0.1f * 2^(E - 126); a subnormal m * 2^-149 has e = bit_length(m) - 149."""
    n = words.size
    for r in range(out.size):
        m = _magnitude_bits(words[r * lanes:min(n, (r + 1) * lanes)])
        biased = np.int32(m >> np.uint32(23))
        if m == 0:
            e = exp_min
        elif biased == 255:  # inf or NaN
            e = exp_max
        elif biased == 0:  # subnormal
            e = np.int32(-149)
            while m:
                m >>= np.uint32(1)
                e += 1
        else:
            e = biased - 126
        out[r] = min(max(e, exp_min), exp_max)
    return out


@njit(cache=True, inline="always")
def _be32(b, at):
    return (np.int64(b[at]) << 24) | (np.int64(b[at + 1]) << 16) | (np.int64(b[at + 2]) << 8) | np.int64(b[at + 3])


@njit(cache=True, nogil=True)
def absorb_fixed_results(hb, hstride, k, seq_at, tensor_at, offset_at, flags_at, sat_flag, bits, ack, op_id, lanes,
                         chunks, words, row_words, col, s1, s2, out, full, tail, retx, xmit_no, sack_high, fresh_seqs,
                         info):
    """One RESULT batch of one float-sum op, the common case in one pass (dataplane/engine/collective.py
    `on_results` is the reference): headers `hb` (k rows of `hstride` bytes, fields at the given byte
    offsets, big-endian), window `bits` at `ack`, payload lanes as flat uint32 `words`.

    First checks, changing nothing, that every row is in the window in ascending order, is op
    `op_id`'s, names a chunk below `chunks` and is not flagged `sat_flag`: otherwise returns -1 and
    the caller runs the reference. Then marks each row's bit; a row seen for the first time is
    dequantised (as `dequantize_rows`) into `out` (whole chunks, flat) or `tail` (the short last
    chunk, index `full`), and its seq goes to `fresh_seqs`. Then advances over the received prefix
    (clearing its bits, as RecvWindow.advance): info[0] = how far. And reads the send stream's
    ring (`retx`, `xmit_no`: SendStream.on_delivered's common case): info[1] = 1 when every fresh
    seq is past `sack_high` and none was resent, info[2] = the newest of them, info[3] = the
    latest transmission among them. Returns how many rows were fresh."""
    size = bits.size
    prev = np.int64(-1)
    for i in range(k):
        b = i * hstride
        d = (_be32(hb, b + seq_at) - ack) & 0xFFFFFFFF
        if d >= size or d <= prev:
            return -1
        prev = d
        if _be32(hb, b + tensor_at) != op_id or hb[b + flags_at] & sat_flag:
            return -1
        if _be32(hb, b + offset_at) // lanes >= chunks:
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
        c = _be32(hb, b + offset_at) // lanes
        src = words[i * row_words + col:i * row_words + col + lanes]
        dst = out[c * lanes:(c + 1) * lanes] if c < full else tail[:lanes]
        a = s1[c]
        f = s2[c]
        for m in range(lanes):
            u = np.int32(_bswap32(src[m]))
            dst[m] = (np.float32(u) * a) * f
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
    n = 0
    while n < size and bits[(pos + n) & mask]:
        n += 1
    for m in range(n):
        bits[(pos + m) & mask] = False
    info[0] = n
    info[1] = in_order
    info[2] = newest
    info[3] = rack
    return fresh


@njit(cache=True, nogil=True)
def widen_bf16_rows(half, s0, n, col, epp, out, o0, numel):
    """PARAM packets half[s0:s0 + n] (the rows as native uint16 words; `epp` big-endian bf16
    values each from word `col`) into float32 bits: packet i's values to out[o0 + i * epp:],
    each the bf16's 16 bits byte-swapped into a float32's top half, stopping at `numel` (the
    short last packet). One pass, where the numpy reference (dataplane/engine/node_worker.py
    `_decode_run`) converts, then shifts in place: two passes over the output."""
    for i in range(n):
        start = o0 + i * epp
        m = min(epp, numel - start)
        if m <= 0:
            break
        src = half[s0 + i, col:col + m]
        dst = out[start:start + m]
        for j in range(m):
            v = np.uint32(src[j])
            dst[j] = ((v & np.uint32(0xFF)) << np.uint32(24)) | ((v >> np.uint32(8)) << np.uint32(16))


@njit(cache=True, nogil=True)
def widen_bf16(half, out):
    """bf16 values (native uint16 bits: a pull's staged PARAM data) into float32 bits, each in a
    float32's top half. One pass, where the numpy reference (dataplane/engine/node_worker.py
    `widen_staged_bf16`) copies, then shifts in place: two passes over the output."""
    for j in range(half.size):
        out[j] = np.uint32(half[j]) << np.uint32(16)


# --- FIXED16 (dataplane/fixed16.py is the reference of both kernels) -------------------------
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
    dst[nv] = _bswap16(np.uint16(c0 & np.uint64(0xFFFF)))
    dst[nv + 1] = _bswap16(np.uint16(c1 & np.uint64(0xFFFF)))
    dst[nv + 2] = _bswap16(np.uint16(c2 & np.uint64(0xFFFF)))
    dst[nv + 3] = _bswap16(np.uint16(c3 & np.uint64(0xFFFF)))


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
def quantize16_rows(x, exps, s1, s2, top, lim, words, row_words, col, lanes, nb, block, i0, terms, saturated):
    """FIXED16 packets i0.. into rows (flat big-endian uint16 `words`, `row_words` apart, lanes from
    word `col`) (dataplane/fixed16.py `encode_rows` is the reference): nb exponent lanes (the
    blocks' `exps`, 0 past the buffer), nb * block data lanes quantised with each block's factors
    s1 * s2 (rint, clipped to +-lim, NaN -> 0; saturated[r] where a value was non-finite or not
    below `top` after scaling), zero padding, then the 4 check words with `terms[r]` (the header's
    T_j) and the exponents' G_j added. A whole row whose values all scale below `top` is
    quantised, stored and summed in one pass (a loop per block, its factor a scalar); any other
    row is built in a scratch of uint32 (its bad values redone carefully), then swapped into the
    row and summed in one loop (`_store_sums`). The loops vectorise."""
    n = x.size
    data = nb * block
    blocks = exps.size
    nv = lanes - 4
    vals = np.zeros(nv, dtype=np.uint32)  # padding lanes stay 0
    eb = np.zeros(nb, dtype=np.int64)
    for r in range(saturated.size):
        p = i0 + r
        dst = words[r * row_words + col:r * row_words + col + lanes]
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
    return saturated


@njit(cache=True, nogil=True)
def dequantize16_rows(words, row_words, col, lanes, nb, block, n, sel, terms, pow2, pow2_at, out, starts, ok,
                      checked=False):
    """Verify and decode FIXED16 sums of `n` contributions (dataplane/fixed16.py `decode_rows` is the
    reference): row sel[i]'s exponent lanes must be multiples of n (e = lane / n), its check words
    `sum_k (k+1)^j v_k + n * (terms[i, j] + G_j(e))` mod 2^16; ok[i] says so. A row that passes has
    its data lanes decoded, lane * 2^(e + c - 15) rounded once to float32 (pow2[e + pow2_at] =
    2^(e + c - 15); an exponent outside the table fails the row), into out[starts[i]:], up to the
    end of `out`. `checked`: the rows' check words were verified already (`fixed16.verify_rows` on
    these very rows): only the exponent lanes are checked, and the data lanes are decoded straight
    from the row in one pass (`terms` unused)."""
    if checked:
        return _decode16_checked(words, row_words, col, lanes, nb, block, n, sel, pow2, pow2_at, out, starts, ok)
    nv = lanes - 4
    eb = np.zeros(nb, dtype=np.int64)
    msk = np.uint64(0xFFFF)
    nn = np.uint64(n)
    for i in range(sel.size):
        src = words[sel[i] * row_words + col:sel[i] * row_words + col + lanes]
        good = _exps16(src, nb, n, pow2.size, pow2_at, eb)  # n equal exponents, each in the protocol's range
        if good:
            c0, c1, c2, c3 = _row_sums16(src[:nv])
            g0, g1, g2, g3 = _exponent_terms(eb, nb)
            good = ((np.uint64(c0) + nn * (np.uint64(terms[i, 0]) + g0)) & msk) == np.uint64(_bswap16(src[nv])) \
                and ((np.uint64(c1) + nn * (np.uint64(terms[i, 1]) + g1)) & msk) == np.uint64(_bswap16(src[nv + 1])) \
                and ((np.uint64(c2) + nn * (np.uint64(terms[i, 2]) + g2)) & msk) == np.uint64(_bswap16(src[nv + 2])) \
                and ((np.uint64(c3) + nn * (np.uint64(terms[i, 3]) + g3)) & msk) == np.uint64(_bswap16(src[nv + 3]))
        ok[i] = good
        if good:  # the row again, from cache: each lane * 2^(e + c - 15), a power of two within float32's range
            # (subnormals included), so the float32 product of the lane (|v| <= 2^15, exact) and it is
            # the exact product rounded once, as in float64
            _decode16_row(src, nb, block, eb, pow2, pow2_at, out, starts[i])
    return ok


@njit(cache=True, nogil=True, inline="always")
def _exps16(src, nb, n, pow2_size, pow2_at, eb):
    """eb[b] = the exponent of block b of a FIXED16 sum of n (its lane / n); False when a lane is no
    multiple of n or an exponent is outside the table (pow2_size entries from -pow2_at). The
    quotient is the lane times 1/n rounded (|lane| < 2^15, n < 2^8: within 2^-30 of it when the
    lane is a multiple of n, which q * n == lane then confirms exactly): an integer division per
    block cost more than the row's check sums."""
    good = True
    inv = 1.0 / n
    lo = -pow2_at
    hi = pow2_size - pow2_at
    for b in range(nb):
        s = np.int64(np.int16(_bswap16(src[b])))
        q = np.int64(np.rint(np.float64(s) * inv))
        good &= (q * n == s) & (q >= lo) & (q < hi)
        eb[b] = q
    return good


@njit(cache=True, nogil=True, inline="always")
def _decode16_row(src, nb, block, eb, pow2, pow2_at, out, o):
    """The data lanes of one FIXED16 row (block b scaled by pow2[eb[b] + pow2_at]) into out[o:],
    up to the end of `out`: each lane read big-endian, sign-extended and scaled in one pass."""
    m = out.size
    for b in range(nb):
        sc = np.float32(pow2[eb[b] + pow2_at])
        lo = o + b * block
        hi = min(lo + block, m)
        if hi <= lo:
            break
        dst = out[lo:hi]
        v = src[nb + b * block:nb + b * block + (hi - lo)]
        for j in range(dst.size):
            u = v[j]
            dst[j] = np.float32(np.int32(np.int16(np.uint16(((u & 0xFF) << 8) | ((u >> 8) & 0xFF))))) * sc


@njit(cache=True, nogil=True)
def _decode16_checked(words, row_words, col, lanes, nb, block, n, sel, pow2, pow2_at, out, starts, ok):
    """`dequantize16_rows` of rows whose check words were verified: the exponent lanes checked as
    there, each data lane read big-endian, sign-extended and scaled in one pass (the same bits)."""
    eb = np.zeros(nb, dtype=np.int64)
    for i in range(sel.size):
        src = words[sel[i] * row_words + col:sel[i] * row_words + col + lanes]
        ok[i] = _exps16(src, nb, n, pow2.size, pow2_at, eb)
        if ok[i]:
            _decode16_row(src, nb, block, eb, pow2, pow2_at, out, starts[i])
    return ok


@njit(cache=True, nogil=True, inline="always")
def _row_sums16(src):
    """`_store_sums`' sums of big-endian int16 lanes `src` (the check words' lane part, read
    side): (sum v, sum (k+1) v, sum (k+1)^2 v, sum (k+1)^3 v) mod 2^32, v sign-extended."""
    s0 = np.uint32(0)
    s1 = np.uint32(0)
    s2 = np.uint32(0)
    s3 = np.uint32(0)
    for k in range(src.size):
        u = src[k]
        v = np.uint32(np.int32(np.int16(np.uint16(((u & 0xFF) << 8) | ((u >> 8) & 0xFF)))))
        a = np.uint32(k + 1)
        b = np.uint32(a * a)
        s0 = np.uint32(s0 + v)
        s1 = np.uint32(s1 + np.uint32(a * v))
        s2 = np.uint32(s2 + np.uint32(b * v))
        s3 = np.uint32(s3 + np.uint32(np.uint32(b * a) * v))
    return s0, s1, s2, s3


@njit(cache=True, nogil=True)
def absorb_fixed16_results(hb, hstride, k, seq_at, tensor_at, offset_at, flags_at, dtype_at, count_at, numel_at,
                           skip_flags, fixed16, bits, ack, op_id, numel, per, chunks, words, row_words, col, lanes, nb,
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
    nv = lanes - 4
    msk = np.uint64(0xFFFF)
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
        src = words[i * row_words + col:i * row_words + col + lanes]
        if not _exps16(src, nb, n, pow2.size, pow2_at, eb):
            return -1
        c0, c1, c2, c3 = _row_sums16(src[:nv])
        g0, g1, g2, g3 = _exponent_terms(eb, nb)
        if ((np.uint64(c0) + nn * (np.uint64(terms[i, 0]) + g0)) & msk) != np.uint64(_bswap16(src[nv])) \
                or ((np.uint64(c1) + nn * (np.uint64(terms[i, 1]) + g1)) & msk) != np.uint64(_bswap16(src[nv + 1])) \
                or ((np.uint64(c2) + nn * (np.uint64(terms[i, 2]) + g2)) & msk) != np.uint64(_bswap16(src[nv + 2])) \
                or ((np.uint64(c3) + nn * (np.uint64(terms[i, 3]) + g3)) & msk) != np.uint64(_bswap16(src[nv + 3])):
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
        src = words[i * row_words + col:i * row_words + col + lanes]
        _exps16(src, nb, n, pow2.size, pow2_at, eb)
        _decode16_row(src, nb, block, eb, pow2, pow2_at, out, _be32(hb, b + offset_at))
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


@njit(cache=True, nogil=True)
def lane_sums(words, row_words, col, lanes, rows, out):
    """The lane part of the 32-bit check words (docs/protocol.md 3.6) of rows `rows`: out[r, 0] =
    sum of the `lanes` big-endian words from word `col` of row rows[r], out[r, 1] = sum of
    (k+1) * word k, both mod 2^32 (dataplane/integrity.py `check_words_rows` is the reference; the
    header term is added by the caller). Exact in uint64: 16000 terms below 2^46 each."""
    for r in range(rows.size):
        off = rows[r] * row_words + col
        src = words[off:off + lanes]
        s0 = np.uint64(0)
        s1 = np.uint64(0)
        for j in range(lanes):
            v = np.uint64(_bswap32(src[j]))
            s0 += v
            s1 += v * np.uint64(j + 1)
        out[r, 0] = s0 & np.uint64(0xFFFFFFFF)
        out[r, 1] = s1 & np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True, inline="always")
def _lane_sums32(src):
    """`lane_sums` of one row's big-endian words `src`, as uint32: every step wraps mod 2^32, which
    is all the check words keep (the same values; 32-bit lanes vectorise twice as wide, and
    without AVX2's emulated 64-bit multiply)."""
    s0 = np.uint32(0)
    s1 = np.uint32(0)
    for j in range(src.size):
        v = np.uint32(_bswap32(src[j]))
        s0 = np.uint32(s0 + v)
        s1 = np.uint32(s1 + np.uint32(v * np.uint32(j + 1)))
    return s0, s1


@njit(cache=True, nogil=True, inline="always")
def _term32(row, at, width, mult, dtype, grad, agg):
    """The two 32-bit header terms of uint8 header `row` (`check_words32`'s layout; dtype 0: none)."""
    t0 = np.uint32(0)
    t1 = np.uint32(0)
    if dtype != 0:
        for f in range(11):
            if f < 7:
                v32 = np.uint32(0)
                for q in range(width[f]):
                    v32 = np.uint32((v32 << np.uint32(8)) | np.uint32(row[at[f] + q]))
            elif f == 7:
                v32 = np.uint32(dtype)
            elif f == 9:
                v32 = np.uint32(row[at[f]])
            elif f == 8:
                v32 = np.uint32(row[at[f]]) & np.uint32(width[f])
            else:
                ty = row[at[f]] & 0xF
                v32 = np.uint32(1) if ty in (grad, agg) else np.uint32(3)
            t0 = np.uint32(t0 + np.uint32(mult[0, f] * v32))
            t1 = np.uint32(t1 + np.uint32(mult[1, f] * v32))
    return t0, t1


@njit(cache=True, nogil=True)
def check_words32(words, row_words, col, lanes, rows, hb, hsel, at, width, mult, dtype, grad, agg, n, mode, out, ok):
    """dataplane/integrity.py `check_words_rows` (the reference) of the 32-bit check words of rows
    `rows` (2 lanes of 32 bits: FIXED32, INT32 and the other 4-byte formats, not MAX packets), in
    one compiled pass per row: the lane sums of `lane_sums` plus `n` times the header term, read
    off header row hsel[r] of the uint8 rows `hb` (K, >= 32) with `header_terms16`'s field layout
    (`at`, `width`, `mult` (2, 11) uint32; dtype 0 = INT32: no header term). out[r, :] = the
    words (uint64, mod 2^32). mode 1 also writes them big-endian after the lanes (a sender's
    fill); mode 2 sets ok[r] to whether the words the row carries there are these (a receiver)."""
    for r in range(rows.size):
        off = rows[r] * row_words + col
        s0, s1 = _lane_sums32(words[off:off + lanes])
        t0, t1 = _term32(hb[hsel[r]], at, width, mult, dtype, grad, agg)
        w0 = (np.uint64(s0) + np.uint64(t0) * np.uint64(n)) & np.uint64(0xFFFFFFFF)
        w1 = (np.uint64(s1) + np.uint64(t1) * np.uint64(n)) & np.uint64(0xFFFFFFFF)
        out[r, 0] = w0
        out[r, 1] = w1
        if mode == 1:
            words[off + lanes] = _bswap32(np.uint32(w0))
            words[off + lanes + 1] = _bswap32(np.uint32(w1))
        elif mode == 2:
            ok[r] = (np.uint64(_bswap32(words[off + lanes])) == w0) and (np.uint64(_bswap32(words[off + lanes + 1])) == w1)
    return out


@njit(cache=True, nogil=True)
def quantize_rows_checked(x, s1, s2, limf, words, row_words, col, lanes, saturated, hb, at, width, mult, dtype, grad,
                          agg):
    """`quantize_rows` (dataplane/quantize.py `quantize_into_rows` is the reference) followed, per
    row while its lanes are still in cache, by `check_words32`'s mode 1: the row's 2 check words
    (header term from header row r of `hb`) written big-endian after its `lanes` lanes."""
    for r in range(s1.size):
        off = r * row_words + col
        saturated[r] = _quantize_chunk(x, r, s1[r], s2[r], limf, words, off, lanes)
        s0, s1_ = _lane_sums32(words[off:off + lanes])
        t0, t1 = _term32(hb[r], at, width, mult, dtype, grad, agg)
        words[off + lanes] = _bswap32(np.uint32(s0 + t0))
        words[off + lanes + 1] = _bswap32(np.uint32(s1_ + t1))
    return saturated
