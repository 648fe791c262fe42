"""The network as plain data: switches, hosts (workers, optimizer nodes), links with port numbers.

The planner reads a `Topology` (built from the controller's registrations, or from one of the
builders below) and the Mininet runner builds the same object into an emulated network, so the
model holds no behaviour beyond lookups and stays JSON-serialisable.

Builders: `star` (N workers and M nodes on one switch), `multi_rack` (top-of-rack switches
partially aggregate their racks; a cluster switch aggregates the ToRs and reaches the nodes),
`rail_only` (servers of K GPUs, GPU k of every server on rail switch k, no spine; an optimizer
node reachable from every rail by one port per rail, or one node per rail).
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field

ROLES = ("star", "tor", "cluster", "rail")
HOST_KINDS = ("worker", "node")
LINK_KINDS = ("ethernet", "nvlink")  # nvlink: inside a rail-only server (no switch on it)
DEFAULT_SUBNET = "10.0.0.0/16"


@dataclass
class SwitchSpec:
    name: str
    role: str = "star"
    lanes: int = 2048
    slots: int = 4096
    rail: int = 0
    open_ports: list[int] = field(default_factory=list)  # free ports where workers may be placed
    port_udp: dict[int, str] = field(default_factory=dict)  # port -> "HOST:PORT" (UDP) or "shm:/dev/shm/NAME"
    port_mac: dict[int, str] = field(default_factory=dict)  # port -> the peer's MAC, when known
    service_address: str = ""  # IPv4 endpoints send luwu packets to (Ethernet)
    udp_port: int = 0  # luwu UDP port of the switch program (0: the protocol default)

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"switch {self.name!r}: role {self.role!r} must be one of {', '.join(ROLES)}")
        if self.slots <= 0 or self.lanes <= 0:
            raise ValueError(f"switch {self.name!r}: lanes and slots must be positive")


@dataclass
class HostSpec:
    name: str
    kind: str = "worker"  # "worker" (a GPU + its engine) or "node" (an optimizer node)
    ip: str = ""
    mac: str = ""
    server: str = ""  # rail-only: the server this GPU belongs to


@dataclass
class Link:
    a: str
    a_port: int
    b: str
    b_port: int
    kind: str = "ethernet"

    def other(self, name: str) -> tuple[str, int]:
        return (self.b, self.b_port) if name == self.a else (self.a, self.a_port)

    def port_of(self, name: str) -> int:
        return self.a_port if name == self.a else self.b_port


@dataclass
class Topology:
    switches: dict[str, SwitchSpec] = field(default_factory=dict)
    hosts: dict[str, HostSpec] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)

    # -- building ----------------------------------------------------------------------------
    def add_switch(self, spec: SwitchSpec) -> SwitchSpec:
        spec.validate()
        if spec.name in self.switches or spec.name in self.hosts:
            raise ValueError(f"duplicate topology name {spec.name!r}")
        self.switches[spec.name] = spec
        return spec

    def add_host(self, spec: HostSpec) -> HostSpec:
        if spec.kind not in HOST_KINDS:
            raise ValueError(f"host {spec.name!r}: kind {spec.kind!r} must be one of {HOST_KINDS}")
        if spec.name in self.switches or spec.name in self.hosts:
            raise ValueError(f"duplicate topology name {spec.name!r}")
        self.hosts[spec.name] = spec
        return spec

    def link(self, a: str, a_port: int, b: str, b_port: int = 0, kind: str = "ethernet") -> Link:
        for name, port in ((a, a_port), (b, b_port)):
            if name not in self.switches and name not in self.hosts:
                raise ValueError(f"link end {name!r} is neither a switch nor a host")
            if name in self.switches and self.peer(name, port) is not None:
                raise ValueError(f"switch {name!r} port {port} is already linked")
        link = Link(a, a_port, b, b_port, kind)
        self.links.append(link)
        return link

    # -- lookups ------------------------------------------------------------------------------
    def peer(self, switch: str, port: int) -> tuple[str, int] | None:
        for link in self.links:
            if (link.a == switch and link.a_port == port) or (link.b == switch and link.b_port == port):
                return link.other(switch)
        return None

    def links_of(self, name: str) -> list[Link]:
        return [link for link in self.links if name in (link.a, link.b)]

    def switch_neighbours(self, switch: str) -> list[tuple[int, str, int]]:
        """(local port, neighbour switch, its port) for every switch-to-switch link, by port."""
        out = []
        for link in self.links_of(switch):
            other, other_port = link.other(switch)
            if other in self.switches:
                out.append((link.port_of(switch), other, other_port))
        return sorted(out)

    def node_ports(self, switch: str) -> list[tuple[int, str]]:
        """(port, node name) of the optimizer nodes attached to a switch, by port."""
        out = []
        for link in self.links_of(switch):
            other, _ = link.other(switch)
            if other in self.hosts and self.hosts[other].kind == "node":
                out.append((link.port_of(switch), other))
        return sorted(out)

    def node_attachments(self, node: str) -> list[tuple[str, int]]:
        """(switch, port) where a node is plugged in, sorted."""
        return sorted((link.other(node)[0], link.other(node)[1]) for link in self.links_of(node)
                      if link.other(node)[0] in self.switches)

    def worker_ports(self, switch: str) -> list[int]:
        """Ports of a switch that hold (or may hold) a worker, sorted."""
        ports = set(self.switches[switch].open_ports)
        for link in self.links_of(switch):
            other, _ = link.other(switch)
            if other in self.hosts and self.hosts[other].kind == "worker":
                ports.add(link.port_of(switch))
        return sorted(ports)

    def worker_host(self, switch: str, port: int) -> HostSpec | None:
        peer = self.peer(switch, port)
        if peer and peer[0] in self.hosts and self.hosts[peer[0]].kind == "worker":
            return self.hosts[peer[0]]
        return None

    # -- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"switches": [asdict(s) for s in self.switches.values()],
                "hosts": [asdict(h) for h in self.hosts.values()],
                "links": [asdict(link) for link in self.links]}

    @classmethod
    def from_dict(cls, raw: dict) -> Topology:
        topo = cls()
        for s in raw.get("switches", []):
            s = dict(s)
            for key in ("port_udp", "port_mac"):  # JSON object keys are strings
                s[key] = {int(k): v for k, v in s.get(key, {}).items()}
            topo.add_switch(SwitchSpec(**s))
        for h in raw.get("hosts", []):
            topo.add_host(HostSpec(**h))
        for link in raw.get("links", []):
            topo.link(**link)
        return topo


class _Addresses:
    """Deterministic host IPs and MACs from one subnet, in creation order."""

    def __init__(self, subnet: str = DEFAULT_SUBNET):
        self._hosts = ipaddress.ip_network(subnet).hosts()
        self._n = 0

    def next(self) -> tuple[str, str]:
        self._n += 1
        mac = ":".join(f"{b:02x}" for b in (0x02, 0, 0, (self._n >> 16) & 0xFF, (self._n >> 8) & 0xFF, self._n & 0xFF))
        return str(next(self._hosts)), mac


def star(workers: int, nodes: int = 1, lanes: int = 2048, slots: int = 4096, name: str = "s1") -> Topology:
    """N workers on ports 1..N and M optimizer nodes on ports N+1..N+M of one switch."""
    topo, addr = Topology(), _Addresses()
    topo.add_switch(SwitchSpec(name, "star", lanes, slots))
    for r in range(workers):
        ip, mac = addr.next()
        topo.add_host(HostSpec(f"w{r}", "worker", ip, mac))
        topo.link(name, r + 1, f"w{r}")
    for i in range(nodes):
        ip, mac = addr.next()
        topo.add_host(HostSpec(f"n{i}", "node", ip, mac))
        topo.link(name, workers + 1 + i, f"n{i}")
    return topo


def multi_rack(racks: int, workers_per_rack: int, nodes: int = 1, lanes: int = 2048, slots: int = 4096) -> Topology:
    """ToR r (`tor{r}`) has its rack's workers on ports 1..W and its uplink on port W+1, wired to
    port r+1 of the cluster switch; the nodes hang off the cluster switch after the ToRs."""
    topo, addr = Topology(), _Addresses()
    topo.add_switch(SwitchSpec("cluster", "cluster", lanes, slots))
    for r in range(racks):
        tor = topo.add_switch(SwitchSpec(f"tor{r}", "tor", lanes, slots)).name
        for w in range(workers_per_rack):
            ip, mac = addr.next()
            host = topo.add_host(HostSpec(f"r{r}w{w}", "worker", ip, mac)).name
            topo.link(tor, w + 1, host)
        topo.link(tor, workers_per_rack + 1, "cluster", r + 1)
    for i in range(nodes):
        ip, mac = addr.next()
        topo.add_host(HostSpec(f"n{i}", "node", ip, mac))
        topo.link("cluster", racks + 1 + i, f"n{i}")
    return topo


def rail_only(servers: int, gpus_per_server: int, node_mode: str = "port_per_rail", lanes: int = 2048,
              slots: int = 4096) -> Topology:
    """Rail switch k (`rail{k}`) has GPU k of server s on port s+1; GPUs of a server are joined by
    nvlink links (no switch). node_mode "port_per_rail": one node `n0` with a port on every rail
    (rail port servers+1); "node_per_rail": node `n{k}` on rail k only, holding that rail's shards."""
    if node_mode not in ("port_per_rail", "node_per_rail"):
        raise ValueError(f"node_mode {node_mode!r} must be 'port_per_rail' or 'node_per_rail'")
    topo, addr = Topology(), _Addresses()
    for k in range(gpus_per_server):
        topo.add_switch(SwitchSpec(f"rail{k}", "rail", lanes, slots, rail=k))
    for s in range(servers):
        for k in range(gpus_per_server):
            ip, mac = addr.next()
            topo.add_host(HostSpec(f"s{s}g{k}", "worker", ip, mac, server=f"s{s}"))
            topo.link(f"rail{k}", s + 1, f"s{s}g{k}")
            if k:
                topo.link(f"s{s}g0", 0, f"s{s}g{k}", 0, kind="nvlink")
    if node_mode == "port_per_rail":
        ip, mac = addr.next()
        topo.add_host(HostSpec("n0", "node", ip, mac))
        for k in range(gpus_per_server):
            topo.link(f"rail{k}", servers + 1, "n0", k + 1)
    else:
        for k in range(gpus_per_server):
            ip, mac = addr.next()
            topo.add_host(HostSpec(f"n{k}", "node", ip, mac))
            topo.link(f"rail{k}", servers + 1, f"n{k}")
    return topo
