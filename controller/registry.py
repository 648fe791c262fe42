"""Validates registrations (switches, optimizer nodes) and turns them into the planner's `Topology`.

A switch registration lists its ports with what is on the other end: a free/worker port, an
optimizer node (by name) or another switch (by name and port), and the static IPv4 routes it
declares (`declared_routes`). A link appears in the topology once both ends are registered.
Validation errors are ValueErrors that name the field to fix.
"""

from __future__ import annotations

import ipaddress
import re

from luwu.dataplane.protocol import lanes_for_mode
from luwu.dataplane.session import parse_port_address
from luwu.proto import controller_pb2 as pb

from .addresses import check_control_address, check_port_address
from .job_spec import NAME_RE
from .topology import HostSpec, SwitchSpec, Topology

TARGETS = ("software", "bmv2", "tofino")
ROLE_NAMES = {pb.ROLE_UNSPECIFIED: "star", pb.STAR: "star", pb.TOR: "tor", pb.CLUSTER: "cluster", pb.RAIL: "rail"}
PORT_BITS = 9  # P4 port numbers (docs/protocol.md 6.1)
MAC_RE = re.compile(r"^[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}$")


def check_name(name: str, what: str) -> None:
    if not NAME_RE.match(name or ""):
        raise ValueError(f"{what} name {name!r}: use 1-63 letters, digits, '_', '.', '-'")


def validate_switch(sw: pb.Switch) -> None:
    check_name(sw.name, "switch")
    check_control_address(sw.p4runtime_address, f"switch {sw.name}: p4runtime_address")
    if sw.metrics_address:
        check_control_address(sw.metrics_address, f"switch {sw.name}: metrics_address")
    if sw.target not in TARGETS:
        raise ValueError(f"switch {sw.name}: target {sw.target!r} must be one of {', '.join(TARGETS)}")
    try:
        lanes_for_mode(sw.lanes)
    except ValueError as exc:
        raise ValueError(f"switch {sw.name}: lanes: {exc}") from None
    if sw.slots <= 0:
        raise ValueError(f"switch {sw.name}: slots (per set) must be positive")
    if sw.role not in ROLE_NAMES:
        raise ValueError(f"switch {sw.name}: unknown role {sw.role}")
    if sw.service_address:
        try:
            ipaddress.IPv4Address(sw.service_address)
        except ValueError:
            raise ValueError(f"switch {sw.name}: service_address {sw.service_address!r} must be an IPv4 address") \
                from None
    seen = set()
    for p in sw.ports:
        where = f"switch {sw.name} port {p.number}"
        if p.number in seen:
            raise ValueError(f"{where}: listed twice")
        seen.add(p.number)
        if p.number >= 1 << PORT_BITS:
            raise ValueError(f"{where}: port numbers are {PORT_BITS}-bit (0..{(1 << PORT_BITS) - 1})")
        if p.udp_address:  # A.B.C.D:PORT, or shm:/dev/shm/NAME for a shared-memory port (addresses.py)
            check_port_address(p.udp_address, f"{where}: udp_address")
        if p.mac and not MAC_RE.match(p.mac):
            raise ValueError(f"{where}: mac {p.mac!r} must look like aa:bb:cc:dd:ee:ff")
        if p.ip:
            try:
                ipaddress.IPv4Address(p.ip)
            except ValueError:
                raise ValueError(f"{where}: ip {p.ip!r} must be an IPv4 address") from None
        if p.peer_kind in (pb.PEER_NODE, pb.PEER_SWITCH) and not p.peer:
            raise ValueError(f"{where}: a node or switch port needs `peer` (its name)")
    declared_routes(sw)


def declared_routes(sw: pb.Switch) -> list[tuple[ipaddress.IPv4Network, int, str]]:
    """The static IPv4 routes `sw` declares, as (network, egress port, next hop MAC).

    Raises a ValueError naming the route and what to fix: a prefix that is not A.B.C.D/LEN with
    LEN 1..32 and its host bits zero (a /0 default route has no P4Runtime table entry: the
    table's default action is not the controller's), a port the registration does not list, a
    MAC that is malformed or missing (neither `mac` nor the port's `mac`), a prefix twice."""
    ports = {p.number: p for p in sw.ports}
    out: list[tuple[ipaddress.IPv4Network, int, str]] = []
    seen: set[ipaddress.IPv4Network] = set()
    for r in sw.routes:
        where = f"switch {sw.name} route {r.prefix}={r.port}"
        _address, slash, length = r.prefix.partition("/")
        if not slash or not length.isdigit() or not 1 <= int(length) <= 32:
            raise ValueError(f"{where}: prefix {r.prefix!r} must be A.B.C.D/LEN with LEN 1..32")
        try:
            net = ipaddress.IPv4Network(r.prefix)
        except ValueError as exc:
            raise ValueError(f"{where}: prefix {r.prefix!r} is not an IPv4 network ({exc})") from None
        if net in seen:
            raise ValueError(f"{where}: prefix {net} is declared twice")
        seen.add(net)
        if r.port not in ports:
            raise ValueError(f"{where}: port {r.port} is not one of the switch's ports "
                             f"({', '.join(str(n) for n in sorted(ports)) or 'none registered'})")
        mac = r.mac or ports[r.port].mac
        if not mac:
            raise ValueError(f"{where}: no next-hop MAC: give mac=aa:bb:cc:dd:ee:ff or the port's MAC")
        if not MAC_RE.match(mac):
            raise ValueError(f"{where}: mac {mac!r} must look like aa:bb:cc:dd:ee:ff")
        out.append((net, r.port, mac))
    return out


def validate_node(node: pb.Node) -> None:
    check_name(node.name, "node")
    check_port_address(node.data_address, f"node {node.name}: data_address")  # its UDP socket or shm port
    c = node.capacity
    if c.params_per_second < 0 or c.params_per_second != c.params_per_second:
        raise ValueError(f"node {node.name}: capacity.params_per_second must be a number >= 0")


def build_topology(switches: dict[str, pb.Switch], nodes: dict[str, pb.Node]) -> Topology:
    topo = Topology()
    for name in sorted(nodes):
        transport, (host, _) = parse_port_address(nodes[name].data_address, "data_address")
        topo.add_host(HostSpec(name, "node", ip=host if transport == "udp" and _is_ipv4(host) else ""))
    for name in sorted(switches):
        sw = switches[name]
        topo.add_switch(SwitchSpec(
            name, ROLE_NAMES[sw.role], sw.lanes, sw.slots, rail=sw.rail,
            open_ports=sorted(p.number for p in sw.ports if p.peer_kind in (pb.PEER_UNSPECIFIED, pb.PEER_WORKER)),
            port_udp={p.number: p.udp_address for p in sw.ports if p.udp_address},
            port_mac={p.number: p.mac for p in sw.ports if p.mac},
            service_address=sw.service_address, udp_port=sw.udp_port))
    for name in sorted(switches):
        for p in sorted(switches[name].ports, key=lambda p: p.number):
            if p.peer_kind == pb.PEER_NODE and p.peer in nodes:
                topo.link(name, p.number, p.peer, 0)
            elif (p.peer_kind == pb.PEER_SWITCH and p.peer in switches and topo.peer(name, p.number) is None
                  and topo.peer(p.peer, p.peer_port) is None):
                topo.link(name, p.number, p.peer, p.peer_port)
    return topo


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False
