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
        _clip_row(x, i0, count, a, b, limf, words[off:off + lanes])
    return bad


@njit(cache=True, nogil=True, inline="always")
def _clip_row(x, i0, count, a, b, limf, dst):
    """The careful scalar pass over a row that saturated: NaN -> 0, the rest clipped to +-limf."""
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


@njit(cache=True, nogil=True, inline="always")
def _quantize_row_sums(x, i0, count, a, b, limf, words, off, lanes):
    """`_quantize_row` that also returns the row's `_lane_sums32`, summed as its lanes are made
    (the same uint32 values the words hold, byte-swapped back; the zero lanes past `count` add
    nothing): (saturated, s0, s1). Where it saturated the sums are of unclipped values: the caller
    clips the row and sums it again."""
    src = x[i0:i0 + count]
    dst = words[off:off + lanes]
    bad = 0
    s0 = np.uint32(0)
    s1 = np.uint32(0)
    for j in range(count):
        v = np.rint((src[j] * a) * b)
        bad |= np.int32(not (abs(v) <= limf))
        u = np.uint32(np.int32(v))
        s0 = np.uint32(s0 + u)
        s1 = np.uint32(s1 + np.uint32(u * np.uint32(j + 1)))
        dst[j] = np.uint32(_bswap32(u))
    for j in range(count, lanes):
        dst[j] = 0
    return bad != 0, s0, s1


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


@njit(cache=True, inline="always")
def _advance_window(bits, ack, mask, size, info, in_order, newest, rack):
    """The end of a RESULT pass: the window's contiguous received prefix from `ack` (its bits
    cleared, as RecvWindow.advance does) into info[0], and the send stream's delivery news
    (in order, newest seq, RACK's latest transmission) into info[1:4]."""
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
    _advance_window(bits, ack, mask, size, info, in_order, newest, rack)
    return fresh


@njit(cache=True, nogil=True)
def absorb_checked_results(hb, hstride, k, lens, seq_at, tensor_at, offset_at, flags_at, count_at, numel_at, dtype_at,
                           skip_flags, dtype, chunk_lanes, row_lanes, at, width, mult, grad, agg, n, bits, ack, op_id,
                           lanes, chunks, numel, words, row_words, col, s1, s2, out, full, tail, retx, xmit_no, sack_high,
                           fresh_seqs, info, hc_flat, hc_cols, hc_at, first):
    """A whole received RESULT batch of one FIXED32 float-sum op in one pass, what the engine's
    numpy code does to it one call at a time (the references: dataplane/engine/dispatch.py
    `_dispatch`'s header check and grouping, `_handle`'s length check and `widened`,
    dataplane/engine/collective.py `_verified` (check_words_hold), packets.py `in_bounds` and
    `absorb_fixed_results`; tests/engine/test_checked_results.py). Headers `hb`: k rows of
    `hstride` (= HEADER_LEN) bytes, fields at the given byte offsets, big-endian.

    First checks, changing nothing, that every row passes all of them: where `hc_flat` is not
    empty, its header check (integrity.py `header_checks`: the xor of table `hc_flat` at each
    byte `hc_cols` holds, against the big-endian word at `hc_at`) and its first 4 bytes those of
    `first` but for the flags byte (dispatch.py `_SAME_BATCH`: the same version, type, session);
    its length `lens[i]` is header + 4 * wire lanes of its count (integrity.py `wire_lanes` of a
    32-bit dtype: count + 2 check lanes, in whole `chunk_lanes`, at most `row_lanes`), its dtype
    is `dtype`, no flag of `skip_flags` (SATURATED, MAX) is set, its numel is `numel`, its offset
    a whole chunk below numel, its count at most `lanes`, every condition of
    `absorb_fixed_results`, and then its check words (after its own data lanes, a short packet's
    included: the lanes a switch pads with are zero and weigh nothing) those of a sum of `n`
    (`check_words32` mode 2, header term from `at`, `width`, `mult`). Anything else returns -1:
    the caller runs the references, which count and drop what fails exactly as ever. Otherwise
    absorbs the rows as `absorb_fixed_results` does, a short row's lanes past its packet taken as
    the zeros `widened` gives them, and returns how many were fresh (info as there).

    A new row is decoded into `out` right after its check words held (its lanes still in cache),
    so a -1 for a later row's failed check words may leave the decode of earlier rows in `out`:
    rows that passed every check, which the references then absorb with the same bits (the
    decode reads nothing else), into chunks not yet received; a row that fails is never decoded,
    and nothing else changes (the window, the counts and the send stream's state are written
    only once every row passed)."""
    size = bits.size
    prev = np.int64(-1)
    for i in range(k):
        b = i * hstride
        if hc_flat.size:
            crc = np.uint16(0)
            for p in range(hc_cols.size):
                crc ^= hc_flat[p * 256 + hb[b + hc_cols[p]]]
            if (np.uint16(hb[b + hc_at]) << np.uint16(8)) | np.uint16(hb[b + hc_at + 1]) != crc:
                return -1
            if hb[b] != first[0] or hb[b + 2] != first[2] or hb[b + 3] != first[3]:
                return -1
        cnt = (np.int64(hb[b + count_at]) << 8) | np.int64(hb[b + count_at + 1])
        need = cnt + 2
        wl = min(row_lanes, -(-need // chunk_lanes) * chunk_lanes)
        if lens[i] != hstride + 4 * wl or hb[b + dtype_at] != dtype or hb[b + flags_at] & skip_flags:
            return -1
        off = _be32(hb, b + offset_at)
        if _be32(hb, b + numel_at) != numel or off % lanes != 0 or off >= numel or cnt > lanes:
            return -1
        d = (_be32(hb, b + seq_at) - ack) & 0xFFFFFFFF
        if d >= size or d <= prev or _be32(hb, b + tensor_at) != op_id or off // lanes >= chunks:
            return -1
        prev = d
    mask = size - 1
    for i in range(k):  # the check words; a new row decoded right after its own (see the docstring)
        b = i * hstride
        base = i * row_words + col
        nl = (lens[i] - hstride) // 4 - 2
        src = words[base:base + nl]
        s0, s1_ = _lane_sums32(src)
        t0, t1 = _term32(hb[b:b + hstride], at, width, mult, dtype, grad, agg)
        w0 = (np.uint64(s0) + np.uint64(t0) * np.uint64(n)) & np.uint64(0xFFFFFFFF)
        w1 = (np.uint64(s1_) + np.uint64(t1) * np.uint64(n)) & np.uint64(0xFFFFFFFF)
        if np.uint64(_bswap32(words[base + nl])) != w0 or np.uint64(_bswap32(words[base + nl + 1])) != w1:
            return -1
        if bits[_be32(hb, b + seq_at) & mask]:
            continue  # a duplicate: checked, not decoded
        c = _be32(hb, b + offset_at) // lanes
        dst = out[c * lanes:(c + 1) * lanes] if c < full else tail[:lanes]
        a = s1[c]
        f = s2[c]
        for m in range(nl):
            dst[m] = (np.float32(np.int32(_bswap32(src[m]))) * a) * f
        for m in range(nl, lanes):
            dst[m] = (np.float32(0) * a) * f
    fresh = 0
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
    _advance_window(bits, ack, mask, size, info, in_order, newest, rack)
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
    row by `check_words32`'s mode 1: the row's 2 check words (header term from header row r of
    `hb`) written big-endian after its `lanes` lanes, their lane sums made in the quantising loop
    itself (`_quantize_row_sums`: no second read of the row)."""
    for r in range(s1.size):
        off = r * row_words + col
        i0 = r * lanes
        count = min(lanes, max(0, x.size - i0))
        bad, s0, s1_ = _quantize_row_sums(x, i0, count, s1[r], s2[r], limf, words, off, lanes)
        saturated[r] = bad
        if bad:  # rare: the careful pass (as `_quantize_chunk`), then the sums of what it wrote
            _clip_row(x, i0, count, s1[r], s2[r], limf, words[off:off + lanes])
            s0, s1_ = _lane_sums32(words[off:off + lanes])
        t0, t1 = _term32(hb[r], at, width, mult, dtype, grad, agg)
        words[off + lanes] = _bswap32(np.uint32(s0 + t0))
        words[off + lanes + 1] = _bswap32(np.uint32(s1_ + t1))
    return saturated


@njit(cache=True, nogil=True)
def seal_rows32(hb, saturated, flags_at, sat_flag, hc_flat, hc_cols, hc_at, rows, row_bytes):
    """After `quantize_rows_checked`, the rest of a sender's fill (dataplane/engine/packets.py
    `aggregation_fill` is the reference): header row r of `hb` (K, HEADER_LEN) gets `sat_flag` in
    its flags byte where `saturated[r]`, then its header check (integrity.py `seal_headers`: the
    xor of table `hc_flat` at each byte `hc_cols` holds, big-endian at `hc_at`), then is copied
    into the first bytes of packet row r of the flat uint8 `rows` (rows `row_bytes` apart)."""
    hlen = hb.shape[1]
    for r in range(hb.shape[0]):
        h = hb[r]
        if saturated[r]:
            h[flags_at] |= sat_flag
        crc = np.uint16(0)
        for p in range(hc_cols.size):
            crc ^= hc_flat[p * 256 + h[hc_cols[p]]]
        h[hc_at] = np.uint8(crc >> np.uint16(8))
        h[hc_at + 1] = np.uint8(crc & np.uint16(0xFF))
        dst = rows[r * row_bytes:r * row_bytes + hlen]
        for j in range(hlen):
            dst[j] = h[j]
