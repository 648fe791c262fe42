"""sender (egress): multicast expansion, and the Ethernet deparser with the `endpoints` rewrite.

`expand` turns each packet's route into output copies, in packet order then replica order
(the group's order). A multicast on a group with no replicas is dropped NO_ROUTE.

On Ethernet ports (`deparse_frames`) every luwu copy is rewritten from `endpoints[(session,
dst)]` (dst = the replica's instance, or the unicast rank / 0xFFFF): destination MAC, IPv4 and
UDP port; UDP checksum 0; IPv4 total length and checksum recomputed. The source becomes the
address the triggering packet was sent to, the switch's service address (docs/protocol.md
section 2), so a host never receives a frame bearing its own source address. A miss drops the
copy NO_ROUTE (a frame must never leave with the switch's service address as destination).
On UDP ports the luwu bytes go unchanged to the port's peer: the endpoints table is not
consulted there, and a multicast sends one row to every replica without copying it.
"""

from __future__ import annotations

import ipaddress

import numpy as np

from ...protocol import ETH_IP_UDP_LEN, DropReason
from ..batch import Emission
from ..lookup import CompiledTables
from .next_step_selector import ROUTE_L3, ROUTE_MULTICAST, ROUTE_NONE, Routes
from .parser import (
    ETH_LEN,
    ETHERTYPE_IPV4,
    IPPROTO_UDP,
    IPV4_MIN_LEN,
    OFF_IP_CSUM,
    OFF_IP_DST,
    OFF_IP_PROTO,
    OFF_IP_SRC,
    OFF_IP_TOTAL_LEN,
    OFF_IP_TTL,
    OFF_IP_VER_IHL,
    OFF_UDP,
    OFF_UDP_CSUM,
    OFF_UDP_DPORT,
    OFF_UDP_LEN,
    UDP_LEN,
)

MAC_LEN = 6
SYNTH_TTL = 64  # TTL of frames the switch synthesises for packets that arrived over UDP


def expand(routes: Routes, t: CompiledTables, drops: list) -> Emission:
    idx = np.flatnonzero(routes.kind != ROUTE_NONE)
    if len(idx) == 0:
        return Emission.empty()
    kind = routes.kind[idx]
    if len(idx) == 1 and kind[0] == ROUTE_MULTICAST:  # the common small turn: one packet to a group
        i, g = int(idx[0]), int(routes.group[idx[0]])
        n, s0 = int(t.g_len[g]), int(t.g_start[g])
        if n:  # (an empty group takes the general path: its NO_ROUTE drop)
            return Emission(np.full(n, i, dtype=np.int64), t.rep_port[s0:s0 + n].copy(),
                            t.rep_instance[s0:s0 + n].copy(), np.full(n, int(routes.session[i]), dtype=np.int64),
                            np.zeros(n, dtype=bool))
    mc = kind == ROUTE_MULTICAST
    n_out = np.ones(len(idx), dtype=np.int64)
    if mc.any():
        n_out[mc] = t.g_len[routes.group[idx[mc]]]
        empty = mc & (n_out == 0)
        if empty.any():
            drops.append((DropReason.NO_ROUTE, idx[empty]))
    if not mc.any():  # all unicast: one copy each
        return Emission(idx, routes.port[idx], routes.dst[idx], routes.session[idx], kind == ROUTE_L3)
    pkt = np.repeat(idx, n_out)
    start = np.cumsum(n_out) - n_out
    within = np.arange(len(pkt), dtype=np.int64) - np.repeat(start, n_out)
    is_mc = np.repeat(mc, n_out)
    rep = np.where(is_mc, t.g_start[routes.group[pkt]] + within, 0)
    if len(t.rep_port):
        rep_c = np.minimum(rep, len(t.rep_port) - 1)
        port = np.where(is_mc, t.rep_port[rep_c], routes.port[pkt])
        dst = np.where(is_mc, t.rep_instance[rep_c], routes.dst[pkt])
    else:
        port, dst = routes.port[pkt], routes.dst[pkt]
    return Emission(pkt, port, dst, routes.session[pkt], np.repeat(kind == ROUTE_L3, n_out))


def write_mac(rows: np.ndarray, idx: np.ndarray, off: int, mac: np.ndarray) -> None:
    mac = np.asarray(mac, dtype=np.int64)
    for k in range(MAC_LEN):
        rows[idx, off + k] = ((mac >> (8 * (MAC_LEN - 1 - k))) & 0xFF).astype(np.uint8)


def _write_u16(rows, idx, off, v) -> None:
    v = np.asarray(v, dtype=np.int64)
    rows[idx, off] = ((v >> 8) & 0xFF).astype(np.uint8)
    rows[idx, off + 1] = (v & 0xFF).astype(np.uint8)


def _write_u32(rows, idx, off, v) -> None:
    v = np.asarray(v, dtype=np.int64)
    for k in range(4):
        rows[idx, off + k] = ((v >> (8 * (3 - k))) & 0xFF).astype(np.uint8)


def ipv4_checksum(header: np.ndarray) -> np.ndarray:
    """Internet checksum of (M, 20) IPv4 headers whose checksum bytes are zero."""
    h = header.astype(np.int64)
    total = ((h[:, 0::2] << 8) | h[:, 1::2]).sum(axis=1)
    total = (total & 0xFFFF) + (total >> 16)
    total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


class FrameTemplate:
    """L2-L4 headers for luwu packets that arrived without any (UDP attachment) and leave on Ethernet."""

    def __init__(self, service_mac: str, service_ip: str, udp_port: int):
        self.header = np.zeros(ETH_IP_UDP_LEN, dtype=np.uint8)
        self.header[MAC_LEN:2 * MAC_LEN] = [int(x, 16) for x in service_mac.split(":")]
        self.header[12:14] = [ETHERTYPE_IPV4 >> 8, ETHERTYPE_IPV4 & 0xFF]
        self.header[OFF_IP_VER_IHL] = 0x45
        self.header[OFF_IP_TTL] = SYNTH_TTL
        self.header[OFF_IP_PROTO] = IPPROTO_UDP
        self.header[OFF_IP_SRC:OFF_IP_SRC + 4] = list(ipaddress.IPv4Address(service_ip).packed)
        self.header[OFF_UDP:OFF_UDP + 2] = [udp_port >> 8, udp_port & 0xFF]


def deparse_frames(b, em: Emission, t: CompiledTables, template: FrameTemplate,
                   drops: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frames for the emitted copies: (frames (M', W), lengths (M',), kept mask over em)."""
    m = len(em)
    keep = np.ones(m, dtype=bool)
    luwu = ~em.l3
    hit, row = t.endpoints.find(em.session, em.dst)
    miss = luwu & ~hit
    if miss.any():
        keep &= ~miss
        drops.append((DropReason.NO_ROUTE, em.pkt[miss]))
    pkt = em.pkt
    if b.framed:
        lengths = np.where(luwu, ETH_IP_UDP_LEN + b.luwu_len[pkt], b.length[pkt])
    else:
        lengths = ETH_IP_UDP_LEN + b.luwu_len[pkt]
    width = int(lengths.max()) if m else ETH_IP_UDP_LEN
    frames = np.zeros((m, max(width, ETH_IP_UDP_LEN)), dtype=np.uint8)
    if b.framed:
        for i in range(m):  # variable-length copies; frames are the slow path
            frames[i, :lengths[i]] = b.rows[pkt[i], :lengths[i]]
    else:
        frames[:, :ETH_IP_UDP_LEN] = template.header
        for i in range(m):
            n = int(b.luwu_len[pkt[i]])
            frames[i, ETH_IP_UDP_LEN:ETH_IP_UDP_LEN + n] = b.rows[pkt[i], :n]
    li = np.flatnonzero(luwu & keep)
    if len(li):
        if b.framed:  # reply from the address the packet was sent to (synthesised frames already do)
            frames[li, MAC_LEN:2 * MAC_LEN] = frames[li, 0:MAC_LEN]
            frames[li, OFF_IP_SRC:OFF_IP_SRC + 4] = frames[li, OFF_IP_DST:OFF_IP_DST + 4]
            frames[li, OFF_UDP:OFF_UDP + 2] = frames[li, OFF_UDP_DPORT:OFF_UDP_DPORT + 2]
        r = row[li]
        ep = t.endpoints.params
        write_mac(frames, li, 0, ep["dst_mac"][r])
        _write_u32(frames, li, OFF_IP_DST, ep["dst_ip"][r])
        _write_u16(frames, li, OFF_UDP_DPORT, ep["dst_udp"][r])
        n = lengths[li] - ETH_IP_UDP_LEN
        _write_u16(frames, li, OFF_UDP_LEN, n + UDP_LEN)
        _write_u16(frames, li, OFF_IP_TOTAL_LEN, n + UDP_LEN + IPV4_MIN_LEN)
        frames[li, OFF_UDP_CSUM:OFF_UDP_CSUM + 2] = 0
        frames[li, OFF_IP_CSUM:OFF_IP_CSUM + 2] = 0
        _write_u16(frames, li, OFF_IP_CSUM, ipv4_checksum(frames[li, ETH_LEN:ETH_LEN + IPV4_MIN_LEN]))
    return frames[keep], lengths[keep], keep
