"""The netns backend end to end (root): real namespaces and veth pairs, `luwu switch` on raw interfaces,
engines in the hosts; exact int32 sums, push/pull through the optimizer node, loss, teardown."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mininet_helpers import ENV, check_clean, counters, leftovers, needs_root, remove_leftovers, run_json

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.protocol import Dtype
from luwu.mininet.netns_backend import NetnsError, NetnsNetwork
from luwu.mininet.nsexec import popen_in, run_in
from luwu.mininet.topologies import NAME_PREFIX, TopologyOptions, build_topology, emulate

pytestmark = [needs_root, pytest.mark.netns]
LANES = 2048
SIZE = "64KiB"  # 16384 int32 = 9 jumbo packets per worker (2046 data lanes each: 2 are check words)
NUMEL = 16384
CHUNKS = -(-NUMEL // data_lanes(LANES, Dtype.INT32))
ECHO_ONCE = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(20); "
             "s.bind(('10.200.0.1', 7007)); print('bound', flush=True); d, a = s.recvfrom(100); "
             "print('got', d.decode(), 'from', a[0])")
SEND_ONE = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "s.bind(('10.200.0.2', 0)); s.sendto(b'hello', ('10.200.0.1', 7007))")


def test_star_of_three_workers_sums_exactly_through_the_software_switch():
    info = run_json("--topo", "star", "--workers", "3", "--backend", "netns", "--size", SIZE)
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["backend"] == "netns" and info["lanes"] == LANES
        assert info["allreduce"]["verified"] == 3
        for w in info["allreduce"]["per_worker"]:
            assert w["mismatches"] == 0 and w["contributors"] == 3 and w["elements"] == 16384
        assert counters(info, "s1", "COMPLETED") == CHUNKS  # every chunk summed in the switch, once
        assert counters(info, "s1", "MULTICAST") == CHUNKS
    finally:
        check_clean(info)


def test_multi_rack_two_by_two_with_loss_and_push_pull():
    info = run_json("--topo", "multi-rack", "--workers", "4", "--racks", "2", "--backend", "netns", "--size", SIZE,
                    "--push-pull", "--drop", "0.03", "--seed", "4")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["allreduce"]["verified"] == 4 and info["pushpull"]["verified"] == 4
        assert info["pushpull"]["node_gradients"] == 2  # two layers, each summed once by the tree
        for sw in ("tor0", "tor1", "cluster"):
            assert counters(info, sw, "COMPLETED") >= CHUNKS  # partial sums at the ToRs, the total at the top
        lost = sum(c["drops"].get("SIMULATED_LOSS", 0) for c in info["counters"].values())
        assert lost > 0  # the loss happened and was recovered from
    finally:
        check_clean(info)


def test_rail_only_hierarchical_allreduce_over_nvlink_and_rails():
    info = run_json("--topo", "rail-only", "--workers", "4", "--gpus", "2", "--backend", "netns", "--size", SIZE)
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        for w in info["allreduce"]["per_worker"]:
            assert w["contributors"] == 4 and w["mismatches"] == 0  # every GPU has the sum over all four
            assert w["rail_allreduce_s"] > 0
        for rail in ("rail0", "rail1"):
            assert counters(info, rail, "COMPLETED") == -(-(NUMEL // 2) // data_lanes(LANES, Dtype.INT32))  # its half
    finally:
        check_clean(info)


def test_a_run_that_cannot_finish_fails_and_still_tears_down():
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--size", SIZE, "--drop", "0.99",
                    "--timeout", "3")
    try:
        assert info["_returncode"] == 1 and not info["passed"]
        assert any("no 'result'" in e for e in info["errors"])
        assert "worker-0.log" in info["_logs"]  # a failed run keeps its logs
    finally:
        check_clean(info)


def test_sigterm_during_the_run_stops_everything(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "luwu.cli", "mininet", "run", "--topo", "star", "--workers", "2",
                          "--backend", "netns", "--size", "8MiB", "--bw", "5", "--timeout", "200",
                          "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV)
    run_id = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run_dir / "worker-1.log").exists() and p.poll() is None:
            time.sleep(0.1)
        assert p.poll() is None, f"the run ended before it could be interrupted: {p.communicate()[1][-2000:]}"
        config = json.loads((run_dir / "s1.switch.json").read_text())
        run_id = next(iter(config["ifaces"].values()))[len(NAME_PREFIX):].split("-")[0]
        assert leftovers(run_id)  # the network is up
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 130, err[-2000:]
        assert "interrupted" in err
        assert leftovers(run_id) == []
        assert subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True).returncode == 1  # no process left
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        if run_id:
            remove_leftovers(run_id)


def test_backend_builds_links_bridges_and_removes_exactly_them():
    topo = build_topology(TopologyOptions("rail-only", workers=4, gpus=2))
    run_id = "t" + secrets.token_hex(2)
    spec = emulate(topo, run_id, bw_mbit=50)
    net = NetnsNetwork(spec)
    try:
        paths = net.start()
        assert set(paths) == {h.name for h in spec.hosts}
        with pytest.raises(NetnsError, match="already exist"):
            NetnsNetwork(spec).start()  # never reuses (or clobbers) another run's names
        out = run_in(paths["s0g1"], ["ip", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert "10.0.0.2/16" in out
        link = run_in(paths["s0g1"], ["ip", "-o", "link", "show", "dev", "eth0"]).stdout
        assert "mtu 9000" in link
        neigh = run_in(paths["s0g1"], ["ip", "neigh", "show", "dev", "eth0"]).stdout
        rail1 = spec.switch("rail1")
        assert rail1.service_ip in neigh and rail1.service_mac in neigh and "PERMANENT" in neigh
        tc = subprocess.run(["tc", "class", "show", "dev", rail1.ports[1]], capture_output=True, text=True).stdout
        assert "50Mbit" in tc
        # NVLink: the two GPUs of server 0 reach each other over their bridge, and only over it
        route = run_in(paths["s0g1"], ["ip", "route", "get", "10.200.0.1"]).stdout
        assert "dev nv0" in route
        listener = popen_in(paths["s0g0"], [sys.executable, "-c", ECHO_ONCE], stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline().strip() == "bound"
            run_in(paths["s0g1"], [sys.executable, "-c", SEND_ONE])
            assert listener.communicate(timeout=30)[0].strip() == "got hello from 10.200.0.2"
        finally:
            if listener.poll() is None:
                listener.kill()
                listener.communicate()
    finally:
        assert net.stop() == []
    assert leftovers(run_id) == []


def test_torch_ddp_over_the_luwu_backend_trains_as_without_the_network():
    """--workload ddp: every worker runs torch DDP over init_process_group("luwu") in its namespace,
    its engine talking to the emulated switches of a multi-rack tree (with loss on every port); the
    final parameters match the same training without any network to rounding."""
    info = run_json("--topo", "multi-rack", "--workers", "4", "--racks", "2", "--backend", "netns",
                    "--workload", "ddp", "--steps", "8", "--drop", "0.02", "--seed", "5")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["workload"] == "ddp" and info["topology"] == "multi-rack" and info["switch"] == "software"
        assert info["matches_reference"] is True and info["max_param_diff"] <= 1e-4, info["max_param_diff"]
        assert abs(info["loss"] - info["reference_loss"]) <= 1e-4 * max(1.0, info["reference_loss"])
        workers = info["ddp"]["per_worker"]
        assert len(workers) == 4 and all(w["last_train_loss"] < w["first_train_loss"] for w in workers)
        assert counters(info, "cluster", "COMPLETED") > 0  # the sums crossed the tree's top, not a shortcut
    finally:
        check_clean(info)


def test_torch_ddp_on_rail_only_sums_across_the_rails():
    """Rail-only: each rail's session sums one GPU per server, so only the backend's hierarchical
    allreduce (NVLink reduce-scatter, in-network sum per rail, NVLink all-gather) gives DDP the whole
    group's gradient; a per-rail sum would train a different model and miss the reference."""
    info = run_json("--topo", "rail-only", "--workers", "4", "--gpus", "2", "--backend", "netns", "--workload", "ddp",
                    "--steps", "6", "--seed", "7")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["matches_reference"] is True and info["max_param_diff"] <= 1e-4, info["max_param_diff"]
        for rail in ("rail0", "rail1"):  # both rails carried their shard of every bucket
            assert counters(info, rail, "COMPLETED") > 0, info["counters"]
    finally:
        check_clean(info)


def test_rail_only_cross_rail_collectives_are_forwarded_over_nvlink():
    """--collectives: after DDP, all_to_all_single, gather to every root and send/recv between every
    pair of the 2 x 2 GPUs over init_process_group("luwu"), each block compared bit for bit. The rails
    are not connected, so s0g0 <-> s1g1 and s0g1 <-> s1g0 reach each other only through a mate GPU:
    over its NVLink bridge, forwarded by its kernel, then over its rail's switch. The controller
    process programs the switches: each rail switch declares its GPUs' /32 routes when it registers
    (`luwu switch --route`) and the controller keeps them in `ipv4_lpm`."""
    from luwu.mininet.ddp_workload import BLOCK

    info = run_json("--topo", "rail-only", "--workers", "4", "--gpus", "2", "--backend", "netns", "--workload", "ddp",
                    "--steps", "2", "--seed", "3", "--collectives")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["matches_reference"] is True
        workers = info["ddp"]["per_worker"]
        assert len(workers) == 4
        block_bytes = BLOCK * 4
        for w in workers:
            assert w["collective_mismatches"] == 0 and w["verified"] is True, w
            # every GPU forwarded its mate's traffic to (or from) the other server's GPU on its own rail
            assert w["forwarded_packets"] > 0, w
            # 3 blocks (all_to_all, gather, send) to the mate and 3 to the cross-rail peer leave on nv0
            assert w["nvlink_tx_bytes"] >= 2 * 3 * block_bytes, w
        for rail in ("rail0", "rail1"):  # the TCP crossed each rail switch by its ipv4_lpm routes
            assert counters(info, rail, "FORWARDED") > 0, info["counters"]
        assert info["controller"]["mode"] == "process", info["controller"]
        for rail in ("rail0", "rail1"):  # declared at registration: one /32 per GPU on the rail (2 servers)
            seen = info["controller"]["switches"][rail]
            assert seen["programmed"] == "ok" and len(seen["routes"]) == 2, seen
            assert all(r.split("=")[0].endswith("/32") for r in seen["routes"]), seen
    finally:
        check_clean(info)


def test_model_in_network_training_across_the_emulated_network_matches_one_process():
    """--workload train: a small GPT trained with ModelInNetwork on two emulated hosts, its
    parameters and AdamW state on a `luwu node` daemon in a third (RAM budget below the state: out
    of core), gradients summed by the emulated switch; the result matches one process training the
    same model on the whole batch within the rounding tolerance (mininet/train_workload.py)."""
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--workload", "train", "--steps", "5")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["workload"] == "train" and info["matches_reference"] is True
        assert info["max_param_diff"] <= info["tolerance"], (info["max_param_diff"], info["tolerance"])
        assert abs(info["loss"] - info["reference_loss"]) < 0.05, (info["loss"], info["reference_loss"])
        assert counters(info, "s1", "COMPLETED") > 0 and counters(info, "s1", "MULTICAST") > 0
    finally:
        check_clean(info)


def test_model_in_network_on_rail_only_sums_every_rank_through_each_rails_node():
    """--workload train on rail-only: a `luwu node` per rail owns its rail's slice of every unit; each
    server's GPUs reduce-scatter gradients over NVLink before the push and all-gather parameters
    after the pull, so each node steps with every rank's gradient. A per-rail sum would train on
    half the batch and miss the reference by far more than the tolerance."""
    info = run_json("--topo", "rail-only", "--workers", "4", "--gpus", "2", "--backend", "netns", "--workload", "train",
                    "--steps", "5", "--seed", "3")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["workload"] == "train" and info["topology"] == "rail-only" and info["matches_reference"] is True
        assert info["max_param_diff"] <= info["tolerance"], (info["max_param_diff"], info["tolerance"])
        assert abs(info["loss"] - info["reference_loss"]) < 0.05, (info["loss"], info["reference_loss"])
        for rail in ("rail0", "rail1"):  # each rail's switch summed and multicast its slice of the units
            assert counters(info, rail, "COMPLETED") > 0 and counters(info, rail, "MULTICAST") > 0, info["counters"]
    finally:
        check_clean(info)


ALLREDUCE_BY_HAND = """
import os, sys, torch, torch.distributed as dist
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("luwu", init_method="file://" + store, rank=rank, world_size=world)
t = torch.arange(4, dtype=torch.float32) * (rank + 1)
dist.all_reduce(t)
print("SUM", t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_up_keeps_the_network_for_a_user_to_run_torch_by_hand(tmp_path):
    """`luwu mininet up`: the network and its programmed switch stay up; a user enters each worker
    host and runs a plain torch.distributed script with the printed plan; SIGTERM tears it down."""
    up = subprocess.Popen([sys.executable, "-m", "luwu.cli", "mininet", "up", "--topo", "star", "--workers", "2",
                           "--backend", "netns", "--json", "--duration", "120", "--run-dir", str(tmp_path / "run")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    run_id = ""
    try:
        info = json.loads(up.stdout.readline())
        assert info["ready"] is True and set(info["switches"]) == {"s1"}, info
        workers = {h["rank"]: h for h in info["hosts"].values() if "rank" in h}
        assert sorted(workers) == [0, 1]
        assert info["controller"]["address"] and "luwu-ctl" in info["controller"]["luwu_ctl"], info
        run_id = Path(workers[0]["namespace"]).name.split("-")[0][len(NAME_PREFIX):]
        env = {k: v for k, v in ENV.items() if k != "LUWU_NO_BACKEND"}
        procs = []
        for rank, h in sorted(workers.items()):
            # the printed settings: the controller's job to join (LUWU_CONTROLLER=... over the management
            # network), or a plan file with --controller in-process
            joins = dict(kv.split("=", 1) for kv in h["join"].split()) if "join" in h else {"LUWU_PLAN": h["plan"]}
            e = dict(env, **joins, LUWU_ENGINE="embedded", LUWU_P2P_HOST=h["addresses"][0],
                     LUWU_WORKDIR=str(tmp_path / f"w{rank}"))
            procs.append(popen_in(h["namespace"], [sys.executable, "-c", ALLREDUCE_BY_HAND, str(rank), "2",
                                                   str(tmp_path / "store")], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=e))
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and "SUM [0.0, 3.0, 6.0, 9.0]" in out, (out, err[-2000:])
        # where to scrape, as printed: the switch counted the users' sums, the controller its job
        switch_metrics = urllib.request.urlopen(info["switches"]["s1"]["metrics"], timeout=10).read().decode()
        assert 'luwu_switch_events_total{event="COMPLETED"}' in switch_metrics, switch_metrics[:2000]
        controller_metrics = urllib.request.urlopen(info["controller"]["metrics"], timeout=10).read().decode()
        assert 'luwu_controller_switch_programmed{switch="s1"} 1.0' in controller_metrics, controller_metrics[:2000]
        # every component the emulation started names its endpoint, and each answers (no optimizer node
        # without layers to serve; the workers here are the user's own processes: LUWU_METRICS)
        assert set(info["metrics"]) == {"controller", "switch s1"}, info["metrics"]
        for who, url in info["metrics"].items():
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            assert "process_cpu_seconds_total" in text and "luwu_" in text, (who, text[:1000])
    finally:
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=120)
    assert up.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"stopped": True, "leftovers": []}
    assert run_id and not leftovers(run_id), leftovers(run_id)


def test_per_link_loss_and_bandwidth_and_per_link_traffic():
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--size", "256KiB", "--bw", "0",
                    "--link", "s1:1=bw=300,drop=0.3", "--seed", "3")  # 32 packets each way: some are lost
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        by_port = {lk["port"]: lk for lk in info["links"]}
        assert by_port[1]["drop"] == 0.3 and by_port[1]["bw_mbit"] == 300 and by_port[1]["peer"] == "w0"
        assert by_port[2]["drop"] == 0.0 and by_port[2]["bw_mbit"] == 0.0 and by_port[2]["peer"] == "w1"
        assert by_port[1]["rx_packets"] >= CHUNKS and by_port[2]["rx_packets"] >= CHUNKS
        assert info["counters"]["s1"]["drops"].get("SIMULATED_LOSS", 0) > 0  # only port 1 loses, and it did
    finally:
        check_clean(info)
