"""Raw (Ethernet) attachment in network namespaces: the `luwu switch` daemon runs in its own
namespace with one veth per host; workers and an optimizer node in three more namespaces speak
real UDP to the switch's service address. Checks the per-replica rewrite (RESULT multicast to
each worker's own address), the unicast rewrite (AGG to the node), L3 forwarding (ping between
hosts through ipv4_lpm) and that ARP is dropped and counted. Root only; everything created here
is removed in the fixture's finally."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from luwu.dataplane.protocol import NODE, MsgType, NextStep

pytestmark = pytest.mark.netns

LANES = 256
SLOTS = 64
SERVICE_IP = "10.255.0.1"  # the switch's luwu service address (any address routed to it)
SWITCH_MAC = "02:00:00:00:00:fe"  # hosts reach it through a static ARP entry
HOSTS = {1: ("w0", 0), 2: ("w1", 1), 3: ("node", NODE)}  # switch port -> (name, rank)
DEADLINE = 30.0


def host_ip(port: int) -> str:
    return f"10.0.{port}.1"


def host_mac(port: int) -> str:
    return f"02:00:00:00:01:{port:02x}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, check=check)


def runtime() -> dict:
    entries, mac = [], lambda p: int(host_mac(p).replace(":", ""), 16)
    for sid, pool_base, up_port in ((1, 0, 0), (2, 16, 3)):
        entries.append({"table": "sessions", "match": {"session": sid}, "action_name": "set_session",
                        "action_params": {"pool_base": pool_base, "pool_size": 8, "num_workers": 2, "worker_mask": 3,
                                          "epoch": 5, "mcast_grp": sid, "next_step": int(NextStep.ROOT),
                                          "up_port": up_port, "up_worker": 0}})
        for port, (_, rank) in HOSTS.items():
            if rank != NODE:
                entries.append({"table": "workers", "match": {"session": sid, "worker": rank},
                                "action_name": "set_worker", "action_params": {"worker_bit": 1 << rank, "port": port}})
            entries.append({"table": "endpoints", "match": {"session": sid, "dst": rank}, "action_name": "set_endpoint",
                            "action_params": {"dst_mac": mac(port), "dst_ip": host_ip(port), "dst_udp": 19541}})
    for port in HOSTS:
        entries.append({"table": "ipv4_lpm", "match": {"dst_addr": [host_ip(port), 32]}, "action_name": "ipv4_forward",
                        "action_params": {"port": port, "dst_mac": mac(port)}})
    groups = [{"multicast_group_id": sid, "replicas": [{"egress_port": 1, "instance": 0},
                                                       {"egress_port": 2, "instance": 1}]} for sid in (1, 2)]
    return {"target": "luwu-software-switch", "table_entries": entries, "multicast_group_entries": groups}


@pytest.fixture
def netns():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = f"lw{os.getpid() % 100000}"
    names = {"sw": f"{tag}-sw", **{p: f"{tag}-{n}" for p, (n, _) in HOSTS.items()}}
    made: list[str] = []
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
            made.append(ns)
        for port, ns in ((p, names[p]) for p in HOSTS):
            # created straight inside the namespaces: nothing appears in the root namespace
            sh("ip", "-n", names["sw"], "link", "add", f"s{port}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", names["sw"], "link", "set", f"s{port}", "up")
            sh("ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6")
            sh("ip", "-n", ns, "link", "set", "eth0", "address", host_mac(port))
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{host_ip(port)}/24", "dev", "eth0")
            gw = f"10.0.{port}.254"
            sh("ip", "-n", ns, "neigh", "add", gw, "lladdr", SWITCH_MAC, "dev", "eth0", "nud", "permanent")
            sh("ip", "-n", ns, "route", "add", "default", "via", gw)
        yield names
    finally:
        for ns in made:
            sh("ip", "netns", "pids", ns, check=False)
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", ns, check=False)


ENDPOINT = textwrap.dedent("""
    import json, socket, sys, time
    import numpy as np
    from luwu.dataplane.protocol import Flag, MsgType, NODE, Packet, slot_for
    rank, lanes, service, phases, deadline = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 19541))
    s.settimeout(0.1)
    print("bound", flush=True)
    got, srcs = {}, set()
    end = time.monotonic() + deadline
    def pkt(session, mtype, seq, retx):
        slot, st = slot_for(seq, 0 if session == 1 else 16, 8)
        vals = np.full(lanes, (rank + 1) * 1000 + seq, dtype=">i4")
        return Packet(mtype, session, rank, (Flag.SET if st else 0) | (Flag.RETX if retx else 0), lanes, seq, slot,
                      payload=vals.tobytes()).pack()
    want = phases if rank != NODE else 2
    sent = False
    while len(got) < want and time.monotonic() < end:
        if rank != NODE:
            for seq in range(phases):
                if ("R", seq) not in got:
                    s.sendto(pkt(1, MsgType.ALLREDUCE, seq, sent), (service, 19541))
            if not sent:
                for seq in range(2):
                    s.sendto(pkt(2, MsgType.GRAD, seq, False), (service, 19541))
            sent = True
        try:
            while True:
                data, src = s.recvfrom(65536)
                p = Packet.unpack(data)
                srcs.add(src[0])
                key = ("R" if p.type == MsgType.RESULT else "A", p.seq)
                if (rank != NODE) == (p.type == MsgType.RESULT):
                    got[key] = [int(p.type), int(p.worker), int(p.lanes()[0]), int(p.lanes()[-1])]
        except socket.timeout:
            pass
    print(json.dumps({"got": {f"{k[0]}{k[1]}": v for k, v in got.items()}, "sources": sorted(srcs)}))
""")


def test_raw_attachment_in_namespaces(netns, tmp_path):
    rt = tmp_path / "rt.json"
    rt.write_text(json.dumps(runtime()))
    stats = tmp_path / "stats.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = ["ip", "netns", "exec", netns["sw"], sys.executable, "-m", "luwu.cli", "switch", "--lanes", str(LANES),
           "--slots", str(SLOTS), "--runtime", str(rt), "--stats-file", str(stats), "--stats-interval", "0.1",
           "--config", str(tmp_path / "cfg.yaml")]
    (tmp_path / "cfg.yaml").write_text(f"service_mac: '{SWITCH_MAC}'\n")
    for port in HOSTS:
        cmd += ["--iface", f"{port}=s{port}"]
    switch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = switch.stdout.readline()
        assert ready.startswith('{"ready": true'), ready + switch.stderr.read()
        phases = 6
        procs = {}
        for port in (3, 1, 2):  # the node first: its socket must be bound before AGG arrives
            rank = HOSTS[port][1]
            procs[port] = p = subprocess.Popen(["ip", "netns", "exec", netns[port], sys.executable, "-c", ENDPOINT,
                                                str(rank), str(LANES), SERVICE_IP, str(phases), str(DEADLINE)],
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            assert p.stdout.readline().strip() == "bound", p.stderr.read()
        results = {}
        for port, p in procs.items():
            out, err = p.communicate(timeout=DEADLINE + 30)
            assert p.returncode == 0, err
            results[port] = json.loads(out)
        for port in (1, 2):  # each worker got every RESULT, addressed to itself, with the right sum
            got = results[port]["got"]
            assert sorted(got) == [f"R{s}" for s in range(phases)], got
            assert set(results[port]["sources"]) == {SERVICE_IP}  # results come from the service address
            for s in range(phases):
                mtype, worker, first, last = got[f"R{s}"]
                want = 1000 + s + 2000 + s
                assert (mtype, worker, first, last) == (int(MsgType.RESULT), NODE, want, want)
        node = results[3]["got"]
        assert sorted(node) == ["A0", "A1"] and node["A1"][2] == 1001 + 2001
        # L3: ping from worker 0 to the node's host through ipv4_lpm
        ping = sh("ip", "netns", "exec", netns[1], "ping", "-c", "2", "-W", "5", host_ip(3), check=False)
        assert ping.returncode == 0, ping.stdout + ping.stderr
        arp = sh("ip", "netns", "exec", netns[1], "ping", "-c", "1", "-W", "1", "10.0.1.77", check=False)
        assert arp.returncode != 0  # on-link address: the host ARPs, the switch drops ARP

        def counters():
            try:
                return json.loads(stats.read_text())["counters"]
            except (OSError, ValueError):
                return None
        deadline = time.monotonic() + DEADLINE
        c = counters()
        while time.monotonic() < deadline and (c is None or c["events"]["FORWARDED"][0] < 4
                                               or c["drops"]["NO_ROUTE"][0] < 1):
            time.sleep(0.1)
            c = counters()
        assert c["events"]["COMPLETED"][0] >= phases + 2
        assert c["events"]["FORWARDED"][0] >= 4  # two echo requests and two replies
        assert c["drops"]["NO_ROUTE"][0] >= 1  # the ARP request
        assert json.loads(stats.read_text())["errors"] == 0
    finally:
        switch.terminate()
        try:
            switch.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            switch.kill()
            switch.communicate()
