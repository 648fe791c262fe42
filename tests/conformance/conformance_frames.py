"""Frames for the conformance vectors (scapy) and a field-by-field diff of what a switch emitted.

Input frames go from a host to the switch's service address; expected output frames are
written out in full by the vectors from the spec (docs/protocol.md 2: the switch rewrites the
destination MAC, IPv4 address and UDP port from `endpoints`, zeroes the UDP checksum and
recomputes the IPv4 checksum, and sends from the address the packet was sent to; everything
else of the triggering frame is kept). Every luwu header, in and out, is sealed: its header
check (hcheck, bytes 26..27) is `integrity.header_check` of the other 30 bytes, so an expected
output carries the hcheck of its rewritten header (the switch recomputes it, docs/protocol.md 3.5);
`frame_in(..., mangle=...)` corrupts a sealed header on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from conformance_topology import LANES, SERVICE_IP, SWITCH_MAC, UDP_PORT, Host
from scapy.fields import ConditionalField
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw

from luwu.dataplane.fixed16 import pack_slots
from luwu.dataplane.integrity import HCHECK_OFFSET, header_check, trailer
from luwu.dataplane.protocol import HEADER_LEN, VERSION, MsgType
from luwu.dataplane.scapy_layer import Luwu

AGGREGATION = {int(MsgType.GRAD), int(MsgType.AGG), int(MsgType.ALLREDUCE), int(MsgType.RESULT)}


def lanes_bytes(values) -> bytes:
    """int32 lanes, big-endian, wrapping like numpy int32; shorter lists are zero-padded to LANES."""
    arr = np.zeros(max(LANES, len(values)), dtype=np.int64)
    arr[:len(values)] = np.asarray(values, dtype=np.int64)
    return (arr & 0xFFFFFFFF).astype(">u4").tobytes()


def with_trailer(body: bytes) -> bytes:
    """A PARAM or PULL payload: `body` and its 4-byte CRC-32 trailer (docs/protocol.md 3.8)."""
    return body + trailer(body)


def slots_bytes(slots) -> bytes:
    """FIXED16 int16 slots packed two per int32 lane (`fixed16.pack_slots`: `hi * 2^16 + lo`),
    big-endian; shorter lists are zero-padded to 2 * LANES slots."""
    arr = np.zeros(max(2 * LANES, len(slots) + len(slots) % 2), dtype=np.int64)
    arr[:len(slots)] = np.asarray(slots, dtype=np.int64)
    return pack_slots(arr[None])[0].astype(">i4").tobytes()


def wrap32(values) -> list[int]:
    """int64 values wrapped to signed int32 (the switch's add)."""
    a = (np.asarray(values, dtype=np.int64) + 2**31) % 2**32 - 2**31
    return [int(x) for x in a]


def luwu_layer(mtype: int, session: int, worker: int, *, flags: int = 0, count: int | None = None, seq: int = 0,
               slot: int = 0, tensor: int = 0, offset: int = 0, exponent: int = 0, dtype: int = 0, numel: int = 0,
               ack: int = 0, credit: int = 0, version: int = VERSION) -> Luwu:
    if count is None:
        count = LANES if int(mtype) in AGGREGATION else 0
    if int(mtype) == MsgType.HEARTBEAT:
        return Luwu(version=version, type=int(mtype), flags=flags, session=session, worker=worker, count=count,
                    seq=seq, ack=ack, credit=credit)
    return Luwu(version=version, type=int(mtype), flags=flags, session=session, worker=worker, count=count, seq=seq,
                slot=slot, tensor=tensor, offset=offset, exponent=exponent, dtype=dtype, numel=numel)


def sealed(layer, mangle: Callable[[bytearray], None] | None = None) -> bytes:
    """The bytes of a luwu header layer with its hcheck written (a whole 32-byte header only);
    `mangle` then changes them in place (a corrupted header)."""
    data = bytearray(bytes(layer))
    if isinstance(layer, Luwu) and len(data) >= HEADER_LEN:
        data[HCHECK_OFFSET:HCHECK_OFFSET + 2] = header_check(bytes(data)).to_bytes(2, "big")
    if mangle is not None:
        mangle(data)
    return bytes(data)


def frame_in(src: Host, layer, payload: bytes = b"", mangle: Callable[[bytearray], None] | None = None) -> bytes:
    """A luwu frame from host `src` to the switch's service address, its header sealed (then
    `mangle`d: a header corrupted before the UDP checksum was computed, as a faulty NIC does)."""
    pkt = Ether(src=src.mac, dst=SWITCH_MAC) / IP(src=src.ip, dst=SERVICE_IP) / UDP(sport=UDP_PORT, dport=UDP_PORT)
    return bytes(pkt / Raw(sealed(layer, mangle) + payload))


def frame_out(src: Host, dst: Host, layer: Luwu, payload: bytes = b"") -> bytes:
    """What the switch emits toward `dst` for a packet that `src` sent (header rewritten as given,
    hcheck recomputed): from the switch's service address, the address `src` sent to."""
    pkt = (Ether(src=SWITCH_MAC, dst=dst.mac) / IP(src=SERVICE_IP, dst=dst.ip)
           / UDP(sport=UDP_PORT, dport=UDP_PORT, chksum=0))
    return bytes(pkt / Raw(sealed(layer) + payload))


def plain_udp(src: Host, dst_ip: str, *, dport: int = 5353, ttl: int = 64, payload: bytes = b"hello") -> bytes:
    return bytes(Ether(src=src.mac, dst=SWITCH_MAC) / IP(src=src.ip, dst=dst_ip, ttl=ttl)
                 / UDP(sport=40000, dport=dport) / Raw(payload))


def routed(frame: bytes, next_hop_mac: str) -> bytes:
    """A plain IPv4 frame after ipv4_forward: src MAC = old dst MAC, dst MAC = next hop, TTL - 1."""
    pkt = Ether(frame)
    pkt[Ether].src, pkt[Ether].dst = pkt[Ether].dst, next_hop_mac
    pkt[IP].ttl -= 1
    del pkt[IP].chksum
    return bytes(pkt)


def arp_request(src: Host, target_ip: str) -> bytes:
    return bytes(Ether(src=src.mac, dst="ff:ff:ff:ff:ff:ff") / ARP(psrc=src.ip, hwsrc=src.mac, pdst=target_ip))


# -- comparison -----------------------------------------------------------------------------------

def _fields(frame: bytes) -> list[tuple[str, object]]:
    """(layer.field, value) pairs of a frame, payload lanes as int32 when the type carries lanes."""
    out: list[tuple[str, object]] = []
    layer = Ether(frame)
    mtype = None
    while layer is not None and not isinstance(layer, Raw) and layer.name != "NoPayload":
        for f in layer.fields_desc:
            if isinstance(f, ConditionalField):  # only the fields present on the wire
                if not f._evalcond(layer):
                    continue
                f = f.fld
            out.append((f"{layer.name}.{f.name}", layer.getfieldval(f.name)))
        if isinstance(layer, Luwu):
            mtype = layer.type
        layer = layer.payload if layer.payload else None
    raw = bytes(layer) if isinstance(layer, Raw) else b""
    if mtype in AGGREGATION and len(raw) % 4 == 0:
        out += [(f"lane[{k}]", int(v)) for k, v in enumerate(np.frombuffer(raw, dtype=">i4"))]
    elif raw:
        out.append(("payload", raw.hex()))
    return out


def diff_frames(got: bytes, want: bytes) -> list[str]:
    """Readable differences between two frames, field by field (empty when equal)."""
    if got == want:
        return []
    g, w = dict(_fields(got)), dict(_fields(want))
    lines = []
    for key in list(w) + [k for k in g if k not in w]:
        if g.get(key, "<absent>") != w.get(key, "<absent>"):
            lines.append(f"  {key}: got {g.get(key, '<absent>')!r}, want {w.get(key, '<absent>')!r}")
    if not lines:
        lines.append(f"  bytes differ: got {got.hex()}, want {want.hex()}")
    return lines


def compare_outputs(got: list[tuple[int, bytes]], want: list[tuple[int, bytes]]) -> list[str]:
    """Differences between emitted and expected (port, frame) multisets, paired by port."""
    problems = []
    got_s, want_s = sorted(got), sorted(want)
    got_ports, want_ports = [p for p, _ in got_s], [p for p, _ in want_s]
    if got_ports != want_ports:
        problems.append(f"frames out on ports {got_ports}, expected on ports {want_ports}")
    by_port: dict[int, list[bytes]] = {}
    for p, f in got_s:
        by_port.setdefault(p, []).append(f)
    for p, f in want_s:
        cands = by_port.get(p)
        if not cands:
            continue
        best = min(cands, key=lambda c: len(diff_frames(c, f)))
        cands.remove(best)
        lines = diff_frames(best, f)
        if lines:
            problems.append(f"frame on port {p}:\n" + "\n".join(lines))
    return problems


