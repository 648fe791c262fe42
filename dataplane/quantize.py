"""Float <-> 32-bit fixed point with SwitchML's shared exponent, and the order-preserving int32
encoding used for MAX/MIN of floats (docs/protocol.md, section 5).

Everything is vectorised over a whole buffer viewed as (chunks, lanes): one chunk is one
packet's payload and has one exponent shared by all workers.
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import use_numba

EXP_MIN, EXP_MAX = -128, 127  # int8 header field; EXP_MIN marks an all-zero chunk


def contributor_bits(n: int) -> int:
    """c = ceil(log2(n)): headroom bits so that the sum of n contributions cannot overflow."""
    if n < 1:
        raise ValueError(f"need at least one contributor, got {n}")
    return (n - 1).bit_length()


def num_chunks(numel: int, lanes: int) -> int:
    return -(-numel // lanes)


def _chunked_absmax(x: np.ndarray, lanes: int) -> np.ndarray:
    """max |x| per chunk of `lanes` (NaN where a chunk holds one): compiled, or numpy's two passes."""
    n = x.size
    out = np.empty(num_chunks(n, lanes), dtype=np.float32)
    if n and _compiled():
        _fixed_point().chunk_absmax(np.ascontiguousarray(x).view(np.uint32), lanes, out.view(np.uint32))
        return out
    full = n // lanes
    if full:
        out[:full] = np.abs(x[: full * lanes].reshape(full, lanes)).max(axis=1)
    if n > full * lanes:
        out[full] = np.abs(x[full * lanes:]).max()
    return out


def chunk_exponents(x: np.ndarray, lanes: int) -> np.ndarray:
    """Per-chunk exponent e with max|x| < 2^e (int32 array; EXP_MIN for all-zero chunks).

    A chunk holding Inf or NaN gets EXP_MAX: its finite values still quantise, and the
    non-finite ones are clipped and reported as saturated.
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size and _compiled():  # one pass over x, the exponents read off the bits (the code below is the reference)
        out = np.empty(num_chunks(x.size, lanes), dtype=np.int32)
        return _fixed_point().chunk_exponents(np.ascontiguousarray(x).view(np.uint32), lanes, EXP_MIN, EXP_MAX, out)
    amax = _chunked_absmax(x, lanes)
    finite = np.isfinite(amax)
    _, e = np.frexp(np.where(finite, amax, 0).astype(np.float32))
    e = np.where(amax == 0, EXP_MIN, e)
    e = np.where(finite, e, EXP_MAX)
    return np.clip(e, EXP_MIN, EXP_MAX).astype(np.int32)


def quantize(x: np.ndarray, exps: np.ndarray, lanes: int, n: int, out: np.ndarray | None = None):
    """Quantise float32 `x` with agreed per-chunk exponents for a sum over `n` contributors.

    Returns (q, saturated): q is int32 of length chunks*lanes (the tail padded with zeros),
    saturated a bool per chunk that is True where a value had to be clipped (non-finite, or
    not below 2^e).
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    chunks = num_chunks(x.size, lanes)
    if exps.shape != (chunks,):
        raise ValueError(f"need {chunks} exponents for {x.size} elements of {lanes} lanes, got {exps.shape}")
    c = contributor_bits(n)
    lim = float(2 ** (31 - c) - 1)
    padded = np.zeros(chunks * lanes, dtype=np.float32)
    padded[: x.size] = x
    scaled = padded.reshape(chunks, lanes)
    scale_pow2(scaled, 31 - c - exps.astype(np.int32))
    np.rint(scaled, out=scaled)
    bad = ~(np.abs(scaled) <= lim)  # also catches NaN
    saturated = bad.any(axis=1)
    if saturated.any():
        scaled[np.isnan(scaled)] = 0
        np.clip(scaled, -lim, lim, out=scaled)
    q = out if out is not None else np.empty(chunks * lanes, dtype=np.int32)
    q.reshape(chunks, lanes)[...] = scaled
    return q, saturated


def sum_shift(exps: np.ndarray, n: int) -> np.ndarray:
    """The power of two that turns a chunk's fixed-point sum back into float32: a sum over `n`
    contributors quantised with exponent e holds x * 2^(31 - c - e), c = contributor_bits(n)."""
    return np.asarray(exps).astype(np.int64) + contributor_bits(n) - 31


def dequantize(qsum: np.ndarray, exps: np.ndarray, lanes: int, n: int, numel: int) -> np.ndarray:
    """Sum in fixed point -> float32 (one rounding: int32 to binary32; the scaling is exact).

    The readable reference of `dequantize_rows_into`, which the engine and the node use on packet rows."""
    chunks = num_chunks(numel, lanes)
    q = np.asarray(qsum).reshape(-1)[: chunks * lanes].reshape(chunks, lanes)
    out = q.astype(np.float32)
    with np.errstate(over="ignore"):  # a sum of N values below 2^127 may pass 2^128: inf, as IEEE rounds it
        scale_pow2(out, sum_shift(exps, n))
    return out.reshape(-1)[:numel]


_PRECISION = {"float32": 24, "float16": 11, "bfloat16": 8}


def _ulp(values: np.ndarray, precision: int) -> np.ndarray:
    a = np.abs(values.astype(np.float64))
    _, e = np.frexp(np.where(a > 0, a, 1.0))
    return np.ldexp(1.0, e - precision)


def error_bound(result: np.ndarray, exps: np.ndarray, lanes: int, n: int, out_dtype: str = "float32") -> np.ndarray:
    """Per-element bound on |result - exact sum| (docs/protocol.md, 5)."""
    numel = result.size
    c = contributor_bits(n)
    quantum = np.repeat(np.ldexp(1.0, exps.astype(np.int64) + c - 31), lanes)[:numel]
    bound = n * quantum / 2 + _ulp(result, 24) / 2
    if out_dtype != "float32":
        bound = bound + _ulp(result, _PRECISION[out_dtype]) / 2
    return bound


# --- order-preserving encoding for MAX/MIN ---------------------------------------------------

def to_ordered(x: np.ndarray) -> np.ndarray:
    """binary32 -> int32 whose signed order is the float order (an involution on the bits)."""
    bits = np.asarray(x, dtype=np.float32).view(np.int32)
    return bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))  # = where(bits >= 0, bits, bits ^ 0x7FFFFFFF), one pass


def from_ordered(i: np.ndarray) -> np.ndarray:
    i = np.asarray(i, dtype=np.int32)
    return (i ^ ((i >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)


def negate_order(i: np.ndarray) -> np.ndarray:
    """Order-reversing, overflow-free map on int32 (~i): MIN is MAX of negated keys."""
    return np.invert(np.asarray(i, dtype=np.int32))


def exponent_error_hint(max_abs: float, n: int) -> float:
    """Worst-case absolute error for a chunk whose largest magnitude is max_abs (docs, tools)."""
    if max_abs == 0:
        return 0.0
    e = math.frexp(max_abs)[1]
    return n * math.ldexp(1.0, e + contributor_bits(n) - 31) / 2


# --- scaling by powers of two -----------------------------------------------------------------
# x * 2^k with a float32 multiply is exactly ldexp(x, k) (one correctly rounded result; libm's
# scalbnf per element costs 3-6x more) as long as 2^k is a normal float32. A shift outside
# [-126, 127] is split into two factors; the first multiply is then exact (its result stays
# normal, or overflows to inf, which the second cannot undo), so the second rounds once, as
# ldexp does. tests/engine/test_kernels.py checks this against np.ldexp bit for bit.

POW2_LO, POW2_HI = -126, 127
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # the ufuncs, without ndarray.min's Python wrapper


def pow2_split(k: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per-chunk shifts k (int) -> float32 factors (s1, s2) with s1 * s2 == 2^k, and whether any s2 != 1."""
    k = np.asarray(k, dtype=np.int64)
    if k.size and _MIN(k) >= POW2_LO and _MAX(k) <= POW2_HI:
        # the common case, one factor: 2^k is a normal float32, whose bits are its biased exponent
        # (exactly np.ldexp(1, k)), without np.clip's Python wrapper (which asks np.iinfo) and ldexp
        return ((k.astype(np.int32) + 127) << 23).view(np.float32), np.ones(k.shape, np.float32), False
    k1 = np.clip(k, POW2_LO, POW2_HI)
    one = np.float32(1)
    s1 = np.ldexp(one, k1.astype(np.int32)).astype(np.float32)  # per chunk, not per element
    two = bool((k1 != k).any())
    s2 = np.ldexp(one, (k - k1).astype(np.int32)).astype(np.float32) if two else np.ones(k.shape, np.float32)
    return s1, s2, two


def scale_pow2(values: np.ndarray, k: np.ndarray) -> None:
    """values (chunks, lanes) float32 *= 2^k[chunk], in place, bit-identical to np.ldexp."""
    s1, s2, two = pow2_split(k)
    values *= s1[:, None]
    if two:
        values *= s2[:, None]


# --- fused packet paths: compiled when dataplane/kernels says so, numpy otherwise ------------

def quantize_factors(exps: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The float32 factors (s1, s2) that scale a chunk with exponent e for a sum over `n`
    contributors (by 2^(31 - c - e), `pow2_split`): what `quantize_into_rows` takes as `factors`,
    computed once per buffer instead of once per block."""
    s1, s2, _ = pow2_split(31 - contributor_bits(n) - np.asarray(exps, dtype=np.int64))
    return s1, s2


def quantize_into_rows(x: np.ndarray, exps: np.ndarray, lanes: int, n: int, rows: np.ndarray, col: int,
                       factors: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """quantize(x, exps, lanes, n) written big-endian into packet rows: chunk r's lanes at bytes
    [col, col + 4 * lanes) of rows[r]. Returns the per-chunk saturated flags. `x` may be short
    (the buffer's tail): the rest of the last chunk is zeros. `factors`: `quantize_factors(exps, n)`
    if the caller has them (the same values; the compiled path then skips computing them)."""
    chunks = len(exps)
    if _compiled():
        words = _as_words(rows, col)
        if words is not None:
            c = contributor_bits(n)
            s1, s2 = factors if factors is not None else quantize_factors(exps, n)
            sat = np.zeros(chunks, dtype=np.bool_)
            x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
            return _fixed_point().quantize_rows(x, s1, s2, np.float32(2 ** (31 - c) - 1), words, rows.shape[1] // 4,
                                                col // 4, lanes, sat)
    q, sat = quantize(x, np.asarray(exps), lanes, n)
    rows[:chunks, col:col + 4 * lanes].view(">i4")[...] = q.reshape(chunks, lanes)
    return sat


def dequantize_rows_into(rows: np.ndarray, sel: np.ndarray, col: int, lanes: int, shift: np.ndarray,
                         chunk: np.ndarray, out: np.ndarray) -> None:
    """out[chunk[i]] = (big-endian int32 lanes at byte `col` of rows[sel[i]]) as float32 * 2^shift[i].

    The receive side's decode-and-scatter of fixed-point sums (float32 overflow gives inf, as
    IEEE rounds it; callers decide what that means)."""
    s1, s2, _ = pow2_split(shift)
    dequantize_rows_scaled(rows, sel, col, lanes, s1, s2, chunk, out)


def dequantize_rows_scaled(rows: np.ndarray, sel: np.ndarray, col: int, lanes: int, s1: np.ndarray, s2: np.ndarray,
                           chunk: np.ndarray, out: np.ndarray) -> None:
    """`dequantize_rows_into` with the shifts given as their factors (`pow2_split(shift)`'s s1, s2,
    per selected row): for a caller that splits each chunk's shift once per buffer, not per batch."""
    if _compiled():
        words = _as_words(rows, col)
        if words is not None and out.flags.c_contiguous and out.dtype == _F32:
            _fixed_point().dequantize_rows(words, rows.shape[1] // 4, col // 4, lanes, np.asarray(sel, dtype=np.int64),
                                           s1, s2, np.asarray(chunk, dtype=np.int64), out.reshape(-1))
            return
    vals = rows[sel, col:col + 4 * lanes].view(">i4").astype(np.float32)
    with np.errstate(over="ignore"):  # exactly scale_pow2: s2 is 1 (an exact multiply) unless the shift was split
        vals *= s1[:, None]
        vals *= s2[:, None]
    out[chunk] = vals


def warm_up() -> None:
    """Load the compiled kernels now (numba's import and its on-disk cache, ~0.3 s), off the
    datapath: the engine calls this in a background thread at start, so its first float sum does
    not stall while the other workers' timers run. A no-op with LUWU_KERNELS=reference."""
    from .process.usage import UserError

    try:
        if not _compiled():
            return
    except UserError:
        return  # a bad LUWU_KERNELS: the first operation reports it, in one line, to its caller
    chunk_exponents(np.ones(1, np.float32), 1)
    rows = np.zeros((1, 8), dtype=np.uint8)
    quantize_into_rows(np.ones(1, np.float32), np.ones(1, np.int32), 1, 1, rows, 4)
    dequantize_rows_into(rows, np.zeros(1, np.int64), 4, 1, np.zeros(1, np.int64), np.zeros(1, np.int64),
                         np.zeros((1, 1), np.float32))
    _fixed_point().widen_bf16_rows(np.zeros((1, 2), np.uint16), 0, 1, 1, 1, np.zeros(1, np.uint32), 0, 1)  # PARAM decode
    _fixed_point().widen_bf16(np.zeros(1, np.uint16), np.zeros(1, np.uint32))  # a staged pull's completion
    # every fill's and RESULT's check words (engine/packets.py check_words_of): else loaded on the packet thread
    _fixed_point().check_words32(rows.reshape(-1).view(np.uint32), 2, 1, 1, np.zeros(1, np.int64),
                                 np.zeros((1, 32), np.uint8), np.zeros(1, np.int64), np.zeros(11, np.int64),
                                 np.ones(11, np.int64), np.zeros((2, 11), np.uint32), 1, 1, 2, 1, 0,
                                 np.zeros((1, 2), np.uint64), np.zeros(0, np.bool_))
    f32 = np.ones(1, np.float32)  # and a fill's quantise-and-check pass (engine/packets.py QuantizedLanes.write_checked)
    _fixed_point().quantize_rows_checked(f32, f32, f32, np.float32(1), rows.reshape(-1).view(np.uint32), 2, 0, 0,
                                         np.zeros(1, np.bool_), np.zeros((1, 32), np.uint8), np.zeros(11, np.int64),
                                         np.ones(11, np.int64), np.zeros((2, 11), np.uint32), 1, 1, 2)
    one = np.ones(1, np.float32)  # the engine's RESULT pass: a batch it refuses (k=1, window of 1, seq 0 != ack 1)
    _fixed_point().absorb_fixed_results(np.zeros(32, np.uint8), 32, 1, 8, 16, 20, 1, np.uint8(1), np.zeros(1, np.bool_),
                                        1, 0, 1, 1, rows.reshape(-1).view(np.uint32), 2, 1, one, one, one, 1,
                                        np.zeros(0, np.float32), np.zeros(1, np.bool_), np.zeros(1, np.int64), 0,
                                        np.zeros(1, np.int64), np.zeros(4, np.int64))
    # a float sum's whole RESULT batch (engine/collective.py `on_result_batch`), refused the same way
    # (a length that is not its count's), with and without the header checks; and a fill's sealing
    from .integrity import HEADER_CHECK_TABLE

    i64 = np.zeros(1, np.int64)
    for table in ((np.zeros(0, np.uint16), np.zeros(0, np.intp)), HEADER_CHECK_TABLE):
        _fixed_point().absorb_checked_results(
            np.zeros(32, np.uint8), 32, 1, i64, 8, 16, 20, 1, 6, 28, 24, 12, 4, 64, 66, np.zeros(11, np.int64),
            np.ones(11, np.int64), np.zeros((2, 11), np.uint32), 1, 1, 2, np.zeros(1, np.bool_), 0, 0, 1, 1, 1,
            rows.reshape(-1).view(np.uint32), 2, 8, one, one, one, 1, np.zeros(0, np.float32), np.zeros(1, np.bool_),
            i64, 0, i64, np.zeros(4, np.int64), *table, 26, np.zeros(32, np.uint8))
    _fixed_point().seal_rows32(np.zeros((1, 32), np.uint8), np.zeros(1, np.bool_), 1, np.uint8(4), *HEADER_CHECK_TABLE,
                               26, np.zeros(32, np.uint8), 32)
    # FIXED16 packets' header terms (fixed16.header_terms: every fill and received batch)
    from .kernels import fixed16_rows

    fixed16_rows.header_terms16(np.zeros((1, 32), np.uint8), np.zeros(11, np.int64), np.ones(11, np.int64),
                                  np.zeros((4, 11), np.uint32), 6, 1, 2, np.zeros((1, 4), np.uint32))
    # and a FIXED16 sum's (collective.py `_compiled_results16`), refused the same way
    fixed16_rows.absorb_fixed16_results(np.zeros(32, np.uint8), 32, 1, 8, 16, 20, 1, 21, 6, 28, np.uint8(1), 6,
                                          np.zeros(1, np.bool_), 1, 0, 1, 1, 1, rows.reshape(-1).view(np.uint16), 4,
                                          16, 8, 1, 1, 1, np.zeros((1, 4), np.uint32), np.ones(1), 0, one,
                                          np.zeros(1, np.bool_), np.zeros(1, np.int64), 0, np.zeros(1, np.int64),
                                          np.zeros(4, np.int64))


def _compiled() -> bool:
    return use_numba()  # asked on every call: the mode may change (tests switch LUWU_KERNELS)


_FIXED_POINT = None
_U8, _F32 = np.dtype(np.uint8), np.dtype(np.float32)  # compared per call: a dtype, not a type numpy converts


def _fixed_point():
    """dataplane/kernels/fixed_point.py, imported on first use (it imports numba), then kept."""
    global _FIXED_POINT
    if _FIXED_POINT is None:
        from .kernels import fixed_point

        _FIXED_POINT = fixed_point
    return _FIXED_POINT


def _as_words(rows: np.ndarray, col: int) -> np.ndarray | None:
    """A C-contiguous uint8 (K, W) buffer as its flat uint32 words (no copy), or None if it is not
    one or is not word-aligned (the numpy path then runs)."""
    if rows.ndim != 2 or rows.dtype != _U8 or rows.shape[1] % 4 or col % 4 or not rows.flags.c_contiguous:
        return None
    words = rows.reshape(-1).view(np.uint32)
    return words if words.flags.aligned else None  # aligned: the view's address is a multiple of 4


# for the engine's compiled RESULT pass (dataplane/engine/collective.py), which reads rows the same way
as_words = _as_words
fixed_point_kernels = _fixed_point


# --- FIXED16: 16-bit values with an exponent per block (docs/protocol.md 5.2) ----------------
# The readable references; dataplane/kernels/fixed_point.py has their compiled twins
# (`quantize16_rows`, `dequantize16_rows`), bit for bit (tests/engine/test_fixed16.py).

FIXED16_MAX_CONTRIBUTORS = 255  # n * e of every exponent lane (|e| <= 128) fits an int16 sum


def fixed16_bits(n: int) -> int:
    """c = ceil(log2(n)) for a FIXED16 sum over `n` contributors (at most 255: the summed exponent
    lanes are int16 and must hold n * e exactly)."""
    if n > FIXED16_MAX_CONTRIBUTORS:
        raise ValueError(f"the 16-bit gradient format sums at most {FIXED16_MAX_CONTRIBUTORS} contributors, "
                         f"not {n}: use the 32-bit format (fixed32)")
    return contributor_bits(n)


def block_exponents(x: np.ndarray, block: int) -> np.ndarray:
    """Per-block exponents of the FIXED16 format: `chunk_exponents` over blocks of `block` elements
    (max |x| < 2^e per block, EXP_MIN for an all-zero block, EXP_MAX for one holding inf/NaN)."""
    return chunk_exponents(x, block)


def quantize16_factors(exps: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the float32 factors (s1, s2) with s1 * s2 = 2^(15 - c - e) (`pow2_split`)."""
    s1, s2, _ = pow2_split(15 - fixed16_bits(n) - np.asarray(exps, dtype=np.int64))
    return s1, s2


def quantize16(x: np.ndarray, exps: np.ndarray, block: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantise float32 `x` to FIXED16 with agreed per-block exponents, for a sum over `n`.

    `q = clip(rint(x * 2^(15 - c - e_b)), -(2^(15-c) - 1), 2^(15-c) - 1)`, c = ceil(log2 n), so a
    sum of n lanes always fits int16.

    Args:
        x: float32 values (any length; the last block is padded with zeros).
        exps: one agreed exponent per block of `block` elements (int).
        block: elements per exponent (integrity.FIXED16_BLOCK on the wire).
        n: contributors of the sum (1..255).

    Returns:
        (q, saturated): q int16 of blocks * block lanes; saturated a bool per block, True where a
        value was non-finite or not below 2^e_b (the block then takes the exact fallback, as a
        saturated FIXED32 chunk does). A finite value below 2^e_b whose rounding reaches 2^(15-c)
        is clipped to the limit without the flag: an error under one quantum (`error_bound16`).
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    blocks = num_chunks(x.size, block)
    exps = np.asarray(exps)
    if exps.shape != (blocks,):
        raise ValueError(f"need {blocks} exponents for {x.size} elements in blocks of {block}, got {exps.shape}")
    c = fixed16_bits(n)
    top = np.float32(2 ** (15 - c))
    lim = np.float32(2 ** (15 - c) - 1)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[: x.size] = x
    scaled = padded.reshape(blocks, block)
    with np.errstate(over="ignore", invalid="ignore"):
        scale_pow2(scaled, 15 - c - exps.astype(np.int64))
        saturated = np.asarray((~(np.abs(scaled) < top)).any(axis=1), dtype=bool)  # non-finite, or |x| >= 2^e
        np.rint(scaled, out=scaled)
    scaled[np.isnan(scaled)] = 0
    np.clip(scaled, -lim, lim, out=scaled)
    return scaled.astype(np.int16).reshape(-1), saturated


def dequant16_shift(exps: np.ndarray, n: int) -> np.ndarray:
    """The power of two that turns a block's FIXED16 sum into its float value: e + c - 15."""
    return np.asarray(exps).astype(np.int64) + fixed16_bits(n) - 15


def dequantize16(qsum: np.ndarray, exps: np.ndarray, block: int, n: int, numel: int) -> np.ndarray:
    """A FIXED16 sum (int lanes, blocks * block) -> float32: `sum * 2^(e_b + c - 15)` exactly in
    float64, then rounded once (overflow past binary32 gives inf, as IEEE rounds it)."""
    blocks = num_chunks(numel, block)
    q = np.asarray(qsum).reshape(-1)[: blocks * block].reshape(blocks, block).astype(np.float64)
    scale = np.ldexp(1.0, dequant16_shift(exps, n)[:blocks].astype(np.int32))
    with np.errstate(over="ignore"):
        return (q * scale[:, None]).astype(np.float32).reshape(-1)[:numel]


def error_bound16(result: np.ndarray, exps: np.ndarray, block: int, n: int, out_dtype: str = "float32") -> np.ndarray:
    """Per-element bound on |result - exact sum| of an unsaturated FIXED16 sum: `n * u + ulp_out / 2`,
    u = 2^(e_b + c - 15) (each contributor's rounding is at most half a quantum, and at most one
    quantum for a value clipped at the top of its block's range)."""
    numel = result.size
    quantum = np.repeat(np.ldexp(1.0, dequant16_shift(exps, n)), block)[:numel]
    bound = n * quantum + _ulp(result, 24) / 2
    if out_dtype != "float32":
        bound = bound + _ulp(result, _PRECISION[out_dtype]) / 2
    return bound
