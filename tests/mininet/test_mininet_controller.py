"""The controller as a real process in the emulation (root): a management network to every host,
`luwu controller` on it, switches that register themselves and are programmed by it over
P4Runtime (they start with empty tables), workers that join its job from inside their hosts."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from mininet_helpers import ENV, check_clean, counters, luwu_mininet, needs_root, run_json

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.protocol import Dtype
from luwu.mininet.mgmt import MgmtNetwork

pytestmark = [needs_root, pytest.mark.netns]
SIZE = "64KiB"  # 16384 int32 = 9 jumbo packets per worker (2046 data lanes each: 2 are check words)
CHUNKS = -(-16384 // data_lanes(2048, Dtype.INT32))


def _programmed_by_the_controller(info: dict, switches: list[str]) -> None:
    ctl = info["controller"]
    assert ctl["mode"] == "process" and ctl["address"].startswith("10.254."), ctl
    assert ctl["job"], ctl
    for name in switches:
        sw = ctl["switches"][name]
        # registered by the switch daemon itself, its P4Runtime server on loopback; "ok" means the
        # controller wrote the job's entries and read them back identical
        assert sw["programmed"] == "ok" and sw["target"] == "software", (name, sw)
        assert sw["p4runtime"].startswith("127.0.0.1:") and ctl["job"] in sw["jobs"], (name, sw)
    assert ctl["registered_by_emulation"] == []


def test_star_allreduce_with_the_controller_process():
    info = run_json("--topo", "star", "--workers", "3", "--backend", "netns", "--size", SIZE,
                    "--controller", "process")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        _programmed_by_the_controller(info, ["s1"])
        assert info["allreduce"]["verified"] == 3
        # the switch was started without a runtime file: every sum it made used the controller's entries
        assert counters(info, "s1", "COMPLETED") == CHUNKS
        # both ends logged every write into the run directory: the switch with its caller, the controller
        # with the switch it wrote to, the same updates
        switch_side = [x for x in info["_audit"]["s1-p4runtime-audit.jsonl"] if x["what"]["rpc"] == "Write"]
        controller_side = info["_audit"]["controller-p4runtime-audit.jsonl"]
        assert switch_side and all(x["result"] == "OK" and x["who"]["identity"] == "bearer token"
                                   for x in switch_side), switch_side[:3]
        assert len(controller_side) == len(switch_side) and all(x["what"]["switch"] == "s1" for x in controller_side)
        # every component served /metrics while it ran (the workers on their management addresses; an
        # allreduce without --push-pull plans no optimizer node)
        assert set(info["metrics"]) == {"controller", "switch s1", "worker 0", "worker 1", "worker 2"}, info["metrics"]
        assert all(url.startswith("http://10.254.") for who, url in info["metrics"].items() if "worker" in who)
    finally:
        check_clean(info)


def test_multi_rack_push_pull_with_the_controller_process():
    info = run_json("--topo", "multi-rack", "--workers", "4", "--racks", "2", "--backend", "netns", "--size", SIZE,
                    "--push-pull", "--controller", "process", "--seed", "3")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        _programmed_by_the_controller(info, ["cluster", "tor0", "tor1"])
        assert info["allreduce"]["verified"] == 4 and info["pushpull"]["verified"] == 4
        assert info["pushpull"]["node_gradients"] == 2  # the shards the controller planned, each summed once
        # the emulation reports its node processes' health for them (no `luwu node` agent there)
        nodes = info["controller"]["nodes"]
        assert nodes and all(n["health"] == "up" for n in nodes.values()), nodes
        # a /metrics endpoint per component while it ran: the node processes too
        assert set(info["metrics"]) == {"controller", *(f"switch {s}" for s in ("cluster", "tor0", "tor1")),
                                        *(f"node {n}" for n in nodes), *(f"worker {r}" for r in range(4))}, \
            info["metrics"]
        for sw in ("tor0", "tor1", "cluster"):
            assert counters(info, sw, "COMPLETED") >= CHUNKS
    finally:
        check_clean(info)


def test_ddp_on_a_star_joins_through_the_controller():
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--workload", "ddp", "--steps", "4",
                    "--controller", "process")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        _programmed_by_the_controller(info, ["s1"])
        assert info["matches_reference"] is True
    finally:
        check_clean(info)


def test_a_controller_that_cannot_start_is_named_and_everything_is_torn_down(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "controller.sqlite").mkdir(parents=True)  # its database cannot be opened: the real daemon exits
    r = luwu_mininet("run", "--json", "--run-dir", str(run_dir), "--topo", "star", "--workers", "2", "--backend",
                     "netns", "--size", SIZE, "--controller", "process")
    info = json.loads(r.stdout)
    try:
        assert r.returncode == 1 and not info["passed"]
        assert any(e.startswith("controller 10.254.") and "exited" in e for e in info["errors"]), info["errors"]
        assert (run_dir / "controller.log").exists()
    finally:
        check_clean(info)


def test_a_management_subnet_too_small_is_one_line():
    r = luwu_mininet("run", "--topo", "star", "--workers", "2", "--backend", "netns", "--mgmt-subnet", "10.254.0.0/30")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "--mgmt-subnet" in r.stderr, r.stderr


def test_management_network_reaches_every_host_and_is_removed_exactly():
    names = [f"lwmt{i}{int(time.time()) % 1000:03d}" for i in range(2)]
    run_id = names[0][3:7]
    for n in names:
        subprocess.run(["ip", "netns", "add", n], check=True, timeout=10)
    try:
        mgmt = MgmtNetwork(run_id, {n: f"/run/netns/{n}" for n in names})
        gateway = mgmt.start()
        try:
            for n in names:
                route = subprocess.run(["ip", "netns", "exec", n, "ip", "-4", "-o", "addr", "show", "mgmt0"],
                                       capture_output=True, text=True, timeout=10).stdout
                assert mgmt.addresses[n] in route
                ping = subprocess.run(["ip", "netns", "exec", n, "ping", "-c", "1", "-W", "2", gateway],
                                      capture_output=True, text=True, timeout=10)
                assert ping.returncode == 0, ping.stdout + ping.stderr
        finally:
            assert mgmt.stop() == []
        left = [i for i in json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True,
                                                     timeout=10, env=ENV).stdout) if run_id in i["ifname"]]
        assert left == []
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], timeout=10)


def test_model_in_network_training_joins_through_the_controller_and_its_node_daemon_reports():
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--workload", "train", "--steps", "3",
                    "--controller", "process")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        _programmed_by_the_controller(info, ["s1"])
        assert info["matches_reference"] is True
        node = info["controller"]["nodes"]["n0"]
        # the `luwu node` daemon re-registered itself with its engine's address and heartbeats
        assert node["health"] == "up" and node["data_address"].startswith("10.0.") and info["controller"]["job"] in \
            node["jobs"], node
        assert info["metrics"]["node n0"].startswith("http://10.254."), info["metrics"]  # `luwu node --metrics`
    finally:
        check_clean(info)


def test_in_process_planning_is_still_there_and_says_so():
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--size", SIZE,
                    "--controller", "in-process")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["controller"] == {"mode": "in-process", "why": "--controller in-process"}
        assert counters(info, "s1", "COMPLETED") == CHUNKS
    finally:
        check_clean(info)
