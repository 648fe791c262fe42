"""The emulation's management network: an out-of-band path from every emulated host to the controller.

Real clusters reach their controller over a management network separate from the data plane;
here it is one Linux bridge in the root namespace (`lwm<run>-mg`, the controller listens on its
address) and one veth pair per host: the root end (`lwm<run>-m<i>`) enslaved to the bridge, the
other end moved into the host's namespace and renamed `mgmt0`, on a /24 of its own. The data
plane (switch ports, NVLink bridges, routes, neighbours) is not touched. It works on any
namespace given as a path, so both backends get it: `/run/netns/NAME` (netns) and
`/proc/PID/ns/net` (a Mininet host).

Each run takes the first /24 of `subnet` that no root-namespace address uses yet (starting at one
derived from the run id), so concurrent runs do not collide. Everything made is recorded as it is
made and `stop()` removes exactly that (deleting a root veth end removes its peer), whatever failed
on the way. Uses the `ip` command (iproute2), as Mininet itself does.
"""

from __future__ import annotations

import ipaddress
import subprocess

from .nsexec import run_in, write_sysctls
from .topologies import NAME_PREFIX

MGMT_SUBNET = "10.254.0.0/16"  # default pool of per-run /24 management networks (--mgmt-subnet)
MGMT_IFACE = "mgmt0"  # the management interface's name inside every host
IP_TIMEOUT = 10.0  # s for one `ip` command


class MgmtError(RuntimeError):
    """The management network could not be built; the message says what failed."""


def _ip(*args: str) -> str:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if p.returncode:
        raise MgmtError(f"ip {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout


def _netns_target(ns_path: str) -> str:
    """What `ip link set DEV netns X` takes for a namespace path: a name under /run/netns, or a pid."""
    parts = ns_path.strip("/").split("/")
    if ns_path.startswith("/run/netns/") and len(parts) == 3:
        return parts[2]
    if ns_path.startswith("/proc/") and parts[-2:] == ["ns", "net"] and parts[1].isdigit():
        return parts[1]
    raise MgmtError(f"cannot give an interface to namespace {ns_path}: expected /run/netns/NAME or /proc/PID/ns/net")


def _used_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    out = _ip("-4", "-o", "addr", "show")
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    return nets


class MgmtNetwork:
    """The management network of run `run_id` over the host namespaces `namespaces` (name -> path).

    Args:
        run_id: the run's id (names every object it makes: lwm<run>-mg, lwm<run>-m<i>).
        namespaces: host name -> path of its network namespace.
        subnet: the pool of /24s to take one from (default MGMT_SUBNET).

    After `start()`: `.gateway` is the root namespace's address on it (where the controller
    listens) and `.addresses` maps each host to its own.
    """

    def __init__(self, run_id: str, namespaces: dict[str, str], subnet: str = MGMT_SUBNET):
        self.run_id, self.namespaces = run_id, dict(namespaces)
        try:
            self.pool = ipaddress.IPv4Network(subnet)
        except ValueError as e:
            raise MgmtError(f"management subnet {subnet!r}: {e}") from None
        if self.pool.prefixlen > 24:
            raise MgmtError(f"management subnet {subnet} must be a /24 or larger")
        if len(namespaces) > 252:
            raise MgmtError(f"{len(namespaces)} hosts do not fit a /24 management network")
        self.bridge = f"{NAME_PREFIX}{run_id}-mg"
        self.gateway = ""
        self.prefixlen = 24
        self.addresses: dict[str, str] = {}
        self._made: list[str] = []  # root-namespace links created, in order

    def _pick_network(self) -> ipaddress.IPv4Network:
        blocks = list(self.pool.subnets(new_prefix=24))
        used = _used_networks()
        try:
            start = int(self.run_id, 16) % len(blocks)
        except ValueError:
            start = 0
        for i in range(len(blocks)):
            net = blocks[(start + i) % len(blocks)]
            if not any(net.overlaps(u) for u in used):
                return net
        raise MgmtError(f"every /24 of the management subnet {self.pool} is in use here: pass another --mgmt-subnet")

    def start(self) -> str:
        """Build it; returns the gateway address. Removes what it made if a step fails."""
        try:
            net = self._pick_network()
            hosts = net.hosts()
            self.gateway = str(next(hosts))
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(self.bridge)
            write_sysctls(None, {f"net.ipv6.conf.{self.bridge}.disable_ipv6": "1"})
            _ip("addr", "add", f"{self.gateway}/{self.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (host, path) in enumerate(sorted(self.namespaces.items())):
                root_end, temp = f"{NAME_PREFIX}{self.run_id}-m{i}", f"{NAME_PREFIX}{self.run_id}-h{i}"
                _ip("link", "add", root_end, "type", "veth", "peer", "name", temp)
                self._made.append(root_end)
                write_sysctls(None, {f"net.ipv6.conf.{root_end}.disable_ipv6": "1"})
                _ip("link", "set", root_end, "master", self.bridge, "up")
                _ip("link", "set", temp, "netns", _netns_target(path))
                address = str(next(hosts))
                run_in(path, ["/bin/sh", "-c", f"set -e; ip link set {temp} name {MGMT_IFACE}; "
                                               f"ip addr add {address}/{self.prefixlen} dev {MGMT_IFACE}; "
                                               f"ip link set {MGMT_IFACE} up"], IP_TIMEOUT)
                self.addresses[host] = address
        except Exception:
            self.stop()
            raise
        return self.gateway

    def stop(self) -> list[str]:
        """Remove what start() made; returns what could not be removed (normally nothing)."""
        left = []
        for name in reversed(self._made):
            try:
                _ip("link", "del", name)
            except (MgmtError, OSError, subprocess.SubprocessError) as e:
                if "Cannot find device" not in str(e):
                    left.append(f"interface {name}: {e}")
        self._made.clear()
        return left
