"""The emulated topologies: the controller's topology model (`luwu.controller.topology`) made concrete.

`build_topology` picks a builder (star, multi-rack, rail-only) from the runner's options, and
`emulate` turns the resulting `Topology` into an `EmulationSpec` (emulation.py): interface names
unique to one run, switch service addresses, the hosts' static neighbours and routes, link
bandwidth and MTU, and the rail-only servers' NVLink bridges. The model is not duplicated: every
host, switch, port and link comes from the builder; this module only adds what an emulator
needs on top (names, addresses, bandwidth).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from luwu.controller import topology as T
from luwu.dataplane.protocol import DEFAULT_UDP_PORT, MAX_CONTRIBUTORS

from .emulation import Bridge, EmuHost, EmulationSpec, EmuLink, EmuSwitch, HostIface

TOPOLOGIES = ("star", "multi-rack", "rail-only")
NODE_MODES = ("port_per_rail", "node_per_rail")
JUMBO_MTU = 9000  # jumbo mode: a 2048-lane packet is 8224 B of luwu + 28 B of IPv4/UDP
NVLINK_SUBNET = "10.200.0.0/16"  # rail-only: server s's GPUs are 10.200.s.(k+1)/24 on its NVLink bridge
IFNAME_MAX = 15  # Linux interface names (IFNAMSIZ - 1)
NAME_PREFIX = "lwm"  # every kernel object of a run is named lwm<run id>-...: "luwu mininet"


class TopologyError(ValueError):
    """Options that do not make a topology; the message says what to change."""


@dataclass
class TopologyOptions:
    name: str = "star"
    workers: int = 3
    nodes: int = 1  # optimizer nodes (star, multi-rack); rail-only: see node_mode
    racks: int = 2  # multi-rack: workers are split evenly over the racks
    gpus: int = 2  # rail-only: GPUs per server (= rails); servers = workers / gpus
    node_mode: str = "port_per_rail"  # rail-only: one node with a port per rail, or a node per rail
    lanes: int = 2048
    slots: int = 1024  # slots per set of every switch (lane registers: 2 * slots * lanes * 4 B)
    udp_port: int = DEFAULT_UDP_PORT

    def validate(self) -> None:
        if self.name not in TOPOLOGIES:
            raise TopologyError(f"--topo {self.name!r} must be one of {', '.join(TOPOLOGIES)}")
        if self.workers < 1:
            raise TopologyError(f"--workers must be at least 1, got {self.workers}")
        if self.nodes < 0:
            raise TopologyError(f"--nodes must be >= 0, got {self.nodes}")
        if self.name == "star" and self.workers > MAX_CONTRIBUTORS:
            raise TopologyError(f"a star holds at most {MAX_CONTRIBUTORS} workers (one bitmap); use multi-rack")
        if self.name == "multi-rack":
            if self.racks < 1 or self.workers % self.racks:
                raise TopologyError(f"multi-rack: {self.workers} workers do not split evenly over {self.racks} "
                                    f"racks; use --workers a multiple of --racks")
            if self.workers // self.racks > MAX_CONTRIBUTORS or self.racks > MAX_CONTRIBUTORS:
                raise TopologyError(f"multi-rack: at most {MAX_CONTRIBUTORS} workers per rack and racks per cluster")
        if self.name == "rail-only":
            if self.gpus < 1 or self.workers % self.gpus:
                raise TopologyError(f"rail-only: {self.workers} workers do not fill servers of {self.gpus} GPUs; "
                                    f"use --workers a multiple of --gpus")
            if self.workers // self.gpus > MAX_CONTRIBUTORS:
                raise TopologyError(f"rail-only: at most {MAX_CONTRIBUTORS} servers per rail")
            if self.node_mode not in NODE_MODES:
                raise TopologyError(f"--node-mode {self.node_mode!r} must be one of {', '.join(NODE_MODES)}")


def build_topology(opt: TopologyOptions) -> T.Topology:
    """The controller's model of the chosen topology, with every switch's luwu UDP port set."""
    opt.validate()
    if opt.name == "star":
        topo = T.star(opt.workers, opt.nodes, opt.lanes, opt.slots)
    elif opt.name == "multi-rack":
        topo = T.multi_rack(opt.racks, opt.workers // opt.racks, opt.nodes, opt.lanes, opt.slots)
    else:
        topo = T.rail_only(opt.workers // opt.gpus, opt.gpus, opt.node_mode, opt.lanes, opt.slots)
    for sw in topo.switches.values():
        sw.udp_port = opt.udp_port
    return topo


MAC_OUI = (0x02, 0x4C)  # locally administered, "L": the controller's builders use 02:00:...
SERVICE_MAC_PREFIX = 0xFE  # switch service MACs 02:4c:fe:...
EXTRA_MAC_PREFIX = 0xFD  # a multi-homed host's second and later interfaces
NVLINK_MAC_PREFIX = 0xFC


def _mac(prefix: int, index: int) -> str:
    return ":".join(f"{b:02x}" for b in (*MAC_OUI, prefix, (index >> 16) & 0xFF, (index >> 8) & 0xFF, index & 0xFF))


def emulate(topo: T.Topology, run_id: str, mtu: int = JUMBO_MTU, bw_mbit: float = 0.0,
            subnet: str = T.DEFAULT_SUBNET, nvlink_subnet: str = NVLINK_SUBNET) -> EmulationSpec:
    """Concrete names and addresses for `topo`; fills in the model's service addresses and port MACs.

    Root-namespace interface names carry `run_id` (so two runs, or a run and anything else on the
    machine, never touch each other's interfaces); names inside a host's namespace are eth0, eth1
    (links to switches, in link order) and nv0 (NVLink). The last /24 of `subnet` holds the switches'
    service addresses, the one before it the extra addresses of multi-homed hosts (a rail-only node
    with a port per rail).
    """
    if not run_id.isalnum() or len(run_id) > 6:
        raise TopologyError(f"run id {run_id!r} must be 1-6 letters or digits (it prefixes interface names)")
    net = ipaddress.ip_network(subnet)
    if net.prefixlen > 22:
        raise TopologyError(f"subnet {subnet} is too small: it needs room for hosts and two /24 blocks")
    service_block = list(ipaddress.ip_network(f"{net[-256]}/24").hosts())[::-1]
    extra_block = list(ipaddress.ip_network(f"{net[-512]}/24").hosts())
    if len(topo.switches) > len(service_block):
        raise TopologyError(f"{len(topo.switches)} switches need more service addresses than the last /24 of "
                            f"{subnet} holds")
    spec = EmulationSpec(run_id=run_id, mtu=mtu, subnet=subnet)
    sw_index = {name: i for i, name in enumerate(sorted(topo.switches))}
    for name in sorted(topo.switches):
        s = topo.switches[name]
        i = sw_index[name]
        s.service_address = str(service_block[i])
        ports = {}
        for link in topo.links_of(name):
            port = link.port_of(name)
            ports[port] = _ifname(f"{NAME_PREFIX}{run_id}-{i}p{port}")
        spec.switches.append(EmuSwitch(name, s.role, ports, s.service_address, _mac(SERVICE_MAC_PREFIX, i + 1),
                                       s.udp_port or DEFAULT_UDP_PORT, s.lanes, s.slots))
    services = {s.name: s for s in spec.switches}
    extra = iter(extra_block)
    hosts: dict[str, EmuHost] = {}
    for name, h in topo.hosts.items():
        hosts[name] = EmuHost(name, h.kind, h.server)
    for link in topo.links:
        if link.kind == "nvlink":
            continue
        sw_name, host_name = (link.a, link.b) if link.a in topo.switches else (link.b, link.a)
        if host_name in topo.switches:  # switch to switch: each side knows the other's service MAC
            a, b = topo.switches[link.a], topo.switches[link.b]
            a.port_mac[link.a_port] = services[link.b].service_mac
            b.port_mac[link.b_port] = services[link.a].service_mac
            spec.links.append(EmuLink(link.a, services[link.a].ports[link.a_port], link.b,
                                      services[link.b].ports[link.b_port], bw_mbit))
            continue
        h, eh, sw = topo.hosts[host_name], hosts[host_name], services[sw_name]
        port = link.port_of(sw_name)
        first = not eh.interfaces
        if first:
            ip, mac, plen = h.ip, h.mac, net.prefixlen
        else:  # a second port of the same host (rail-only node): its own address on that rail
            ip, mac, plen = str(next(extra)), _mac(EXTRA_MAC_PREFIX, len(spec.links) + 1), 32
        iface = HostIface(f"eth{len(eh.interfaces)}", mac, ip, plen, sw_name, port)
        eh.interfaces.append(iface)
        eh.neighbors.append((sw.service_ip, sw.service_mac, iface.name))
        eh.routes.append((f"{sw.service_ip}/32", iface.name))
        topo.switches[sw_name].port_mac[port] = mac
        spec.links.append(EmuLink(sw_name, sw.ports[port], host_name, iface.name, bw_mbit))
    _nvlink(topo, spec, hosts, run_id, nvlink_subnet)
    _cross_rail(spec, hosts)
    spec.hosts = [hosts[n] for n in topo.hosts]
    spec.validate()
    return spec


def _nvlink(topo: T.Topology, spec: EmulationSpec, hosts: dict[str, EmuHost], run_id: str, subnet: str) -> None:
    """One bridge per rail-only server joining its GPUs (the model's nvlink links say who is on it)."""
    servers: dict[str, list[str]] = {}
    for link in topo.links:
        if link.kind == "nvlink":
            for name in (link.a, link.b):
                server = topo.hosts[name].server
                if name not in servers.setdefault(server, []):
                    servers[server].append(name)
    net = ipaddress.ip_network(subnet)
    for s_index, server in enumerate(sorted(servers)):
        bridge = Bridge(f"{server}nv", _ifname(f"{NAME_PREFIX}{run_id}-b{s_index}"))
        spec.bridges.append(bridge)
        members = sorted(servers[server], key=lambda n: list(topo.hosts).index(n))
        for k, name in enumerate(members):
            ip = net.network_address + (s_index << 8) + k + 1
            if ip not in net:
                raise TopologyError(f"NVLink subnet {subnet} has no room for server {server}")
            iface = HostIface("nv0", _mac(NVLINK_MAC_PREFIX, (s_index << 8) + k + 1), str(ip), 24, "", 0)
            hosts[name].interfaces.append(iface)
            hosts[name].nvlink = str(ip)
            spec.links.append(EmuLink(bridge.name, _ifname(f"{NAME_PREFIX}{run_id}-n{s_index}k{k}"), name, "nv0", 0.0,
                                      kind="nvlink"))


def _cross_rail(spec: EmulationSpec, hosts: dict[str, EmuHost]) -> None:
    """Rail-only unicast between any two GPUs, as the Rail-only paper routes it: every GPU is reached
    at its rail address (eth0), from every other GPU, with that GPU's own rail address as source.

    GPU i of server A to GPU j of server B: same server (A == B): over the NVLink bridge straight to
    it; same rail (i == j): through rail i's switch (its `ipv4_lpm` forwards to the port of the
    destination); otherwise over the NVLink bridge to A's GPU j, which forwards (ip_forward) over
    rail j. The reply takes the mirror path (through B's GPU i and rail i), so rp_filter is off.
    Only the rail switches' own hosts are in their `ipv4_lpm`: the rails stay unconnected.
    """
    gpus = [h for h in hosts.values() if h.nvlink and h.interfaces and h.interfaces[0].switch]
    if not gpus:
        return
    services = {s.name: s for s in spec.switches}
    for h in gpus:  # the rail switch forwards plain IPv4 to the GPUs on its ports
        rail = h.interfaces[0]
        services[rail.switch].ipv4_routes.append((rail.ip, 32, rail.port, rail.mac))
    on = {(h.server, h.interfaces[0].switch): h for h in gpus}
    for x in gpus:
        me = x.interfaces[0]
        for y in gpus:
            if y is x:
                continue
            dst = y.interfaces[0]
            if y.server == x.server:
                x.via_routes.append((f"{dst.ip}/32", y.nvlink, "nv0", me.ip))
            elif dst.switch == me.switch:
                x.via_routes.append((f"{dst.ip}/32", services[me.switch].service_ip, me.name, me.ip))
            else:
                hop = on.get((x.server, dst.switch))
                if hop is None:
                    raise TopologyError(f"server {x.server} has no GPU on {dst.switch}: {x.name} cannot reach "
                                        f"{y.name}")
                x.via_routes.append((f"{dst.ip}/32", hop.nvlink, "nv0", me.ip))
        x.sysctls.update({"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                          "net.ipv4.conf.default.rp_filter": "0"})
        x.sysctls.update({f"net.ipv4.conf.{i.name}.rp_filter": "0" for i in x.interfaces})
        x.tx_checksum_off = [i.name for i in x.interfaces]  # TCP crosses raw-socket switches and forwarding GPUs


def _ifname(name: str) -> str:
    if len(name) > IFNAME_MAX:
        raise TopologyError(f"interface name {name!r} is longer than {IFNAME_MAX} characters: use a shorter "
                            "run id or fewer switches")
    return name
