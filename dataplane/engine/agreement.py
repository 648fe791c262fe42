"""Self-checking lanes for a fingerprint agreed by a lane MAX (reductions.py, issue 27).

A collective's fingerprint (non-negative int32 fields: the collective, dtype, element count, op,
sequence number...) rides on the meta session, whose switch takes the lane MAX, so every worker
reads the MAX and (through complements) the MIN of every field. The switch's MAX cannot carry
check words (docs/protocol.md 3.6: MAX packets' data is not covered), so each lane checks
itself, as the exponent lanes do (`integrity.pack_exponents`):

    lane = h << 16 | tag(field index, which half, h)        (as int32; h = half ^ 0x8000)

Each field v gives four lanes: its high and low 16-bit halves, then (after every field's halves)
the 16-bit complements of those halves. Lanes with equal halves carry equal tags, so the MAX of
packed lanes is the packed MAX of the halves: the lane that wins carries its
own tag (the 0x8000 bias makes that order the halves' unsigned order). The tag is CRC-16/ARC (the header check's CRC) over the field index, the half's kind and
the half's value: a lane's 32 bits then form a CRC code word of Hamming distance 4, so any 1 to 3
flipped bits of a lane, and a lane moved to another field's place, are always detected; a random
corruption of a lane passes with probability 2^-16 (per lane; a mismatch needs the corrupted lane
to land on a valid different value of that very field).

`unpack` returns each field's MIN and MAX over the workers and whether every tag matched. A lane
whose tag fails was corrupted in flight: the agreement says nothing then, and reductions.py counts
it (`agreement.corrupt`) instead of calling it a disagreement.
"""

from __future__ import annotations

import functools

import numpy as np

LANES_PER_FIELD = 4  # two 16-bit halves, and their complements
_ALL, _ANY = np.logical_and.reduce, np.logical_or.reduce  # without ndarray.all/any's Python wrappers (per call)

_TABLE = np.zeros(256, dtype=np.uint32)
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0xA001 if _c & 1 else _c >> 1
    _TABLE[_i] = _c


def lanes(fields: int) -> int:
    """Lanes that `fields` packed fields take."""
    return LANES_PER_FIELD * fields


def _crc(data: list[np.ndarray]) -> np.ndarray:
    """CRC-16/ARC (integrity.crc16_arc) of the byte rows data[0][i], data[1][i], ..., vectorised."""
    crc = np.zeros(data[0].shape, dtype=np.uint32)
    for b in data:
        crc = (crc >> np.uint32(8)) ^ _TABLE[(crc ^ b) & np.uint32(0xFF)]
    return crc


def tag(index: np.ndarray, kind: np.ndarray, half: np.ndarray) -> np.ndarray:
    """The 16-bit tag of half `half` (0..65535) of field `index` (kind 0/1: high/low half, 2/3:
    the complement of the high/low half): CRC-16/ARC of the bytes (index & 0xFF, kind, half's two
    bytes big-endian)."""
    index = np.asarray(index, dtype=np.uint32)
    kind = np.asarray(kind, dtype=np.uint32)
    half = np.asarray(half, dtype=np.uint32)
    return _crc([index & np.uint32(0xFF), kind, half >> np.uint32(8), half & np.uint32(0xFF)])


def _layout(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Field index and kind of each of the 4k lanes."""
    index = np.tile(np.repeat(np.arange(k, dtype=np.uint32), 2), 2)
    kind = np.tile(np.array([0, 1], dtype=np.uint32), 2 * k) + np.repeat(np.array([0, 2], dtype=np.uint32), 2 * k)
    return index, kind


@functools.lru_cache(maxsize=16)
def _lane_crcs(k: int) -> np.ndarray:
    """The CRC state of each of the 4k lanes' tags after its first two bytes (field index, kind):
    they depend on the lane's place only, so `_tags` goes on from them with the half's two bytes,
    the same CRC as `tag` (a collective packs and checks the same few fields every call: computed
    once per field count, read-only)."""
    index, kind = _layout(k)
    crc = _crc([index & np.uint32(0xFF), kind])
    crc.setflags(write=False)
    return crc


def _tags(k: int, half: np.ndarray) -> np.ndarray:
    """`tag(index, kind, half)` of the 4k lanes of `_layout(k)`: the last two CRC steps only."""
    crc = _lane_crcs(k)
    for b in (half >> np.uint32(8), half & np.uint32(0xFF)):
        crc = (crc >> np.uint32(8)) ^ _TABLE[(crc ^ b) & np.uint32(0xFF)]
    return crc


def pack(fields: np.ndarray) -> np.ndarray:
    """The int32 lanes a worker sends for its non-negative int32 `fields` (k of them: 4k lanes)."""
    v = np.asarray(fields, dtype=np.int64).reshape(-1).astype(np.uint32)
    k = v.size
    # each half biased by 0x8000, so the lanes' signed order is the halves' unsigned order; then
    # the complements (lanes 2k..4k)
    halves = np.empty(4 * k, dtype=np.uint32)
    halves[0:2 * k:2] = v >> np.uint32(16)
    halves[1:2 * k:2] = v & np.uint32(0xFFFF)
    halves[:2 * k] ^= np.uint32(0x8000)
    np.bitwise_xor(halves[:2 * k], np.uint32(0xFFFF), out=halves[2 * k:])
    return ((halves << np.uint32(16)) | _tags(k, halves)).view(np.int32)


def lanes_ok(lanes_: np.ndarray, k: int) -> np.ndarray:
    """Per lane of an agreement result (the MAX of packed lanes, 4k of them): its tag matches."""
    u = np.asarray(lanes_, dtype=np.int32).reshape(-1)[:lanes(k)].view(np.uint32)
    return (u & np.uint32(0xFFFF)) == _tags(k, u >> np.uint32(16))


def fields_ok(lanes_: np.ndarray, k: int) -> np.ndarray:
    """Per field: all four of its lanes passed their tags."""
    good = lanes_ok(lanes_, k)
    return np.asarray(good[:2 * k].reshape(k, 2).all(axis=1) & good[2 * k:].reshape(k, 2).all(axis=1))


def unpack(lanes_: np.ndarray, k: int) -> tuple[list[int], list[int], bool, bool]:
    """(lo, hi, ok, differ) of the agreement result `lanes_` (the lane MAX over the workers of
    `pack`'s lanes, 4k of them): per field the MIN and MAX over the workers (compared half by half
    in signed 16-bit order, so lo == hi exactly where every worker sent the same value); ok: every
    lane's tag matched (False: some lane was corrupted in flight); differ: the workers' fields
    differ in some half whose two lanes (MAX and complement) both passed their tags, which a
    corrupted lane elsewhere does not make doubtful."""
    u = np.asarray(lanes_, dtype=np.int32).reshape(-1)[:lanes(k)].view(np.uint32)
    good = lanes_ok(u.view(np.int32), k)
    h = (u >> np.uint32(16)).astype(np.uint16).view(np.int16).astype(np.int64)
    hi_halves = h[:2 * k]
    lo_halves = ~h[2 * k:]  # the MAX of complements is the complement of the MIN

    def join(x: np.ndarray) -> list[int]:
        x = ((x & 0xFFFF) ^ 0x8000).reshape(k, 2)
        return ((x[:, 0] << 16) | x[:, 1]).tolist()

    # equal where every worker sent the same field (then the field itself); else a MIN and a MAX
    # half by half, which differ exactly where the workers' fields do
    differ = bool(_ANY((hi_halves != lo_halves) & good[:2 * k] & good[2 * k:]))
    return join(lo_halves), join(hi_halves), bool(_ALL(good)), differ
