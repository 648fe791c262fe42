"""The peer address of each UDP port, as the switch's tables give it (docs/protocol.md 6.8).

A UDP attachment without a configured peer accepts datagrams only from the address the plan
assigned to whoever is bound to its port: the `endpoints` entry `(session, worker)` of every
`workers` entry on that port, and `(session, 0xFFFF)` of every session whose `up_port` it is
(the optimizer node or the parent switch). The controller writes those entries when a rank
joins (JoinJob's endpoint address); the loopback plan writes them from the addresses it gives
its endpoints. An entry with `dst_udp = 0` names no address. A port whose entries name two
different addresses gets none: it stays unbound (every datagram UNKNOWN_PORT) rather than
letting one of the two speak for the other.
"""

from __future__ import annotations

import ipaddress

from ..protocol import NODE


def peers_from_tables(tables) -> tuple[dict[int, tuple[str, int]], dict[int, set[tuple[str, int]]]]:
    """(port -> the one address the tables name for it, port -> addresses of ports named more than once)."""
    endpoints = {(e["match"]["session"], e["match"]["dst"]): e["params"] for e in tables.entries("endpoints")}
    named: dict[int, set[tuple[str, int]]] = {}

    def note(port: int, session: int, dst: int) -> None:
        ep = endpoints.get((session, dst))
        if ep is not None and ep["dst_udp"]:
            named.setdefault(port, set()).add((str(ipaddress.IPv4Address(ep["dst_ip"])), int(ep["dst_udp"])))

    for w in tables.entries("workers"):
        note(w["params"]["port"], w["match"]["session"], w["match"]["worker"])
    for s in tables.entries("sessions"):
        up = s["params"].get("up_port", 0)
        if up:
            note(up, s["match"]["session"], NODE)
    one = {port: next(iter(addrs)) for port, addrs in named.items() if len(addrs) == 1}
    clash = {port: addrs for port, addrs in named.items() if len(addrs) > 1}
    return one, clash
