"""forwarder: plain L3 for IPv4 that is not luwu (`ipv4_lpm`, p4lang/tutorials style).

A hit on `ipv4_forward(port, dst_mac)` rewrites the frame in place: source MAC = the old
destination MAC, destination MAC = dst_mac, TTL - 1, IPv4 header checksum recomputed. A miss,
the `drop` action, or a TTL that would reach 0 (a loop guard the tutorials lack) drops
NO_ROUTE.
"""

from __future__ import annotations

import numpy as np

from ...protocol import DropReason, Event
from ..lookup import CompiledTables
from .next_step_selector import ROUTE_L3
from .parser import ETH_LEN, IPV4_MIN_LEN, OFF_IP_CSUM, OFF_IP_DST, OFF_IP_TTL
from .sender import ipv4_checksum, write_mac

MAC_LEN = 6


def forward(b, t: CompiledTables, routes, events: list) -> None:
    idx = np.flatnonzero(b.ipv4 & (b.drop == 0))
    if len(idx) == 0:
        return
    rows = b.rows
    dst = ((rows[idx, OFF_IP_DST].astype(np.int64) << 24) | (rows[idx, OFF_IP_DST + 1].astype(np.int64) << 16)
           | (rows[idx, OFF_IP_DST + 2].astype(np.int64) << 8) | rows[idx, OFF_IP_DST + 3])
    fwd, port, mac = t.route_ipv4(dst)
    ttl = rows[idx, OFF_IP_TTL].astype(np.int64)
    ok = fwd & (ttl > 1)
    b.drop[idx[~ok]] = DropReason.NO_ROUTE
    go = idx[ok]
    if len(go) == 0:
        return
    rows[go, MAC_LEN:2 * MAC_LEN] = rows[go, 0:MAC_LEN]
    write_mac(rows, go, 0, mac[ok])
    rows[go, OFF_IP_TTL] = (ttl[ok] - 1).astype(np.uint8)
    rows[go, OFF_IP_CSUM:OFF_IP_CSUM + 2] = 0
    csum = ipv4_checksum(rows[go, ETH_LEN:ETH_LEN + IPV4_MIN_LEN])
    rows[go, OFF_IP_CSUM] = (csum >> 8).astype(np.uint8)
    rows[go, OFF_IP_CSUM + 1] = (csum & 0xFF).astype(np.uint8)
    routes.kind[go] = ROUTE_L3
    routes.port[go] = port[ok]
    events.append((Event.FORWARDED, go))
