"""The emulation spec: what a network backend builds, as plain JSON-ready data.

Produced by `topologies.emulate` in the project's venv and consumed by the two backends: the
netns backend (pyroute2, same process) and the Mininet backend, whose network-building script
runs under the system python that Debian's mininet package lives in and reads this spec as JSON
(`mn_network.py`; it imports nothing from luwu). Keys are documented in docs/mininet.md.

Switch ports are veth ends in the root namespace, where the switch program attaches to them;
hosts are network namespaces; `bridges` are plain L2 bridges (a rail-only server's NVLink), each
in a namespace of its own so that the root namespace's bridge netfilter never sees their traffic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class HostIface:
    name: str  # inside the host's namespace: eth0, eth1, ... (to switches), nv0 (NVLink)
    mac: str
    ip: str
    prefixlen: int
    switch: str = ""  # the switch (or "" for NVLink) and its port at the other end
    port: int = 0


@dataclass
class EmuHost:
    name: str
    kind: str  # "worker" or "node" (controller.topology.HOST_KINDS)
    server: str = ""  # rail-only: the server of this GPU
    interfaces: list[HostIface] = field(default_factory=list)
    neighbors: list[tuple[str, str, str]] = field(default_factory=list)  # (ip, mac, dev): static, permanent
    routes: list[tuple[str, str]] = field(default_factory=list)  # (dst/prefix, dev)
    nvlink: str = ""  # the GPU's address on its server's NVLink bridge
    # rail-only: how GPUs reach GPUs of other servers and rails (topologies._cross_rail):
    # (dst/prefix, gateway, dev, preferred source address)
    via_routes: list[tuple[str, str, str, str]] = field(default_factory=list)
    sysctls: dict[str, str] = field(default_factory=dict)  # set once the interfaces are up (ip_forward, ...)
    tx_checksum_off: list[str] = field(default_factory=list)  # interfaces that send forwarded TCP (nsexec)

    def iface(self, name: str) -> HostIface:
        for i in self.interfaces:
            if i.name == name:
                return i
        raise KeyError(f"host {self.name} has no interface {name}")

    def iface_to(self, switch: str) -> HostIface:
        for i in self.interfaces:
            if i.switch == switch:
                return i
        raise KeyError(f"host {self.name} has no link to switch {switch}")


@dataclass
class EmuSwitch:
    name: str
    role: str
    ports: dict[int, str]  # switch port -> root-namespace interface name
    service_ip: str  # hosts send luwu packets here (a static neighbour entry on each host)
    service_mac: str
    udp_port: int
    lanes: int
    slots: int
    # plain IPv4 the switch forwards (`ipv4_lpm` entries): (prefix, prefix length, port, next hop's MAC)
    ipv4_routes: list[tuple[str, int, int, str]] = field(default_factory=list)


@dataclass
class Bridge:
    name: str  # node name (Mininet) / namespace suffix (netns)
    ifname: str  # the bridge device's name


@dataclass
class EmuLink:
    a: str  # a switch or a bridge
    a_intf: str
    b: str  # a host, or (switch-to-switch links) another switch
    b_intf: str
    bw_mbit: float = 0.0  # 0: not shaped; else tc htb rate on both ends
    kind: str = "ethernet"  # or "nvlink"


@dataclass
class EmulationSpec:
    run_id: str
    mtu: int
    subnet: str
    switches: list[EmuSwitch] = field(default_factory=list)
    hosts: list[EmuHost] = field(default_factory=list)
    bridges: list[Bridge] = field(default_factory=list)
    links: list[EmuLink] = field(default_factory=list)

    def switch(self, name: str) -> EmuSwitch:
        for s in self.switches:
            if s.name == name:
                return s
        raise KeyError(f"no switch {name!r} in the emulation")

    def host(self, name: str) -> EmuHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in the emulation")

    def root_interfaces(self) -> list[str]:
        """Interfaces this emulation makes in the root namespace (the switch ports)."""
        return [ifname for s in self.switches for ifname in s.ports.values()]

    def validate(self) -> None:
        names = [s.name for s in self.switches] + [h.name for h in self.hosts] + [b.name for b in self.bridges]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"emulation: names used twice: {', '.join(sorted(dup))}")
        ifs = self.root_interfaces() + [b.ifname for b in self.bridges] + \
            [lk.a_intf for lk in self.links if lk.kind == "nvlink"]
        dup = {n for n in ifs if ifs.count(n) > 1}
        if dup:
            raise ValueError(f"emulation: interface names used twice: {', '.join(sorted(dup))}")
        if not 1280 <= self.mtu <= 65535:
            raise ValueError(f"emulation: mtu {self.mtu} must be in 1280..65535")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, raw: dict) -> EmulationSpec:
        spec = cls(raw["run_id"], raw["mtu"], raw["subnet"])
        spec.switches = [EmuSwitch(**dict(s, ports={int(k): v for k, v in s["ports"].items()},
                                          ipv4_routes=[tuple(r) for r in s.get("ipv4_routes", [])]))
                         for s in raw["switches"]]
        spec.hosts = [EmuHost(h["name"], h["kind"], h["server"], [HostIface(**i) for i in h["interfaces"]],
                              [tuple(n) for n in h["neighbors"]], [tuple(r) for r in h["routes"]], h["nvlink"],
                              [tuple(r) for r in h.get("via_routes", [])], dict(h.get("sysctls", {})),
                              list(h.get("tx_checksum_off", [])))
                      for h in raw["hosts"]]
        spec.bridges = [Bridge(**b) for b in raw["bridges"]]
        spec.links = [EmuLink(**lk) for lk in raw["links"]]
        return spec
