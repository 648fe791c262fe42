"""FIXED16 packets (docs/protocol.md 5.2): int16 values with an exponent per block, two per 32-bit lane.

Payload of a switch with L lanes (32 + 4L bytes, like every aggregation dtype): S = 2L int16
slots, lane k holding slots 2k and 2k + 1 as the int32 `hi * 2^16 + lo` (lo signed), big-endian.
A wrapping int32 sum of such lanes is `(sum hi) * 2^16 + (sum lo)`, so the switch sums FIXED16
as plain int32 lanes and the receiver splits each lane back (`unpack_slots`), exactly while every
slot's sum fits int16, which the senders' headroom guarantees. Slots: `nb = fixed16_blocks(L)`
exponent slots (block b's exponent), then nb * FIXED16_BLOCK data slots (block b: slots
nb + b*BLOCK..), zero padding, then 4 check words mod 2^16 (dataplane/integrity.py), each in the
high half of one of the last 4 lanes (low half 0, so the words' sums wrap out of the lane, never
into another slot). Packet p of a buffer carries elements [p*D, (p+1)*D), D = nb * BLOCK, and
blocks [p*nb, (p+1)*nb) of the buffer's per-block exponents. The switch sums every lane, exponent
slots included, so the receiver of a sum of n contributions reads n * e_b, divides by n and
verifies the check words. On the wire a packet with less to carry (a buffer's last, an
agreement's) is cut to the whole chunks its count needs, check lanes last (docs/protocol.md 3.3):
the sender cuts the rows encoded here (engine/packets.py `shorten_rows`) and a receiver widens
them back in a copy (engine/dispatch.py `widened`), so every function here sees the whole packet.

`encode_rows` and `decode_rows` run the compiled kernels (dataplane/kernels/fixed16_rows.py
`quantize16_rows`, `dequantize16_rows`) when kernels are on, else the numpy reference here; both
give the same bytes and bits (tests/engine/test_fixed16.py), and agree with integrity.py's
`check_words`.

Example:
    >>> from luwu.dataplane import fixed16
    >>> fixed16.layout(16000)          # exponent slots, data elements per packet
    (283, 31696)
"""

from __future__ import annotations

import numpy as np

from . import integrity
from .integrity import FIXED16_BLOCK, FIXED16_MIN_LANES, check_lanes, fixed16_blocks, fixed16_slots
from .kernels import use_numba
from .protocol import DATA_HEADER, HEADER_LEN, Dtype, Flag, MsgType
from .quantize import EXP_MAX, EXP_MIN, fixed16_bits, quantize16, quantize16_factors

CHECKS = check_lanes(Dtype.FIXED16)  # 4 lanes, a 16-bit word in the high half of each
CHECK_SLOTS = 2 * CHECKS
_MASK16 = 0xFFFF
_U8 = np.dtype(np.uint8)
_HEADER_FIELDS = DATA_HEADER.fields
assert _HEADER_FIELDS is not None
_OFFSET_AT = int(_HEADER_FIELDS["offset"][1])  # the header's element offset (bytes 20..23)
_COUNT_AT = int(_HEADER_FIELDS["count"][1])
_GRAD_STREAM = np.array([int(MsgType.GRAD), int(MsgType.AGG)], dtype=np.uint8)  # integrity.stream_of 1


def layout(lanes: int) -> tuple[int, int]:
    """(exponent lanes nb, data elements D) of one FIXED16 packet on a switch of `lanes` lanes.

    Raises:
        ValueError: `lanes` holds no block (fewer than FIXED16_MIN_LANES).
    """
    nb = fixed16_blocks(lanes)
    if nb < 1:
        raise ValueError(f"a FIXED16 packet needs at least {FIXED16_MIN_LANES} lanes, the switch has {lanes}")
    return nb, nb * FIXED16_BLOCK


def row_len(lanes: int) -> int:
    """Bytes of a FIXED16 aggregation packet on a switch of `lanes` lanes (32 + 4L, as any dtype)."""
    return HEADER_LEN + 4 * lanes


def pack_slots(slots: np.ndarray) -> np.ndarray:
    """(K, 2M) int16 slot values (any ints; their low 16 bits, two's complement) as (K, M) int32
    lanes `hi * 2^16 + lo`, lo sign-extended: what the wire carries (big-endian) and the switch sums."""
    v = np.asarray(slots, dtype=np.int64)
    lo = ((v[:, 1::2] & _MASK16) ^ 0x8000) - 0x8000
    return (((v[:, 0::2] << 16) + lo) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def unpack_slots(lanes: np.ndarray) -> np.ndarray:
    """(K, M) int32 lanes (a sum of packed lanes) as (K, 2M) int64 int16 slot values: lo = the low
    16 bits sign-extended, hi = (lane - lo) / 2^16 wrapped to int16. Exact when each slot's sum fits int16."""
    v = np.asarray(lanes).astype(np.int64)
    lo = ((v & _MASK16) ^ 0x8000) - 0x8000
    hi = ((((v - lo) >> 16) & _MASK16) ^ 0x8000) - 0x8000
    out = np.empty((v.shape[0], 2 * v.shape[1]), dtype=np.int64)
    out[:, 0::2] = hi
    out[:, 1::2] = lo
    return out


def packets(numel: int, lanes: int) -> int:
    """FIXED16 packets of a buffer of `numel` elements."""
    return -(-numel // layout(lanes)[1])


# --- the header term T_j and the exponent term G_j, vectorised over rows ----------------------

_FIELDS = ("session", "seq", "slot", "tensor", "offset", "count", "numel")


# header_terms16's field layout: byte offsets, widths (flags: the mask) and multipliers, from DATA_HEADER
_TERM_AT = np.array([int(_HEADER_FIELDS[f][1]) for f in ("session", "seq", "slot", "tensor", "offset", "count",
                                                          "numel", "dtype", "flags", "exponent", "ver_type")],
                    dtype=np.int64)
_TERM_WIDTH = np.array([int(_HEADER_FIELDS[f][0].itemsize) for f in ("session", "seq", "slot", "tensor", "offset",
                                                                     "count", "numel")]
                       + [1, int(Flag.SET | Flag.MAX), 1, 1], dtype=np.int64)
_TERM_MULT = (integrity._T_MULT[:CHECKS] & 0xFFFFFFFF).astype(np.uint32)


def header_terms(hrows: np.ndarray) -> np.ndarray:
    """`integrity.header_term(h, FIXED16)` of each (K, >=32) uint8 header row: (K, 4) uint32
    (compiled when kernels are on: kernels/fixed16_rows.py `header_terms16`, the same values)."""
    if use_numba() and hrows.dtype == _U8 and hrows.ndim == 2 and hrows.shape[1] >= HEADER_LEN:
        return kernels().header_terms16(hrows, _TERM_AT, _TERM_WIDTH, _TERM_MULT, int(Dtype.FIXED16), int(MsgType.GRAD),
                                         int(MsgType.AGG), np.empty((hrows.shape[0], CHECKS), dtype=np.uint32))
    h = hrows[:, :HEADER_LEN].copy().view(DATA_HEADER).reshape(-1)
    k = len(h)
    if k <= integrity.SCALAR_TERMS:  # a few rows (a small push, most received batches): on Python ints, ~3x faster
        return integrity.header_terms(h, Dtype.FIXED16).astype(np.uint32)
    fields = np.empty((k, 11), dtype=np.uint64)
    for i, name in enumerate(_FIELDS):
        fields[:, i] = h[name]
    fields[:, 7] = int(Dtype.FIXED16)
    fields[:, 8] = h["flags"].astype(np.uint64) & int(Flag.SET | Flag.MAX)
    fields[:, 9] = h["exponent"].view(np.uint8)
    mtype = h["ver_type"] & 0xF
    fields[:, 10] = np.where(np.isin(mtype, _GRAD_STREAM), 1, 3)
    t = (integrity._T_MULT[None, :CHECKS, :] * fields[:, None, :]) & 0xFFFFFFFF
    return ((t.sum(axis=2) & 0xFFFFFFFF) & _MASK16).astype(np.uint32)


def exponent_terms(exps: np.ndarray) -> np.ndarray:
    """`integrity.exponent_term(exps[r], j)` for each row r of (K, nb) exponents: (K, 4) uint64."""
    e = np.asarray(exps, dtype=np.int64)
    b = np.arange(1, e.shape[1] + 1, dtype=np.uint64)[None, :]
    out = np.empty((e.shape[0], CHECKS), dtype=np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    for j in range(CHECKS):
        x = (b * np.uint64(0x9E3779B1) + (e + 1024).astype(np.uint64) * np.uint64(0x85EBCA77)
             + np.uint64(j * 0xC2B2AE3D)) & m32
        x ^= x >> np.uint64(15)
        x = (x * np.uint64(0x2C1B3C6D)) & m32
        x ^= x >> np.uint64(13)
        out[:, j] = x.sum(axis=1) & np.uint64(_MASK16)
    return out


def _weights(nv: int) -> np.ndarray:
    """(4, nv) int64: (k+1)^j mod 2^16, the check words' lane weights."""
    k = np.arange(1, nv + 1, dtype=np.int64)
    w = np.empty((CHECKS, nv), dtype=np.int64)
    w[0] = 1
    for j in range(1, CHECKS):
        w[j] = (w[j - 1] * k) & _MASK16
    return w


def _check_sums(lanes: np.ndarray) -> np.ndarray:
    """sum_k (k+1)^j * v_k mod 2^16 of each row of (K, nv) lanes (any signed ints): (K, 4) int64."""
    v = np.asarray(lanes, dtype=np.int64) & _MASK16
    return (v @ _weights(v.shape[1]).T) & _MASK16  # < 2^16 * 2^16 * nv: no int64 overflow for nv < 2^31


# --- encode (senders) ---------------------------------------------------------------------------

def encode_rows(x: np.ndarray, exps: np.ndarray, n: int, lanes: int, rows: np.ndarray, i0: int,
                factors: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Write the payloads of packets i0.. (one per row of `rows`) of buffer `x` into `rows`, whose
    headers (bytes 0..31) are already written: exponent lanes, quantised data, padding, check words.

    Args:
        x: the whole float32 buffer.
        exps: the agreed exponent of every block of `x` (int, ceil(numel / BLOCK) of them).
        n: contributors of the sum (1..255).
        lanes: the switch's lane count L.
        rows: (K, >= 32 + 4L) uint8 packet rows.
        i0: the packet index of rows[0].
        factors: `quantize16_factors(exps, n)` if the caller keeps them (the same values).

    Returns:
        bool per row: SATURATED (a value was non-finite or not below its block's 2^e).
    """
    nb, data = layout(lanes)
    slots = fixed16_slots(lanes)
    k = rows.shape[0]
    terms = header_terms(rows)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    exps = np.asarray(exps)
    c = fixed16_bits(n)
    if use_numba():
        words = _as_words16(rows)
        if words is not None:
            s1, s2 = factors if factors is not None else quantize16_factors(exps, n)
            sat = np.zeros(k, dtype=np.bool_)
            kernels().quantize16_rows(x, np.ascontiguousarray(exps, dtype=np.int32), s1, s2,
                                       np.float32(2 ** (15 - c)), np.float32(2 ** (15 - c) - 1), words,
                                       rows.shape[1] // 2, HEADER_LEN // 2, slots, nb, FIXED16_BLOCK, i0, terms, sat)
            return sat
    blocks = exps.size
    b0, b1 = i0 * nb, (i0 + k) * nb
    e = np.zeros(k * nb, dtype=np.int64)
    e[:max(0, min(b1, blocks) - b0)] = exps[b0:min(b1, blocks)]
    lane = np.zeros((k, slots), dtype=np.int64)
    lane[:, :nb] = e.reshape(k, nb)
    sat = np.zeros(k, dtype=bool)
    lo, hi = min(i0 * data, x.size), min((i0 + k) * data, x.size)
    if hi > lo:
        q, sat_b = quantize16(x[lo:hi], exps[b0:b0 + -(-(hi - lo) // FIXED16_BLOCK)], FIXED16_BLOCK, n)
        flat = np.zeros(k * data, dtype=np.int64)
        flat[:q.size] = q
        lane[:, nb:nb + data] = flat.reshape(k, data)
        sat_b = np.concatenate([sat_b, np.zeros(k * nb - sat_b.size, dtype=bool)])
        sat = np.asarray(sat_b.reshape(k, nb).any(axis=1), dtype=bool)
    nv = slots - CHECK_SLOTS
    lane[:, nv::2] = (_check_sums(lane[:, :nv]) + terms + exponent_terms(e.reshape(k, nb)).astype(np.int64)) & _MASK16
    rows[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4")[...] = pack_slots(lane)
    return sat


# --- verify and decode (receivers of a sum) -------------------------------------------------------

def decode_rows(rows: np.ndarray, sel: np.ndarray, lanes: int, n: int, out: np.ndarray,
                checked: bool = False) -> np.ndarray:
    """Verify the FIXED16 sums of `n` contributions in rows[sel] and decode those that pass into
    the flat float32 `out` (the whole buffer: packet p's elements at out[p * D:], as far as `out`
    reaches; the packet index is the header's offset / D).

    `checked`: `verify_rows` passed these very rows already, so the compiled path checks only
    their exponent lanes and decodes in one pass (the verdict and bits are the same; the numpy
    path verifies again).

    Returns:
        bool per selected row: its exponent lanes are n equal exponents in the protocol's range and
        its check words match (integrity.check_words with exps = lanes / n). A row that fails is
        not decoded (the caller counts it and treats the packet as lost).
    """
    nb, data = layout(lanes)
    sel = np.asarray(sel, dtype=np.int64)
    ok = np.zeros(sel.size, dtype=np.bool_)
    if not sel.size:
        return ok
    hrows = rows[sel, :HEADER_LEN]
    starts = hrows[:, _OFFSET_AT:_OFFSET_AT + 4].copy().view(">u4").reshape(-1).astype(np.int64)  # element offsets
    c = fixed16_bits(n)
    pow2 = pow2_table(c)
    words = _as_words16(rows) if use_numba() else None
    if words is not None and out.flags.c_contiguous and out.dtype == np.float32:
        terms = _NO_TERMS if checked else header_terms(hrows)
        return kernels().dequantize16_rows(words, rows.shape[1] // 2, HEADER_LEN // 2, fixed16_slots(lanes), nb,
                                            FIXED16_BLOCK,
                                            n, sel, terms, pow2, -EXP_MIN, out.reshape(-1), starts, ok, checked)
    terms = header_terms(hrows)
    lane = unpack_slots(rows[sel, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4"))
    esum = lane[:, :nb]
    e = esum // n
    ok = ((esum % n) == 0).all(axis=1) & ((e >= EXP_MIN) & (e <= EXP_MAX)).all(axis=1)
    nv = fixed16_slots(lanes) - CHECK_SLOTS
    want = (_check_sums(lane[:, :nv]) + n * (terms.astype(np.int64)
                                             + exponent_terms(np.clip(e, EXP_MIN, EXP_MAX)).astype(np.int64))) & _MASK16
    ok &= (want == (lane[:, nv::2] & _MASK16)).all(axis=1) & (lane[:, nv + 1::2] == 0).all(axis=1)
    flat = out.reshape(-1)
    for i in np.flatnonzero(ok).tolist():
        scale = np.repeat(pow2[e[i] - EXP_MIN], FIXED16_BLOCK)
        vals = (lane[i, nb:nb + data].astype(np.float64) * scale).astype(np.float32)
        s = int(starts[i])
        m = max(0, min(data, flat.size - s))
        flat[s:s + m] = vals[:m]
    return ok


_NO_TERMS = np.zeros((0, CHECKS), dtype=np.uint32)  # `decode_rows(checked=True)`: the kernel reads no header term
_POW2: dict[int, np.ndarray] = {}


def pow2_table(c: int) -> np.ndarray:
    """2^(e + c - 15) for e in [EXP_MIN, EXP_MAX], exact in float64 (made once per c: never write it)."""
    t = _POW2.get(c)
    if t is None:
        t = _POW2[c] = np.ldexp(1.0, np.arange(EXP_MIN, EXP_MAX + 1) + c - 15)
    return t


# --- the exponent agreement (a FIXED16 MAX round on the meta session) --------------------------
# One exponent per 32-bit lane, `integrity.pack_exponents`' self-checking lane `e << 16 | exp_tag(e)`
# (the switch's signed max of lanes is the lane of the max, and the winner carries its own tag), as
# the 32-bit agreement round; the check lanes of a MAX packet hold T_j << 16 alone (the 16-bit
# header term in the high half, as a FIXED16 sum's), the same on every contributor, so the max keeps
# them. 4 B per block of FIXED16_BLOCK elements.


def agreement_lanes(lanes: int) -> int:
    """Exponents per agreement packet: every lane but the 4 check lanes."""
    return lanes - CHECKS


def encode_agreement_rows(exps: np.ndarray, lanes: int, rows: np.ndarray, i0: int) -> None:
    """Packets i0.. of an exponent agreement (headers written, FIXED16 with MAX): the packed
    exponents of blocks [p * A, (p + 1) * A), A = lanes - 4, zeros past the end, then T_j << 16."""
    per = agreement_lanes(lanes)
    k = rows.shape[0]
    flat = np.zeros(k * per, dtype=np.int32)
    part = np.asarray(exps)[i0 * per:(i0 + k) * per]
    flat[:part.size] = integrity.pack_exponents(part)
    rows[:, HEADER_LEN:HEADER_LEN + 4 * per].view(">i4")[...] = flat.reshape(k, per)
    rows[:, HEADER_LEN + 4 * per:HEADER_LEN + 4 * lanes].view(">u4")[...] = header_terms(rows) << np.uint32(16)


def _agreement_checks_ok(rows: np.ndarray, sel: np.ndarray, lanes: int) -> np.ndarray:
    """Bool per selected row: its check lanes are its header's T_j << 16."""
    per = agreement_lanes(lanes)
    got = rows[sel, HEADER_LEN + 4 * per:HEADER_LEN + 4 * lanes].view(">u4")
    return (got == (header_terms(rows[sel]) << np.uint32(16))).all(axis=1)


def verify_rows(rows: np.ndarray, sel: np.ndarray, lanes: int, n: int) -> np.ndarray:
    """Bool per selected row: a FIXED16 sum of `n` (`decode_rows`'s verdict, nothing decoded), or,
    for a row flagged MAX (an exponent agreement), its check lanes are T_j and every lane's tag holds."""
    sel = np.asarray(sel, dtype=np.int64)
    ok = np.ones(sel.size, dtype=bool)
    if not sel.size:
        return ok
    if fixed16_blocks(lanes) < 1:  # a switch too narrow for a block: no FIXED16 row is a real sum
        return ~ok
    agree = (rows[sel, 1] & np.uint8(Flag.MAX)) != 0  # the flags byte
    if agree.any():
        s = sel[agree]
        per = agreement_lanes(lanes)
        lane = rows[s, HEADER_LEN:HEADER_LEN + 4 * per].view(">i4")
        count = rows[s, _COUNT_AT:_COUNT_AT + 2].copy().view(">u2").reshape(-1, 1).astype(np.int64)
        tags = integrity.unpack_exponents(lane)[1] | (np.arange(per)[None, :] >= count)  # padding: zeros
        ok[agree] = _agreement_checks_ok(rows, s, lanes) & tags.all(axis=1)
    if not agree.all():
        ok[~agree] = decode_rows(rows, sel[~agree], lanes, n, np.empty(0, dtype=np.float32))
    return ok


def decode_agreement_rows(rows: np.ndarray, sel: np.ndarray, lanes: int, chunk: np.ndarray, out: np.ndarray,
                          checked: bool = False) -> bool:
    """The agreed exponents of RESULT rows[sel] (packet indices `chunk`) into `out` (one per block).
    False, writing nothing, when a check lane or a lane's tag is wrong (the agreement is corrupt).
    `checked`: `verify_rows` passed these very rows already (check lanes and every tag), so only
    the exponents are read off (the same values)."""
    per = agreement_lanes(lanes)
    lane = rows[sel, HEADER_LEN:HEADER_LEN + 4 * per].view(">i4")
    if checked:
        e = (lane >> 16).astype(np.int32)
        ok = None
    else:
        if not _agreement_checks_ok(rows, sel, lanes).all():
            return False
        e, ok = integrity.unpack_exponents(lane)
    parts = []
    for i, c in enumerate(np.asarray(chunk).tolist()):
        m = max(0, min(per, out.size - c * per))
        if ok is not None and not ok[i, :m].all():
            return False
        parts.append((c * per, e[i, :m]))
    for at, v in parts:
        out[at:at + v.size] = v
    return True


def _as_words16(rows: np.ndarray) -> np.ndarray | None:
    """A C-contiguous uint8 (K, W) buffer (W even) as its flat uint16 words, or None."""
    if rows.ndim != 2 or rows.dtype != _U8 or rows.shape[1] % 2 or not rows.flags.c_contiguous:
        return None
    words = rows.reshape(-1).view(np.uint16)
    return words if words.flags.aligned else None


def kernels():
    """dataplane/kernels/fixed16_rows.py (the compiled twins; it imports numba): call only with kernels on."""
    from .kernels import fixed16_rows

    return fixed16_rows

