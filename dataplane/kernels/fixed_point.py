"""numba kernels for the endpoint's fixed-point datapath (the compiled twins of dataplane/quantize.py).

Each kernel does in one pass what the numpy reference does in several: quantise float32 lanes
and write them big-endian straight into send-ring rows (`quantize_rows`), and read big-endian
lanes out of received rows, convert and scale them into the result buffer (`dequantize_rows`).
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
    n = x.size
    for r in range(s1.size):
        i0 = r * lanes
        count = min(lanes, max(0, n - i0))
        off = r * row_words + col
        a = s1[r]
        b = s2[r]
        bad = _quantize_row(x, i0, count, a, b, limf, words, off, lanes)
        saturated[r] = bad
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
    return saturated


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


@njit(cache=True, nogil=True)
def chunk_absmax(words, lanes, out):
    """out[r] = the bits of max |x[r * lanes:(r + 1) * lanes]| for float32 x given as its uint32
    `words` (the last chunk may be short), in one read of x and without numpy's `abs` temporary.
    With the sign bit cleared, IEEE bit patterns order as the magnitudes do and every NaN lies
    above inf, so an integer maximum (which vectorises; a float one does not without fastmath)
    is the largest magnitude, or a NaN where the chunk holds one: what `np.abs(chunk).max()` gives."""
    n = words.size
    for r in range(out.size):
        src = words[r * lanes:min(n, (r + 1) * lanes)]
        m = np.uint32(0)
        for j in range(src.size):
            v = src[j] & np.uint32(0x7FFFFFFF)
            m = v if v > m else m
        out[r] = m
    return out
