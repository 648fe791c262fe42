"""parser: frames -> Ethernet/IPv4/UDP/luwu fields (or luwu-only datagrams) for a whole batch.

Frames: luwu is UDP to the configured port in an IPv4 packet without options (IHL 5) and not
a non-first fragment; other IPv4 goes to the forwarder; anything else (ARP, IPv6, ...) is
dropped NO_ROUTE (hosts use static ARP). Truncated or inconsistent headers, and luwu packets
shorter than the 32-byte header, are MALFORMED. Then the header check (hcheck, docs/protocol.md
3.5) of every luwu packet, before anything reads its fields: a mismatch is BAD_CHECKSUM (the P4
programs' `verify_checksum` before ingress). Lengths beyond the header are checked by the
classifier.
"""

from __future__ import annotations

import numpy as np

from ...integrity import header_ok, headers_ok
from ...protocol import DATA_HEADER, ETH_IP_UDP_LEN, HEADER_LEN, HEARTBEAT_HEADER, DropReason
from ..batch import Batch

ETH_LEN = 14
IPV4_MIN_LEN = 20
UDP_LEN = 8
ETHERTYPE_IPV4 = 0x0800
IPPROTO_UDP = 17
IPV4_MIN_IHL = 5
FRAGMENT_OFFSET_MASK = 0x1FFF
# byte offsets inside an Ethernet/IPv4(IHL 5)/UDP frame
OFF_ETHERTYPE = 12
OFF_IP_VER_IHL = ETH_LEN
OFF_IP_TOTAL_LEN = ETH_LEN + 2
OFF_IP_FRAG = ETH_LEN + 6
OFF_IP_TTL = ETH_LEN + 8
OFF_IP_PROTO = ETH_LEN + 9
OFF_IP_CSUM = ETH_LEN + 10
OFF_IP_SRC = ETH_LEN + 12
OFF_IP_DST = ETH_LEN + 16
OFF_UDP = ETH_LEN + IPV4_MIN_LEN
OFF_UDP_DPORT = OFF_UDP + 2
OFF_UDP_LEN = OFF_UDP + 4
OFF_UDP_CSUM = OFF_UDP + 6
assert OFF_UDP + UDP_LEN == ETH_IP_UDP_LEN


SMALL = 16  # batches of up to this many packets have their lengths checked on Python ints


D_BAD_CHECKSUM = int(DropReason.BAD_CHECKSUM)
SCALAR_CHECKS = 4  # up to this many luwu packets have their header check computed on Python ints


def check_headers(b: Batch) -> None:
    """Drop (BAD_CHECKSUM) every live luwu packet of `b` whose header check does not match."""
    off = b.off
    if len(b) <= SCALAR_CHECKS:
        rows, drop = b.rows, b.drop
        for i, (ok, d) in enumerate(zip(b.luwu.tolist(), drop.tolist())):
            if ok and not d and not header_ok(rows[i, off:off + HEADER_LEN].tobytes()):
                drop[i] = D_BAD_CHECKSUM
        return
    idx = np.flatnonzero(b.luwu & (b.drop == 0))
    if len(idx):
        good = headers_ok(b.rows[idx, off:off + HEADER_LEN])
        if not good.all():
            b.drop[idx[~good]] = D_BAD_CHECKSUM


def u16(rows: np.ndarray, off: int) -> np.ndarray:
    return (rows[:, off].astype(np.int64) << 8) | rows[:, off + 1]


def parse(b: Batch, udp_port: int) -> None:
    alive = b.drop == 0
    if b.framed:
        _parse_frames(b, alive, udp_port)
    else:
        b.luwu_len = b.length
        if len(b) <= SMALL and min(b.length.tolist(), default=HEADER_LEN) >= HEADER_LEN:
            b.luwu = alive  # (a few packets, none short: most turns) one look on Python ints
        elif (short := b.length < HEADER_LEN).any():  # (rare: most batches need no drop written)
            short &= alive
            b.drop[short] = DropReason.MALFORMED
            b.luwu = alive & ~short
        else:
            b.luwu = alive
        b.ipv4 = np.zeros(len(b), dtype=bool)
    check_headers(b)
    if b.hdr is None:  # (a shared-memory turn's batch comes with views made once: ShmTurn.headers)
        view = b.rows[:, b.off:b.off + HEADER_LEN]
        b.hdr = view.view(DATA_HEADER)[:, 0]
        b.hb = view.view(HEARTBEAT_HEADER)[:, 0]


def _parse_frames(b: Batch, alive: np.ndarray, udp_port: int) -> None:
    rows, n = b.rows, b.length
    runt = n < ETH_LEN
    is_ip = ~runt & (u16(rows, OFF_ETHERTYPE) == ETHERTYPE_IPV4)
    b.drop[alive & runt] = DropReason.MALFORMED
    b.drop[alive & ~runt & ~is_ip] = DropReason.NO_ROUTE
    ver_ihl = rows[:, OFF_IP_VER_IHL]
    ihl = (ver_ihl & 0xF).astype(np.int64)
    total = u16(rows, OFF_IP_TOTAL_LEN)
    ip_ok = (is_ip & (n >= ETH_LEN + IPV4_MIN_LEN) & ((ver_ihl >> 4) == 4) & (ihl >= IPV4_MIN_IHL)
             & (total >= ihl * 4) & (ETH_LEN + total <= n))
    b.drop[alive & is_ip & ~ip_ok] = DropReason.MALFORMED
    udp = (ip_ok & (ihl == IPV4_MIN_IHL) & (rows[:, OFF_IP_PROTO] == IPPROTO_UDP)
           & ((u16(rows, OFF_IP_FRAG) & FRAGMENT_OFFSET_MASK) == 0) & (total >= IPV4_MIN_LEN + UDP_LEN))
    luwu = udp & (u16(rows, OFF_UDP_DPORT) == udp_port)
    udp_len = u16(rows, OFF_UDP_LEN)
    luwu_len = udp_len - UDP_LEN
    bad = luwu & ((udp_len < UDP_LEN) | (IPV4_MIN_LEN + udp_len > total) | (luwu_len < HEADER_LEN))
    b.drop[alive & bad] = DropReason.MALFORMED
    b.luwu = alive & luwu & ~bad
    b.ipv4 = alive & ip_ok & ~luwu
    b.luwu_len = np.where(b.luwu, luwu_len, 0)
