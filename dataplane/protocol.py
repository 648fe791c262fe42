"""The luwu wire protocol in code: constants, header layouts and slot arithmetic.

`docs/protocol.md` is the specification; this module is its single executable source. The
P4 constants (`p4/include/constants.p4`) are generated from it, and every other module (the
software switch, the SmartNIC engine, the optimizer node, tests and tools) imports from here
rather than repeating a number.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

VERSION = 2  # 2: the header check (hcheck, docs/protocol.md 3.5) and the integrity codes of dataplane/integrity.py
HEADER_LEN = 32
COMMON_LEN = 8
NODE = 0xFFFF  # `worker` value of the session's optimizer node (or the parent switch)
DEFAULT_UDP_PORT = 19541  # 0x4C55; P4 build parameter LUWU_UDP_PORT
MAX_SESSIONS = 1024  # session ids 1..MAX_SESSIONS-1; heartbeat registers are indexed by id
MAX_CONTRIBUTORS = 32  # bits in a worker bitmap
MAX_UDP_PAYLOAD = 65507
ETH_IP_UDP_LEN = 14 + 20 + 8
TRAILER_LEN = 4  # PARAM and PULL: CRC-32 of the payload after it (docs/protocol.md 3.7)


class MsgType(enum.IntEnum):
    GRAD = 1
    AGG = 2
    ALLREDUCE = 3
    RESULT = 4
    PARAM = 5
    HEARTBEAT = 6
    PULL = 7


AGGREGATION_TYPES = (MsgType.GRAD, MsgType.AGG, MsgType.ALLREDUCE, MsgType.RESULT)
ZERO_TYPES = (MsgType.GRAD, MsgType.ALLREDUCE)  # the types a header-only ZERO packet may have


class Flag(enum.IntFlag):
    NONE = 0
    SET = 0x01
    RETX = 0x02
    SATURATED = 0x04
    MAX = 0x08
    FALLBACK = 0x10
    GAP = 0x20  # HEARTBEAT: the receiver holds packets past `ack` (a hole: something was lost)
    # GRAD/ALLREDUCE, INT32 only: a header-only packet standing for `lanes` zero lanes (the switch
    # aggregates it as zeros and emits full results); docs/protocol.md 3.2
    ZERO = 0x40


class Dtype(enum.IntEnum):
    INT32 = 0
    FP32 = 1
    BF16 = 2
    FP16 = 3
    FIXED32 = 4
    ORDERED32 = 5
    FIXED16 = 6  # int16 values two per int32 lane, one shared exponent per FIXED16_BLOCK (docs/protocol.md 5.2)


class NextStep(enum.IntEnum):
    ROOT = 0
    UPSTREAM = 1


class DropReason(enum.IntEnum):
    MALFORMED = 1
    BAD_VERSION = 2
    BAD_TYPE = 3
    UNKNOWN_SESSION = 4
    UNKNOWN_WORKER = 5
    FOREIGN_SLOT = 6
    DUPLICATE = 7
    SIMULATED_LOSS = 8
    NO_ROUTE = 9
    BAD_DIRECTION = 10
    UNKNOWN_PORT = 11
    SPOOFED = 12  # a sender id on a port its `workers` entry (or the session's up_port) does not bind it to
    BAD_CHECKSUM = 13  # the header check (hcheck, docs/protocol.md 3.5) does not match


class Event(enum.IntEnum):
    COMPLETED = 1
    ABSORBED = 2
    RESENT = 3
    FALLBACK = 4
    HB_ROUND = 5
    HB_ABSORBED = 6
    MULTICAST = 7
    UNICAST = 8
    FORWARDED = 9
    SATURATED = 10


COUNTER_SIZE = 16  # entries of the drops / events / rx_types counters

PACKET_MODES = {"tofino": 64, "jumbo": 2048, "loopback": 16000}
# An aggregation packet carries its lanes in whole chunks of LANE_CHUNK lanes: the fewest that hold
# its count, exponent and check lanes, or all of the switch's lanes (docs/protocol.md 3.3;
# `integrity.wire_lanes`). 64 divides every packet mode's lane count (64, 2048 = 32 * 64,
# 16000 = 250 * 64), is a power of two (a shift in P4), and is the whole tofino packet, so a
# 64-lane switch (BMv2, Tofino) has one length per dtype as before.
LANE_CHUNK = 64


def lanes_for_mode(mode: str | int) -> int:
    """Lane count of a packet mode name (or a number of lanes, validated)."""
    if isinstance(mode, str) and not mode.isdigit():
        if mode not in PACKET_MODES:
            raise ValueError(f"unknown packet mode {mode!r}: choose one of {', '.join(PACKET_MODES)} or a lane count")
        return PACKET_MODES[mode]
    lanes = int(mode)
    if not 1 <= lanes <= (MAX_UDP_PAYLOAD - HEADER_LEN) // 4:
        raise ValueError(f"lane count {lanes} out of range 1..{(MAX_UDP_PAYLOAD - HEADER_LEN) // 4}")
    return lanes


def aggregation_packet_len(lanes: int) -> int:
    """Bytes of a whole (the longest) 32-bit GRAD/AGG/ALLREDUCE/RESULT packet (luwu header +
    payload, no L2-L4); a packet with fewer lanes to carry is shorter (`integrity.wire_len`)."""
    return HEADER_LEN + 4 * lanes


DTYPE_ITEMSIZE = {Dtype.INT32: 4, Dtype.FP32: 4, Dtype.BF16: 2, Dtype.FP16: 2, Dtype.FIXED32: 4, Dtype.ORDERED32: 4,
                 Dtype.FIXED16: 2}
_ITEMSIZE_BY_CODE: dict[int, int] = {int(d): n for d, n in DTYPE_ITEMSIZE.items()}  # by the header's dtype byte

# --- header layouts (numpy, for vectorised work on batches of packets) -----------------------

DATA_HEADER = np.dtype(
    [
        ("ver_type", "u1"),
        ("flags", "u1"),
        ("session", ">u2"),
        ("worker", ">u2"),
        ("count", ">u2"),
        ("seq", ">u4"),
        ("slot", ">u4"),
        ("tensor", ">u4"),
        ("offset", ">u4"),
        ("exponent", "i1"),
        ("dtype", "u1"),
        ("hcheck", ">u2"),  # bytes 26..27: CRC-16/ARC of the other 30 header bytes (docs/protocol.md 3.5)
        ("numel", ">u4"),
    ]
)
HEARTBEAT_HEADER = np.dtype(
    [
        ("ver_type", "u1"),
        ("flags", "u1"),
        ("session", ">u2"),
        ("worker", ">u2"),
        ("count", ">u2"),
        ("seq", ">u4"),
        ("ack", ">u4"),
        ("credit", ">u4"),
        ("reserved", "V6"),
        ("hcheck", ">u2"),  # bytes 26..27, as in DATA_HEADER
        ("reserved2", "V4"),
    ]
)
assert DATA_HEADER.itemsize == HEADER_LEN and HEARTBEAT_HEADER.itemsize == HEADER_LEN

PULL_REQUEST = np.dtype([("pull_id", ">u4"), ("tensor", ">u4"), ("version", ">u4")])


def ver_type(msg_type: int) -> int:
    return (VERSION << 4) | int(msg_type)


def header_view(rows: np.ndarray, layout: np.dtype = DATA_HEADER) -> np.ndarray:
    """View the first 32 bytes of each row of a (K, >=32) uint8 array as headers (no copy)."""
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[1] < HEADER_LEN:
        raise ValueError("header_view needs a (K, >=32) uint8 array")
    return rows[:, :HEADER_LEN].view(layout)[:, 0]


def looks_like_luwu(data: bytes | memoryview) -> bool:
    """The header's own signature, for tools that meet luwu on any UDP port (loopback captures
    use ephemeral ports): this version, a known type, and a length the type implies (the switch's
    own length rules, docs/protocol.md 3; aggregation packets carry whole 4-byte lanes, 2-byte
    for FIXED16, at least `count` of them). A UDP payload that passes is almost surely luwu; one that fails is not a
    packet any luwu component would accept."""
    n = len(data)
    if n < HEADER_LEN or data[0] >> 4 != VERSION:
        return False
    mtype, count = data[0] & 0xF, int.from_bytes(data[6:8], "big")
    if mtype in AGGREGATION_TYPES:
        if data[1] & Flag.ZERO:  # header-only contribution (docs/protocol.md 3.2)
            return n == HEADER_LEN and mtype in ZERO_TYPES and data[25] == Dtype.INT32
        width = 2 if data[25] == Dtype.FIXED16 else 4  # the dtype byte of DATA_HEADER
        return (n - HEADER_LEN) % width == 0 and count <= (n - HEADER_LEN) // width
    if mtype == MsgType.PARAM:  # values, then the trailer (3.7)
        item = _ITEMSIZE_BY_CODE.get(data[25])  # the dtype byte of DATA_HEADER
        return item is not None and n == HEADER_LEN + count * item + TRAILER_LEN
    if mtype == MsgType.HEARTBEAT:
        return n == HEADER_LEN
    if mtype == MsgType.PULL:
        return n == HEADER_LEN + PULL_REQUEST.itemsize * count + TRAILER_LEN
    return False


# --- the header check (hcheck, docs/protocol.md 3.5) -------------------------------------------
# CRC-16/ARC (poly 0x8005 reflected, init 0, no final xor: P4's crc16) of the header's bytes but
# 26..27, big-endian in 26..27. With init 0 and no final xor the CRC is linear over GF(2): a
# header's check is the xor of each byte's own contribution at its position, HCHECK_TABLES[p][b]
# (p over the 30 covered bytes). dataplane/integrity.py holds the byte-serial reference
# (`crc16_arc`) and the vectorised forms; tests compare them.

HCHECK_OFFSET = 26


def _hcheck_tables() -> list[list[int]]:
    step = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xA001 if c & 1 else c >> 1
        step.append(c)
    tables = [step]  # the last covered byte: one table step from 0
    for _ in range(HEADER_LEN - 3):  # each earlier byte: its contribution carried through one more byte
        nxt = tables[0]
        tables.insert(0, [(v >> 8) ^ step[v & 0xFF] for v in nxt])
    return tables


HCHECK_TABLES = _hcheck_tables()


def header_check_fast(h: bytes | bytearray | memoryview) -> int:
    """The hcheck value of one header (its first 32 bytes), on Python ints."""
    b = bytes(h[:HEADER_LEN])
    crc = 0
    for t, x in zip(HCHECK_TABLES, b[:HCHECK_OFFSET] + b[HCHECK_OFFSET + 2:]):
        crc ^= t[x]
    return crc


def header_ok(data: bytes | bytearray | memoryview) -> bool:
    """A packet's header check matches (False for fewer than 32 bytes)."""
    if len(data) < HEADER_LEN:
        return False
    return header_check_fast(data) == (data[HCHECK_OFFSET] << 8) | data[HCHECK_OFFSET + 1]


def sealed(data: bytes) -> bytes:
    """`data` (a packet) with its header check written."""
    c = header_check_fast(data)
    return data[:HCHECK_OFFSET] + bytes((c >> 8, c & 0xFF)) + data[HCHECK_OFFSET + 2:]


# --- single-packet encode/decode (tools, tests, slow paths) ----------------------------------

_DATA = struct.Struct("!BBHHHIIIIbBHI")
_HB = struct.Struct("!BBHHHIII6xH4x")


class HeaderCheckError(ValueError):
    """A packet's header check (hcheck, docs/protocol.md 3.5) does not match its header."""


@dataclass
class Packet:
    """One luwu packet, decoded. `payload` is the raw bytes after the 32-byte header."""

    type: int
    session: int
    worker: int = 0
    flags: int = 0
    count: int = 0
    seq: int = 0
    slot: int = 0
    tensor: int = 0
    offset: int = 0
    exponent: int = 0
    dtype: int = 0
    numel: int = 0
    ack: int = 0
    credit: int = 0
    version: int = VERSION
    payload: bytes = field(default=b"", repr=False)

    def pack(self, seal: bool = True) -> bytes:
        """The packet's bytes, its header check sealed (`seal=False`: hcheck left 0, for tests
        that need a packet whose header fails)."""
        vt = ((self.version & 0xF) << 4) | (int(self.type) & 0xF)
        if self.type == MsgType.HEARTBEAT:
            head = _HB.pack(vt, self.flags, self.session, self.worker, self.count, self.seq & 0xFFFFFFFF,
                            self.ack & 0xFFFFFFFF, self.credit & 0xFFFFFFFF, 0)
        else:
            head = _DATA.pack(vt, self.flags, self.session, self.worker, self.count, self.seq & 0xFFFFFFFF,
                              self.slot, self.tensor, self.offset, self.exponent, self.dtype, 0, self.numel)
        if seal:
            head = sealed(head)
        return head + bytes(self.payload)

    @classmethod
    def unpack(cls, data: bytes | memoryview, verify: bool = True) -> Packet:
        """Decode a packet.

        Args:
            data: the luwu datagram (header and payload).
            verify: check the header check first (docs/protocol.md 3.5).

        Raises:
            ValueError: shorter than a header.
            HeaderCheckError: `verify` and the header check does not match (a corrupted header).
        """
        if len(data) < HEADER_LEN:
            raise ValueError(f"luwu packet of {len(data)} bytes is shorter than the {HEADER_LEN}-byte header")
        if verify and not header_ok(data):
            raise HeaderCheckError(f"luwu header check mismatch (hcheck {int.from_bytes(data[26:28], 'big'):#06x}, "
                                   f"expected {header_check_fast(data):#06x}): a corrupted header")
        vt = data[0]
        version, mtype = vt >> 4, vt & 0xF
        if mtype == MsgType.HEARTBEAT:
            _, flags, session, worker, count, seq, ack, credit, _ = _HB.unpack_from(data)
            return cls(mtype, session, worker, flags, count, seq, ack=ack, credit=credit, version=version,
                       payload=bytes(data[HEADER_LEN:]))
        _, flags, session, worker, count, seq, slot, tensor, offset, exponent, dtype, _, numel = _DATA.unpack_from(data)
        return cls(mtype, session, worker, flags, count, seq, slot, tensor, offset, exponent, dtype, numel,
                   version=version, payload=bytes(data[HEADER_LEN:]))

    def lanes(self) -> np.ndarray:
        """Payload as native int32 (aggregation types)."""
        return np.frombuffer(self.payload, dtype=">i4").astype(np.int32)


# --- sequence and slot arithmetic ------------------------------------------------------------

def serial_lt(a: int, b: int) -> bool:
    """RFC 1982 comparison on 32-bit sequence numbers: a precedes b."""
    return ((a - b) & 0xFFFFFFFF) >= 0x80000000


def serial_min(a: int, b: int) -> int:
    return a if serial_lt(a, b) else b


def serial_diff(a: int, b: int) -> int:
    """a - b as a signed 32-bit distance."""
    d = (a - b) & 0xFFFFFFFF
    return d - 0x100000000 if d >= 0x80000000 else d


def check_pool(pool_base: int, pool_size: int) -> None:
    if pool_size <= 0 or pool_size & (pool_size - 1):
        raise ValueError(f"slot pool size must be a power of two, got {pool_size}")
    if pool_base < 0:
        raise ValueError(f"slot pool base must be >= 0, got {pool_base}")


def slot_for(seq: Any, pool_base: int, pool_size: int) -> tuple[Any, Any]:
    """(slot, set) of sequence number(s) `seq` in a pool; works on ints and numpy arrays."""
    shift = pool_size.bit_length() - 1
    return pool_base + (seq & (pool_size - 1)), (seq >> shift) & 1

