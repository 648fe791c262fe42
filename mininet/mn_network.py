#!/usr/bin/env python3
"""Builds an emulation spec in Mininet and holds it up until told to stop (system python, root).

    /usr/bin/python3 mn_network.py SPEC.json

Debian's mininet package lives in the system python and the project in its venv, so this script
imports only mininet and the standard library and does one thing: it reads the JSON spec that
the venv side wrote (luwu.mininet.emulation: switches with their port interfaces, hosts with
addresses, static neighbours and routes, links with bandwidth, NVLink bridges), builds it, and
prints one line

    {"ready": true, "namespaces": {HOST: PID, ...}, "pids": {NODE: PID of its shell, ...}}

The venv side then starts the switch programs on the switch nodes' interfaces and the workloads
inside the hosts (entering /proc/PID/ns/net). On "stop" (or EOF) on stdin, SIGTERM, SIGINT or
SIGHUP it tears the network down (Mininet's net.stop(): links, node shells) and prints
{"stopped": true}.

Switch nodes are `PortsOnly`: Mininet makes their interfaces (root namespace, the spec's names,
TCLink shaping when asked) and forwards nothing; the luwu switch program is the data plane.
NVLink bridges are `NvlinkBridge` nodes in their own namespace. Mininet's start-up tuning of
machine-wide limits (fixLimits: sysctls of the root namespace) is skipped, and nothing like
`mn -c` is ever run: interfaces carry the run's id and only this run's objects are removed.
"""

import json
import os
import select
import signal
import sys

RC_MARK = "__luwu_rc="


def fail(msg):
    print(json.dumps({"error": msg}), flush=True)
    sys.exit(1)


def main(argv):
    if len(argv) != 1:
        print("usage: mn_network.py SPEC.json", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        fail("Mininet needs root")
    try:
        from mininet.link import Link, TCLink
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.node import Switch
    except ImportError as e:
        fail(f"this python ({sys.executable}) cannot import mininet ({e}): apt-get install mininet")
    with open(argv[0]) as f:
        spec = json.load(f)
    setLogLevel(os.environ.get("LUWU_MININET_LOG", "warning"))

    def run(node, cmd):
        out = node.cmd(f"{cmd}; echo {RC_MARK}$?")
        text, _, rc = out.rpartition(RC_MARK)
        if rc.strip() != "0":
            raise RuntimeError(f"{node.name}: `{cmd}` failed: {text.strip()}")
        return text

    class PortsOnly(Switch):
        """A switch node whose interfaces a luwu switch program (started by the runner) drives."""

        def start(self, controllers):
            for intf in self.intfList():
                if intf.name != "lo":
                    # the root namespace's stack stays off the port: no IPv6, no ARP answers
                    run(self, f"echo 1 > /proc/sys/net/ipv6/conf/{intf.name}/disable_ipv6")
                    run(self, f"echo 8 > /proc/sys/net/ipv4/conf/{intf.name}/arp_ignore")
                    run(self, f"ip link set dev {intf.name} mtu {spec['mtu']} up")

    class NvlinkBridge(Switch):
        """A rail-only server's NVLink: a Linux bridge in a namespace of its own."""

        def __init__(self, name, bridge="br0", **params):
            params["inNamespace"] = True  # Mininet.addSwitch passes the network's default (False)
            Switch.__init__(self, name, **params)
            self.bridge = bridge

        def start(self, controllers):
            run(self, "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6")
            run(self, f"ip link add name {self.bridge} type bridge")
            run(self, f"ip link set dev {self.bridge} up")
            for intf in self.intfList():
                if intf.name != "lo":
                    run(self, f"ip link set dev {intf.name} mtu {spec['mtu']} master {self.bridge} up")

        def stop(self, deleteIntfs=True):
            self.cmd(f"ip link del {self.bridge}")
            Switch.stop(self, deleteIntfs)

    Mininet.inited = True  # skip Mininet.init()'s fixLimits (root-namespace sysctls); root was checked above
    net = Mininet(topo=None, build=False, controller=None, autoSetMacs=False, autoStaticArp=False)
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        build(net, spec, PortsOnly, NvlinkBridge, Link, TCLink, run)
        pids = {n.name: n.pid for n in net.hosts + net.switches}
        print(json.dumps({"ready": True, "namespaces": {h.name: h.pid for h in net.hosts}, "pids": pids}),
              flush=True)
        while not stopping:
            ready, _, _ = select.select([sys.stdin], [], [], 0.5)
            if ready:
                line = sys.stdin.readline()
                if not line or line.strip() == "stop":
                    break
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # tear down completely even on a second Ctrl-C
        net.stop()
        print(json.dumps({"stopped": True}), flush=True)
    return 0


def build(net, spec, PortsOnly, NvlinkBridge, Link, TCLink, run):
    for i, s in enumerate(spec["switches"]):
        net.addSwitch(s["name"], cls=PortsOnly, dpid=f"{i + 1:x}")
    for i, b in enumerate(spec["bridges"]):
        net.addSwitch(b["name"], cls=NvlinkBridge, dpid=f"{len(spec['switches']) + i + 1:x}", bridge=b["ifname"])
    hosts = {h["name"]: h for h in spec["hosts"]}
    for h in spec["hosts"]:
        net.addHost(h["name"], ip=None)
    for link in spec["links"]:
        params = {"intfName1": link["a_intf"], "intfName2": link["b_intf"]}
        host = hosts.get(link["b"])
        if host is not None:
            params["addr2"] = next(i["mac"] for i in host["interfaces"] if i["name"] == link["b_intf"])
        if link["bw_mbit"]:
            net.addLink(link["a"], link["b"], cls=TCLink, bw=link["bw_mbit"], **params)
        else:
            net.addLink(link["a"], link["b"], cls=Link, **params)
    net.build()
    net.start()
    for h in spec["hosts"]:
        node = net.get(h["name"])
        for key in ("ipv6.conf.all.disable_ipv6", "ipv6.conf.default.disable_ipv6"):
            run(node, f"echo 1 > /proc/sys/net/{key.replace('.', '/')}")
        run(node, "ip link set dev lo up")
        for i in h["interfaces"]:
            run(node, f"ip link set dev {i['name']} address {i['mac']} mtu {spec['mtu']} up")
            run(node, f"ip addr flush dev {i['name']}")
            run(node, f"ip addr add {i['ip']}/{i['prefixlen']} dev {i['name']}")
        for dst, dev in h["routes"]:
            run(node, f"ip route replace {dst} dev {dev}")
        for ip, mac, dev in h["neighbors"]:
            run(node, f"ip neigh replace {ip} lladdr {mac} dev {dev} nud permanent")
        for dst, via, dev, src in h.get("via_routes", []):  # rail-only: other GPUs via the rail or a mate's NVLink
            run(node, f"ip route replace {dst} via {via} dev {dev} src {src}")
        for key, value in h.get("sysctls", {}).items():
            run(node, f"echo {value} > /proc/sys/{key.replace('.', '/')}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
