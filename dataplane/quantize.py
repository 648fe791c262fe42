"""Float <-> 32-bit fixed point with SwitchML's shared exponent, and the order-preserving int32
encoding used for MAX/MIN of floats (docs/protocol.md, section 5).

Everything is vectorised over a whole buffer viewed as (chunks, lanes): one chunk is one
packet's payload and has one exponent shared by all workers.
"""

from __future__ import annotations

import math

import numpy as np

EXP_MIN, EXP_MAX = -128, 127  # int8 header field; EXP_MIN marks an all-zero chunk


def contributor_bits(n: int) -> int:
    """c = ceil(log2(n)): headroom bits so that the sum of n contributions cannot overflow."""
    if n < 1:
        raise ValueError(f"need at least one contributor, got {n}")
    return (n - 1).bit_length()


def num_chunks(numel: int, lanes: int) -> int:
    return -(-numel // lanes)


def _chunked_absmax(x: np.ndarray, lanes: int) -> np.ndarray:
    n = x.size
    full = n // lanes
    out = np.empty(num_chunks(n, lanes), dtype=np.float32)
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
    scaled = np.ldexp(padded.reshape(chunks, lanes), (31 - c - exps.astype(np.int32))[:, None])
    np.rint(scaled, out=scaled)
    bad = ~(np.abs(scaled) <= lim)  # also catches NaN
    saturated = bad.any(axis=1)
    if saturated.any():
        scaled[np.isnan(scaled)] = 0
        np.clip(scaled, -lim, lim, out=scaled)
    q = out if out is not None else np.empty(chunks * lanes, dtype=np.int32)
    q.reshape(chunks, lanes)[...] = scaled
    return q, saturated


def dequantize(qsum: np.ndarray, exps: np.ndarray, lanes: int, n: int, numel: int) -> np.ndarray:
    """Sum in fixed point -> float32 (one rounding: int32 to binary32; the scaling is exact)."""
    chunks = num_chunks(numel, lanes)
    c = contributor_bits(n)
    q = np.asarray(qsum).reshape(-1)[: chunks * lanes].reshape(chunks, lanes)
    out = np.ldexp(q.astype(np.float32), (exps.astype(np.int32) + c - 31)[:, None])
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
    return np.where(bits >= 0, bits, bits ^ np.int32(0x7FFFFFFF)).astype(np.int32)


def from_ordered(i: np.ndarray) -> np.ndarray:
    i = np.asarray(i, dtype=np.int32)
    return np.where(i >= 0, i, i ^ np.int32(0x7FFFFFFF)).astype(np.int32).view(np.float32)


def negate_order(i: np.ndarray) -> np.ndarray:
    """Order-reversing, overflow-free map on int32 (~i): MIN is MAX of negated keys."""
    return np.invert(np.asarray(i, dtype=np.int32))


def exponent_error_hint(max_abs: float, n: int) -> float:
    """Worst-case absolute error for a chunk whose largest magnitude is max_abs (docs, tools)."""
    if max_abs == 0:
        return 0.0
    e = math.frexp(max_abs)[1]
    return n * math.ldexp(1.0, e + contributor_bits(n) - 31) / 2
