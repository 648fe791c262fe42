"""The wire's integrity codes, as reference code: the header check, the check words that survive
in-network aggregation, the PARAM/PULL trailer, and the self-checking exponent lanes.

docs/protocol.md 3.5-3.8 specifies them; this module is their executable reference. Fast paths
(the engine's kernels, the software switch's batch paths, the P4 programs) must agree with these
functions bit for bit, and tests compare them against it. Everything here is plain numpy or
Python, written to be read, not to be fast.

Summary (protocol version 2):

* **Header check** (`hcheck`, bytes 26..27, every message type): CRC-16/ARC of the 30 other
  header bytes. Hop by hop: every receiver verifies it, the switch recomputes it on what it emits.
* **Check words** (aggregation types): the last `check_lanes(dtype)` lanes of the payload. Linear
  in the lanes modulo the lane width, so the switch sums them like data and the receiver of a sum
  verifies the sum: `c_j = sum_k w_j(k) * v_k + n * T_j  (mod 2^W)`, where `v` are the lanes before
  the check words, `n` the contributor count and `T_j` a term binding the header fields the
  switch keeps (and, for FIXED16, the block exponents). MAX packets carry `c_j = T_j` only.
* **Trailer** (PARAM, PULL): a CRC-32 of the payload after it, end to end.
* **Exponent lanes** of the agreement round (a MAX of int32 lanes): `e << 16 | exp_tag(e)`, so
  the lane that wins a max carries its own check.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .protocol import (
    HCHECK_OFFSET,
    HCHECK_TABLES,
    HEADER_LEN,
    LANE_CHUNK,
    TRAILER_LEN,
    Dtype,
    Flag,
    MsgType,
    header_check_fast,
    header_ok,
    sealed,
)

# protocol.py's scalar header-check forms are part of this module's API too
__all__ = ["HCHECK_OFFSET", "TRAILER_LEN", "header_check_fast", "header_ok", "sealed"]

FIXED16_BLOCK = 112  # elements per shared exponent of the FIXED16 format (docs/protocol.md 5.2: the most, in 16s, a 64-lane packet holds)
CHECK_BITS = 64  # bits of check words per aggregation packet, whatever the lane width

# --- header check: CRC-16/ARC (poly 0x8005 reflected, init 0, no final xor; P4 crc16) ---------

_CRC16_TABLE = np.zeros(256, dtype=np.uint16)
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0xA001 if _c & 1 else _c >> 1
    _CRC16_TABLE[_i] = _c


def crc16_arc(data: bytes) -> int:
    """CRC-16/ARC of `data` (check value of b"123456789" is 0xBB3D)."""
    crc = 0
    for b in data:
        crc = (crc >> 8) ^ int(_CRC16_TABLE[(crc ^ b) & 0xFF])
    return crc


def header_check(header: bytes | memoryview) -> int:
    """The hcheck value of a 32-byte header: CRC-16/ARC of bytes 0..25 and 28..31."""
    h = bytes(header[:HEADER_LEN])
    return crc16_arc(h[:HCHECK_OFFSET] + h[HCHECK_OFFSET + 2:HEADER_LEN])


def header_checks_reference(rows: np.ndarray) -> np.ndarray:
    """hcheck of each row of a (K, >=32) uint8 array, byte after byte as `crc16_arc` (uint16)."""
    crc = np.zeros(rows.shape[0], dtype=np.uint16)
    for col in _HC_COLS.tolist():
        crc = (crc >> 8) ^ _CRC16_TABLE[(crc ^ rows[:, col]) & 0xFF]
    return crc


# The fast forms (protocol.py's scalar `header_check_fast`, and `header_checks` below) use the
# CRC's linearity: a header's check is the xor of each covered byte's contribution at its
# position (protocol.HCHECK_TABLES), gathered with no byte-to-byte dependency. They equal
# `crc16_arc` bit for bit (tests/engine/test_header_check.py).
_HC_COLS = np.array([*range(HCHECK_OFFSET), *range(HCHECK_OFFSET + 2, HEADER_LEN)], dtype=np.intp)
_HC_TABLE = np.array(HCHECK_TABLES, dtype=np.uint16)
_HC_FLAT = _HC_TABLE.ravel()
_HC_BASE = (np.arange(len(_HC_COLS)) * 256).astype(np.uint16)  # byte p's entries start at p * 256
_HC_XOR = np.bitwise_xor.reduce
HEADER_CHECK_TABLE = (_HC_FLAT, _HC_COLS)  # for a compiled twin of `header_checks` (kernels/fixed_point.py)


def header_checks(rows: np.ndarray) -> np.ndarray:
    """hcheck of each row of a (K, >=32) uint8 array (vectorised over rows; uint16)."""
    idx = np.concatenate((rows[:, :HCHECK_OFFSET], rows[:, HCHECK_OFFSET + 2:HEADER_LEN]), axis=1).astype(np.uint16)
    idx += _HC_BASE
    return _HC_XOR(_HC_FLAT[idx], axis=1)


def seal_header(buf: bytearray | memoryview | np.ndarray, off: int = 0) -> None:
    """Write hcheck into bytes off+26..off+27 of one header in a writable buffer, in place."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else None
    if mv is None:
        assert isinstance(buf, np.ndarray)
        c = header_check_fast(buf[off:off + HEADER_LEN].tobytes())
        buf[off + HCHECK_OFFSET] = c >> 8
        buf[off + HCHECK_OFFSET + 1] = c & 0xFF
        return
    c = header_check_fast(mv[off:off + HEADER_LEN])
    mv[off + HCHECK_OFFSET] = c >> 8
    mv[off + HCHECK_OFFSET + 1] = c & 0xFF


def seal_headers(rows: np.ndarray) -> None:
    """Write hcheck into bytes 26..27 (big-endian) of each row, in place."""
    c = header_checks(rows)
    rows[:, HCHECK_OFFSET] = c >> 8
    rows[:, HCHECK_OFFSET + 1] = c & 0xFF


def seal_rows(rows: np.ndarray, idx: np.ndarray | list[int], off: int = 0) -> None:
    """Seal the headers at column `off` of rows `idx` of a (K, >=off+32) uint8 array, in place
    (one row at a time on Python ints for a few rows, vectorised otherwise)."""
    if len(idx) <= 4:
        for i in (idx.tolist() if isinstance(idx, np.ndarray) else idx):
            seal_header(rows[i], off)
        return
    sub = rows[idx, off:off + HEADER_LEN]
    c = header_checks(sub)
    rows[idx, off + HCHECK_OFFSET] = c >> 8
    rows[idx, off + HCHECK_OFFSET + 1] = c & 0xFF


def headers_ok(rows: np.ndarray) -> np.ndarray:
    """Bool per row: its hcheck matches."""
    got = (rows[:, HCHECK_OFFSET].astype(np.uint16) << 8) | rows[:, HCHECK_OFFSET + 1]
    return got == header_checks(rows)


# --- PARAM / PULL trailer --------------------------------------------------------------------

def trailer(payload: bytes | memoryview) -> bytes:
    """The 4-byte trailer of a PARAM or PULL payload (CRC-32, zlib's, big-endian)."""
    return zlib.crc32(payload).to_bytes(4, "big")


def trailers_ok(rows: np.ndarray, idx: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Bool per packet `rows[i, :lens[i]]` (i in idx): its trailer matches its payload."""
    out = np.zeros(len(idx), dtype=bool)
    for j, (i, n) in enumerate(zip(np.asarray(idx).tolist(), np.asarray(lens).tolist())):
        if n >= HEADER_LEN + TRAILER_LEN:
            row = rows[i]
            out[j] = zlib.crc32(row[HEADER_LEN:n - TRAILER_LEN]) == int.from_bytes(row[n - TRAILER_LEN:n].tobytes(), "big")
    return out


def trailer_ok(packet: bytes | memoryview) -> bool:
    """A PARAM/PULL packet's trailer matches its payload (bytes 32..-4)."""
    return len(packet) >= HEADER_LEN + TRAILER_LEN and trailer(packet[HEADER_LEN:-TRAILER_LEN]) == bytes(packet[-4:])


# --- lane widths and layouts ----------------------------------------------------------------

def lane_bytes(dtype: int) -> int:
    """Bytes per lane of an aggregation payload: 4 for every dtype (FIXED16 packs two int16 values
    into each int32 lane, docs/protocol.md 5.2)."""
    return 4


def check_word_bits(dtype: int) -> int:
    """Bits of one check word: 16 for FIXED16 (each in the high half of its own lane), else 32."""
    return 16 if dtype == Dtype.FIXED16 else 32


def check_lanes(dtype: int) -> int:
    """Lanes at the end of an aggregation payload that hold check words: 2 of 32 bits, or 4 of 16
    for FIXED16 (one word in the high half of each of 4 lanes, the low half 0)."""
    return CHECK_BITS // check_word_bits(dtype)


def fixed16_slots(lanes: int) -> int:
    """int16 values (slots) in a FIXED16 packet of `lanes` 32-bit lanes: lane k holds slots 2k (high
    half) and 2k + 1 (low half) as `hi * 2^16 + lo`."""
    return 2 * lanes


def fixed16_blocks(lanes: int) -> int:
    """Exponent blocks in one FIXED16 packet of `lanes` lanes: nb exponent slots, then nb blocks of
    FIXED16_BLOCK data slots, padding, then the check lanes' 8 slots (nb * (BLOCK + 1) + 8 <= 2 * lanes)."""
    return max(0, (fixed16_slots(lanes) - 2 * check_lanes(Dtype.FIXED16)) // (FIXED16_BLOCK + 1))


# the fewest lanes that hold one FIXED16 block: its exponent slot, its data slots, the check lanes; a
# narrower switch gets FIXED32 (engine.py)
FIXED16_MIN_LANES = -(-(FIXED16_BLOCK + 1) // 2) + check_lanes(Dtype.FIXED16)


_FIXED16, _MAX = int(Dtype.FIXED16), int(Flag.MAX)  # plain ints: numpy arithmetic with enum members is slow
_CHECKS16, _CHECKS32 = CHECK_BITS // 16, CHECK_BITS // 32  # check lanes of FIXED16, of the 32-bit dtypes


def wire_lanes(count: Any, dtype: Any, flags: Any, lanes: int) -> Any:
    """Lanes an aggregation packet of `count` elements carries (docs/protocol.md 3.3): the fewest
    whole chunks of LANE_CHUNK lanes that hold its data, exponent and check lanes, at most the
    switch's `lanes` (a packet of as many lanes as the switch has is whole whatever its count).
    Data lanes: `count`, then `check_lanes(dtype)`; FIXED16 (two int16 slots per lane): `count` data
    slots after the `fixed16_blocks(lanes)` exponent slots (an exponent agreement, FIXED16 with MAX:
    one exponent per lane, no exponent slots), then the check lanes' 8 slots. Every contributor of a slot
    computes the same from the same header; the switch checks each packet's length against it.
    Works on ints and on numpy arrays alike (the switch's classifier)."""
    if type(count) is int and type(flags) is int:  # one packet's, on Python ints: the same arithmetic
        if dtype == _FIXED16:
            slots = (2 * count if flags & _MAX else count + fixed16_blocks(lanes)) + 2 * _CHECKS16
            need = -(-slots // 2)
        else:
            need = count + _CHECKS32
        return min(lanes, -(-need // LANE_CHUNK) * LANE_CHUNK)
    f16 = dtype == _FIXED16
    max_ = (flags & _MAX) != 0
    nb = fixed16_blocks(lanes)
    slots = np.where(max_, 2 * count, count + nb) + 2 * _CHECKS16  # FIXED16: int16 slots, two per lane
    need = np.where(f16, -(-slots // 2), count + _CHECKS32)
    out = np.minimum(lanes, -(-need // LANE_CHUNK) * LANE_CHUNK)
    return int(out) if np.ndim(out) == 0 else out


def wire_len(count: Any, dtype: Any, flags: Any, lanes: int) -> Any:
    """Bytes (header + payload) of an aggregation packet of `count` elements: 32 + 4 *
    `wire_lanes` (ZERO packets aside: 32). Ints or numpy arrays, as `wire_lanes`."""
    out = HEADER_LEN + 4 * wire_lanes(count, dtype, flags, lanes)
    return int(out) if np.ndim(out) == 0 else out


def data_lanes(lanes: int, dtype: int) -> int:
    """Lanes of data elements per aggregation packet on a switch of `lanes` lanes."""
    if dtype == Dtype.FIXED16:
        return fixed16_blocks(lanes) * FIXED16_BLOCK
    return lanes - check_lanes(dtype)


# --- check words ----------------------------------------------------------------------------

# multipliers of the header term, one row per check word: (session, seq, slot, tensor, offset,
# count, numel, dtype, set_max_flags, exponent, stream). Odd 32-bit constants.
_T_MULT = np.array([
    [0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646D, 0xFD7046C5, 0xB55A4F09, 0x7FEB352D,
     0x846CA68B, 0x2C1B3C6D],
    [0x297A2D39, 0xAC4C1B51, 0x68E31DA5, 0x9FB21C65, 0xE8B67F71, 0x4CF5AD43, 0x61C88647, 0x3C6EF373, 0xDAA66D2B,
     0x5851F42D, 0xF1357AEB],
    [0x1B873593, 0xCC9E2D51, 0xE6546B65, 0x38495AB5, 0x94D049BB, 0xBF58476D, 0xC6A4A793, 0x5BD1E995, 0x7A646E4D,
     0x3243F6A9, 0x8F1BBCDD],
    [0x6A09E667, 0xBB67AE85, 0x3C6EF373, 0xA54FF53B, 0x510E527F, 0x9B05688D, 0x1F83D9AB, 0x5BE0CD19, 0xCBBB9D5D,
     0x629A292B, 0x9159015A | 1],
], dtype=np.uint64)


def stream_of(msg_type: int) -> int:
    """GRAD and AGG are one stream (1), ALLREDUCE and RESULT another (3): the switch turns one
    type into the other, so the header term uses the stream, not the type."""
    return 1 if msg_type in (MsgType.GRAD, MsgType.AGG) else 3


def header_term(h: dict, dtype: int) -> np.ndarray:
    """T_j for a header given as a dict of DATA_HEADER fields (plus `type`): uint64 array of
    `check_lanes(dtype)` words, reduced mod 2^W. INT32 has T = 0 (a ZERO packet, all zeros, must
    be a valid contribution)."""
    c = check_lanes(dtype)
    if dtype == Dtype.INT32:
        return np.zeros(c, dtype=np.uint64)
    fields = np.array([h["session"], h["seq"], h["slot"], h["tensor"], h["offset"], h["count"], h["numel"],
                       dtype, int(h["flags"]) & (Flag.SET | Flag.MAX), int(h["exponent"]) & 0xFF,
                       stream_of(h["type"])], dtype=np.uint64)
    mask = (1 << (check_word_bits(dtype))) - 1
    t = (_T_MULT[:c] * fields[None, :]) & 0xFFFFFFFF
    return (t.sum(axis=1) & 0xFFFFFFFF) & mask


def exponent_term(exps: np.ndarray, j: int) -> int:
    """FIXED16 only: G_j, a nonlinear term of a packet's block exponents (int), mod 2^16. Each
    sender adds its own; a receiver expects n times the term of the exponents it decoded, so
    contributors that used different exponents are caught even when their exponent lanes happen
    to sum to a multiple of n."""
    g = 0
    for b, e in enumerate(np.asarray(exps, dtype=np.int64).tolist()):
        x = ((b + 1) * 0x9E3779B1 + (e + 1024) * 0x85EBCA77 + j * 0xC2B2AE3D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 13
        g += x
    return g & 0xFFFF


def check_words(lanes_before: np.ndarray, h: dict, dtype: int, n: int = 1,
                exps: np.ndarray | None = None) -> np.ndarray:
    """The check words a packet carries (n = 1: what a sender writes) or that a sum of `n`
    contributions must carry (what a receiver expects).

    Args:
        lanes_before: the signed lane values before the check lanes (for FIXED16: the nb exponent
            lanes then the data lanes; for the other dtypes: the data lanes), all `lanes - C` of
            them, padding zeros included.
        h: the header fields (DATA_HEADER names plus `type`).
        dtype: the header's dtype.
        n: contributors of the sum.
        exps: FIXED16: the packet's block exponents (what each contributor used).

    Returns:
        uint64 array of C words, each reduced mod 2^W (W = check_word_bits(dtype)).
    """
    c = check_lanes(dtype)
    bits = check_word_bits(dtype)
    mask = (1 << bits) - 1
    t = header_term(h, dtype).astype(object)
    if int(h["flags"]) & Flag.MAX:
        return np.array([int(x) & mask for x in t], dtype=np.uint64)
    v = [int(x) for x in np.asarray(lanes_before).tolist()]
    out = []
    for j in range(c):
        s = sum(pow(k + 1, j, 1 << bits) * x for k, x in enumerate(v))
        g = exponent_term(exps, j) if dtype == Dtype.FIXED16 and exps is not None else 0
        out.append((s + n * (int(t[j]) + g)) & mask)
    return np.array(out, dtype=np.uint64)


# --- self-checking exponent lanes (the agreement round, a MAX of int32 lanes) ------------------

def exp_tag(e: np.ndarray) -> np.ndarray:
    """16-bit tag of exponents `e` (int array in -32768..32767)."""
    x = (np.asarray(e, dtype=np.int64) & 0xFFFF).astype(np.uint32)
    x = (x * np.uint32(0x9E37) + np.uint32(0x79B9)) & np.uint32(0xFFFF)
    x ^= x >> np.uint32(7)
    return ((x * np.uint32(0x5BD1)) & np.uint32(0xFFFF)).astype(np.uint32)


def _pack32(e: np.ndarray) -> np.ndarray:
    """`pack_exponents` computed lane by lane (the reference of its table)."""
    e64 = np.asarray(e, dtype=np.int64)
    return ((e64 << 16) | exp_tag(e64).astype(np.int64)).astype(np.int32)


# the packed lanes of the exponents a float sum uses (-128..127), indexed by e itself (numpy's
# negative indices: e = -128..-1 at 128..255): a lookup instead of exp_tag's arithmetic per lane
_LANE32 = _pack32(np.arange(256, dtype=np.int64).astype(np.int8))


def pack_exponents(e: np.ndarray) -> np.ndarray:
    """int32 lanes `e << 16 | exp_tag(e)`: signed order is e's order, so a MAX of packed lanes is
    the packed MAX, and the winner carries its own tag."""
    e = np.asarray(e)
    if e.size and e.dtype.kind in "iu" and int(e.min()) >= -128 and int(e.max()) <= 127:
        return _LANE32[e.astype(np.intp, copy=False)]  # the same bits as computing each
    return _pack32(e)


def unpack_exponents(lanes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, ok): ok is False where a lane's tag does not match its exponent."""
    v = np.asarray(lanes, dtype=np.int32)
    e = v >> 16
    if e.size and int(e.min()) >= -128 and int(e.max()) <= 127:  # a lane is valid exactly when it is e's packed lane
        return e, _LANE32[e.astype(np.intp)] == v
    v64 = v.astype(np.int64)
    e64 = v64 >> 16
    return e64.astype(np.int32), (v64 & 0xFFFF).astype(np.uint32) == exp_tag(e64)


# --- check words, vectorised over packets (the engine's senders and receivers) ----------------

_T_FIELDS = ("session", "seq", "slot", "tensor", "offset", "count", "numel")
SCALAR_TERMS = 8  # header_terms of up to this many packets on Python ints
_T_ROWS = [[int(x) for x in row] for row in _T_MULT]
_SET_MAX = int(Flag.SET | Flag.MAX)
_GRAD_AGG = (int(MsgType.GRAD), int(MsgType.AGG))


def _term_ints(rec: tuple, dtype: int, c: int) -> list[int]:
    """`header_term` of one DATA_HEADER record (its `tolist()` tuple), on Python ints."""
    vt, flags, session, _worker, count, seq, slot, tensor, offset, exponent, _dt, _hc, numel = rec
    fields = (session, seq, slot, tensor, offset, count, numel, dtype, flags & _SET_MAX, exponent & 0xFF,
              1 if vt & 0xF in _GRAD_AGG else 3)
    mask = (1 << (check_word_bits(dtype))) - 1
    return [(sum(m * f for m, f in zip(row, fields)) & 0xFFFFFFFF) & mask for row in _T_ROWS[:c]]


def header_terms(h: np.ndarray, dtype: int) -> np.ndarray:
    """`header_term` of each of K headers (a DATA_HEADER array; `type` read from ver_type) as a
    (K, check_lanes(dtype)) uint64 array, each word reduced mod 2^W. Products and sums wrap mod
    2^64, which keeps them right mod 2^32 and 2^16."""
    c = check_lanes(dtype)
    k = len(h)
    if dtype == Dtype.INT32:
        return np.zeros((k, c), dtype=np.uint64)
    if k <= SCALAR_TERMS:  # a few packets (most received batches): on Python ints, ~10x fewer calls
        return np.array([_term_ints(rec, dtype, c) for rec in h.tolist()], dtype=np.uint64).reshape(k, c)
    f = np.empty((k, len(_T_MULT[0])), dtype=np.uint64)
    for i, name in enumerate(_T_FIELDS):
        f[:, i] = h[name]
    f[:, 7] = dtype
    f[:, 8] = h["flags"] & (Flag.SET | Flag.MAX)
    f[:, 9] = h["exponent"].astype(np.int64) & 0xFF
    mtype = h["ver_type"] & 0xF
    f[:, 10] = np.where((mtype == MsgType.GRAD) | (mtype == MsgType.AGG), 1, 3)
    t = (f @ _T_MULT[:c].T) & np.uint64(0xFFFFFFFF)
    return t & np.uint64((1 << (check_word_bits(dtype))) - 1)


def check_words_rows(values: np.ndarray, h: np.ndarray, dtype: int, n: np.ndarray | int = 1) -> np.ndarray:
    """`check_words` of K packets at once: `values` (K, M) the signed lanes before the check lanes
    (any integer dtype or byte order), `h` their K headers, `n` the contributor count (scalar or
    one per packet). Returns (K, C) uint64 words mod 2^W. MAX packets get their header term only.

    Generic over the lane width (W = 16 or 32: the weights (k+1)^j are taken mod 2^W and the sums
    wrap mod 2^64, which 2^W divides)."""
    c = check_lanes(dtype)
    bits = check_word_bits(dtype)
    mask = np.uint64((1 << bits) - 1)
    t = header_terms(h, dtype)
    nn = np.asarray(n, dtype=np.uint64).reshape(-1, 1) if np.ndim(n) else np.uint64(n)
    out = (t * nn) & mask
    is_max = (h["flags"] & Flag.MAX) != 0
    if is_max.all():
        return t
    m = values.shape[1]
    v = values.astype(np.int64).view(np.uint64)  # two's complement: the sums below wrap as the lanes do
    k = np.arange(1, m + 1, dtype=np.uint64)
    w = np.empty((c, m), dtype=np.uint64)
    w[0] = 1
    for j in range(1, c):
        w[j] = (w[j - 1] * k) & mask
    s = (v @ w.T) & mask
    out = (out + s) & mask
    if is_max.any():
        out[is_max] = t[is_max]
    return out
