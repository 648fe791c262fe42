"""The netns backend: an `EmulationSpec` built from plain network namespaces and veth pairs (pyroute2).

For machines without Mininet, and for CI. Hosts are named namespaces (`lwm<run>-<host>`); switch
ports are veth pairs whose root-namespace end (the spec's interface name) the switch program
attaches to over AF_PACKET and whose other end is the host's eth0, eth1, ...; switch-to-switch
links are veth pairs with both ends in the root namespace; a rail-only server's NVLink is a bridge
in a namespace of its own. Bandwidth is a tc htb class on both ends of a link, the MTU is set on
every end, IPv6 is off (so the links carry only what the run sends).

Everything made is recorded as it is made, and `stop()` removes exactly that, in reverse, whatever
failed on the way; names that already exist are refused rather than reused.
"""

from __future__ import annotations

import os

from .emulation import EmuHost, EmulationSpec
from .nsexec import tx_checksum_off, write_sysctls
from .topologies import NAME_PREFIX

NETNS_DIR = "/run/netns"
HTB_HANDLE, HTB_CLASS = "1:", "1:10"
HTB_DEFAULT_CLASS = 0x10
HTB_BURST_BYTES = 64 * 1024  # several jumbo frames: shaping must not starve 9000-byte frames
HOST_SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}


def root_port_sysctls(ifname: str) -> dict[str, str]:
    """A switch port's root-namespace end belongs to the switch program: the root namespace's own
    stack neither speaks IPv6 on it nor answers ARP there (its addresses must stay unreachable
    from the emulated hosts)."""
    return {f"net.ipv6.conf.{ifname}.disable_ipv6": "1", f"net.ipv4.conf.{ifname}.arp_ignore": "8"}


class NetnsError(RuntimeError):
    """The network could not be built; the message says what failed."""


def _safe_children() -> None:
    """pyroute2 forks a child to open a socket inside a namespace. In its default "fork" mode a
    signal that reaches that child as an exception (Ctrl-C, the runner's SIGTERM) unwinds into
    *our* stack inside the child -- which would then run our teardown. Its "mp" mode runs the
    child under multiprocessing, which always ends the child with os._exit."""
    from pyroute2 import config

    config.child_process_mode = "mp"


def require_root() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "the netns backend needs root (network namespaces, veth pairs, AF_PACKET)"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "the netns backend needs pyroute2 (pip install pyroute2)"
    return None


class NetnsNetwork:
    def __init__(self, spec: EmulationSpec):
        self.spec = spec
        self._namespaces: list[str] = []  # created, in order
        self._links: list[str] = []  # root-namespace veth ends created (deleting one deletes its peer)

    # -- names ----------------------------------------------------------------------------------
    def ns_name(self, node: str) -> str:
        return f"{NAME_PREFIX}{self.spec.run_id}-{node}"

    def namespaces(self) -> dict[str, str]:
        """host name -> path of its network namespace."""
        return {h.name: f"{NETNS_DIR}/{self.ns_name(h.name)}" for h in self.spec.hosts}

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> dict[str, str]:
        why = require_root()
        if why:
            raise NetnsError(why)
        _safe_children()
        from pyroute2 import IPRoute, netns

        taken = set(netns.listnetns())
        with IPRoute() as ip:
            clash = [n for n in self.spec.root_interfaces() if ip.link_lookup(ifname=n)]
        clash += [self.ns_name(n) for n in [h.name for h in self.spec.hosts] + [b.name for b in self.spec.bridges]
                  if self.ns_name(n) in taken]
        if clash:
            raise NetnsError(f"names of run {self.spec.run_id} already exist: {', '.join(clash)}; pick another run id "
                             "(or remove what a killed run left: ip link del NAME / ip netns del NAME)")
        try:
            self._build()
        except Exception:
            self.stop()
            raise
        return self.namespaces()

    def _build(self) -> None:
        from pyroute2 import IPRoute, NetNS, netns

        spec = self.spec
        for name in [h.name for h in spec.hosts] + [b.name for b in spec.bridges]:
            netns.create(self.ns_name(name))
            self._namespaces.append(self.ns_name(name))
        paths = self.namespaces()
        for h in spec.hosts:
            write_sysctls(paths[h.name], HOST_SYSCTLS)
        for b in spec.bridges:
            path = f"{NETNS_DIR}/{self.ns_name(b.name)}"
            write_sysctls(path, {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"})
            with NetNS(self.ns_name(b.name)) as ns:
                ns.link("add", ifname=b.ifname, kind="bridge")
                ns.link("set", index=ns.link_lookup(ifname=b.ifname)[0], state="up")
        bridges = {b.name: b for b in spec.bridges}
        switches = {s.name for s in spec.switches}
        with IPRoute() as ip:
            for link in spec.links:
                if link.b in switches:  # switch to switch: both ends stay here
                    ip.link("add", ifname=link.a_intf, kind="veth", peer={"ifname": link.b_intf})
                    self._links.append(link.a_intf)
                    for end in (link.a_intf, link.b_intf):
                        self._root_end(ip, end, link.bw_mbit)
                    continue
                peer_ns = self.ns_name(link.b)
                ip.link("add", ifname=link.a_intf, kind="veth", peer={"ifname": link.b_intf, "net_ns_fd": peer_ns})
                if link.a in bridges:  # the bridge end moves into the bridge's namespace
                    idx = ip.link_lookup(ifname=link.a_intf)[0]
                    ip.link("set", index=idx, net_ns_fd=self.ns_name(link.a))
                    with NetNS(self.ns_name(link.a)) as ns:
                        i = ns.link_lookup(ifname=link.a_intf)[0]
                        br = ns.link_lookup(ifname=bridges[link.a].ifname)[0]
                        ns.link("set", index=i, master=br, mtu=spec.mtu, state="up")
                    continue
                self._links.append(link.a_intf)
                self._root_end(ip, link.a_intf, link.bw_mbit)
        shaped = {(lk.b, lk.b_intf): lk.bw_mbit for lk in spec.links if lk.b not in switches}
        for h in spec.hosts:
            self._host(h, {i.name: shaped.get((h.name, i.name), 0.0) for i in h.interfaces})

    def _root_end(self, ip, ifname: str, bw_mbit: float) -> None:
        write_sysctls(None, root_port_sysctls(ifname))
        idx = ip.link_lookup(ifname=ifname)[0]
        ip.link("set", index=idx, mtu=self.spec.mtu, state="up")
        _shape(ip, idx, bw_mbit)

    def _host(self, h: EmuHost, bw: dict[str, float]) -> None:
        from pyroute2 import NetNS

        with NetNS(self.ns_name(h.name)) as ns:
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
            for iface in h.interfaces:
                idx = ns.link_lookup(ifname=iface.name)[0]
                ns.link("set", index=idx, address=iface.mac, mtu=self.spec.mtu, state="up")
                ns.addr("add", index=idx, address=iface.ip, prefixlen=iface.prefixlen)
                _shape(ns, idx, bw.get(iface.name, 0.0))
            for dst, dev in h.routes:
                ns.route("add", dst=dst, oif=ns.link_lookup(ifname=dev)[0])
            for ip_, mac, dev in h.neighbors:
                ns.neigh("replace", dst=ip_, lladdr=mac, ifindex=ns.link_lookup(ifname=dev)[0], state=NUD_PERMANENT)
            for dst, via, dev, src in h.via_routes:  # rail-only: other GPUs through the rail or a mate's NVLink
                ns.route("add", dst=dst, gateway=via, oif=ns.link_lookup(ifname=dev)[0], prefsrc=src)
        if h.sysctls:  # after the interfaces exist: some are per interface
            write_sysctls(f"{NETNS_DIR}/{self.ns_name(h.name)}", h.sysctls)
        tx_checksum_off(f"{NETNS_DIR}/{self.ns_name(h.name)}", h.tx_checksum_off)

    def alive(self) -> bool:
        return bool(self._namespaces)

    def stop(self) -> list[str]:
        """Remove what start() made; returns what could not be removed (normally nothing)."""
        from pyroute2 import IPRoute, netns

        left = []
        with IPRoute() as ip:
            for name in reversed(self._links):
                try:
                    for idx in ip.link_lookup(ifname=name):
                        ip.link("del", index=idx)
                except Exception as e:  # keep going: the rest must still be removed
                    left.append(f"interface {name}: {e}")
        self._links.clear()
        for name in reversed(self._namespaces):
            try:
                netns.remove(name)
            except Exception as e:
                left.append(f"namespace {name}: {e}")
        self._namespaces.clear()
        return left

    def __enter__(self) -> NetnsNetwork:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


NUD_PERMANENT = 0x80


def _shape(ipr, index: int, bw_mbit: float) -> None:
    """Limit an interface's egress to `bw_mbit` with one htb class (what Mininet's TCLink does)."""
    if not bw_mbit:
        return
    rate = f"{bw_mbit:g}mbit"
    ipr.tc("add", "htb", index=index, handle=HTB_HANDLE, default=HTB_DEFAULT_CLASS)
    ipr.tc("add-class", "htb", index=index, handle=HTB_CLASS, parent=HTB_HANDLE, rate=rate, ceil=rate,
           burst=HTB_BURST_BYTES, cburst=HTB_BURST_BYTES)
