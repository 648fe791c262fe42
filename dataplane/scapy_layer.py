"""A scapy layer for the luwu header, for crafting and dissecting packets in tests and tools.

`Ether()/IP()/UDP(dport=DEFAULT_UDP_PORT)/Luwu(...)/Raw(payload)` builds a frame. Captured
frames dissect by themselves: on UDP port DEFAULT_UDP_PORT, and on any other UDP port whose
payload carries the header's signature (`protocol.looks_like_luwu`; loopback runs use
ephemeral ports) unless scapy already knows that port for another protocol. The layout follows
docs/protocol.md section 3 (the heartbeat fields overlay slot/tensor/offset); `hcheck` left unset
is computed when the packet is built (`Luwu(...).hcheck_ok()` checks a dissected one).
"""

from __future__ import annotations

from scapy.fields import (
    BitEnumField,
    BitField,
    ByteEnumField,
    ConditionalField,
    FlagsField,
    IntField,
    ShortField,
    SignedByteField,
    StrFixedLenField,
    XShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, Raw, bind_layers

from .integrity import header_ok, sealed
from .protocol import DEFAULT_UDP_PORT, HEADER_LEN, VERSION, Dtype, MsgType, looks_like_luwu

_TYPES = {int(t): t.name for t in MsgType}
_DTYPES = {int(d): d.name for d in Dtype}
_FLAGS = ["SET", "RETX", "SATURATED", "MAX", "FALLBACK", "GAP", "ZERO", "R7"]


def _is_hb(pkt) -> bool:
    return pkt.type == MsgType.HEARTBEAT


class Luwu(Packet):
    name = "luwu"
    fields_desc = [  # noqa: RUF012 - scapy's class-level field list
        BitField("version", VERSION, 4),
        BitEnumField("type", int(MsgType.GRAD), 4, _TYPES),
        FlagsField("flags", 0, 8, _FLAGS),
        ShortField("session", 1),
        XShortField("worker", 0),
        ShortField("count", 0),
        IntField("seq", 0),
        ConditionalField(IntField("slot", 0), lambda p: not _is_hb(p)),
        ConditionalField(IntField("tensor", 0), lambda p: not _is_hb(p)),
        ConditionalField(IntField("offset", 0), lambda p: not _is_hb(p)),
        ConditionalField(SignedByteField("exponent", 0), lambda p: not _is_hb(p)),
        ConditionalField(ByteEnumField("dtype", 0, _DTYPES), lambda p: not _is_hb(p)),
        ConditionalField(IntField("ack", 0), _is_hb),
        ConditionalField(IntField("credit", 0), _is_hb),
        ConditionalField(StrFixedLenField("hb_reserved", b"\x00" * 6, 6), _is_hb),
        # bytes 26..27 of every type: CRC-16/ARC of the other 30 header bytes (docs/protocol.md
        # 3.5); None (the default) computes it when the packet is built
        XShortField("hcheck", None),
        ConditionalField(IntField("numel", 0), lambda p: not _is_hb(p)),
        ConditionalField(StrFixedLenField("hb_reserved2", b"\x00" * 4, 4), _is_hb),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.hcheck is None and len(pkt) >= HEADER_LEN:
            pkt = sealed(pkt)
        return pkt + pay

    def hcheck_ok(self) -> bool:
        """The dissected header's check matches (a corrupted header does not)."""
        return header_ok(bytes(self)[:HEADER_LEN])


bind_layers(UDP, Luwu, dport=DEFAULT_UDP_PORT)
bind_layers(UDP, Luwu, sport=DEFAULT_UDP_PORT)

_udp_guess = UDP.guess_payload_class


def _guess_luwu(self, payload: bytes):
    """UDP's payload class: a port binding first (scapy's), else luwu by its signature."""
    cls = _udp_guess(self, payload)
    if cls is Raw and looks_like_luwu(payload):
        return Luwu
    return cls


UDP.guess_payload_class = _guess_luwu
