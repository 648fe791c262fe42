"""`luwu mininet run --switch bmv2`: BMv2 programmed over P4Runtime from the controller's plan on the
netns backend (root); exact int32 sums and push/pull through the optimizer node, counters read back
over P4Runtime, the same JSON keys as the software switch, nothing left behind; a missing BMv2 or
build is one line on stderr."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from mininet_helpers import ENV, check_clean, counters, run_json

from luwu.daemons import bmv2 as bmv2_switch
from luwu.mininet import runner

pytestmark = pytest.mark.bmv2
LANES = 64
SIZE = "256KiB"  # 65536 int32 = 1024 packets of 64 lanes per worker: more than the planner's 256-slot pools
CHUNKS = 1024
needs_bmv2 = pytest.mark.skipif(
    os.geteuid() != 0 or bmv2_switch.missing() is not None,
    reason=f"needs root and BMv2: {bmv2_switch.missing() or 'not root'}")


def _keys(d: dict, prefix: str = "") -> set[str]:
    """Every key path of a run's JSON, minus the per-switch and per-worker ones that name things (and
    the components' metrics endpoints: a BMv2 switch has none)."""
    out = set()
    for k, v in d.items():
        if k.startswith("_") or k in ("counters", "per_worker", "metrics"):  # metrics: BMv2 serves none
            continue
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, f"{prefix}{k}.")
    return out


def _mininet_missing() -> str | None:
    from luwu.mininet import mininet_backend

    return mininet_backend.missing(None) if os.geteuid() == 0 else "needs root"


@needs_bmv2
@pytest.mark.parametrize("backend", [
    "netns",
    pytest.param("mininet", marks=pytest.mark.skipif(_mininet_missing() is not None,
                                                     reason=f"Mininet backend unavailable: {_mininet_missing()}")),
])
def test_star_of_two_workers_sums_exactly_through_bmv2_and_reports_like_the_software_switch(backend):
    info = run_json("--topo", "star", "--workers", "2", "--backend", backend, "--switch", "bmv2", "--size", SIZE,
                    "--push-pull")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["switch"] == "bmv2" and info["backend"] == backend and info["lanes"] == LANES
        assert info["allreduce"]["verified"] == 2 and info["pushpull"]["verified"] == 2
        for w in info["allreduce"]["per_worker"]:
            assert w["mismatches"] == 0 and w["contributors"] == 2 and w["elements"] == 65536
        # counters read back from BMv2 over P4Runtime: every chunk summed in the switch (and the
        # push/pull gradients after them), each slot completed once and absorbed once (2 workers)
        completed = counters(info, "s1", "COMPLETED")
        assert completed > CHUNKS and counters(info, "s1", "ABSORBED") == completed
        assert info["pushpull"]["node_gradients"] >= 2
    finally:
        check_clean(info)
    soft = run_json("--topo", "star", "--workers", "2", "--backend", backend, "--size", SIZE, "--push-pull")
    check_clean(soft)
    assert soft["passed"], soft["errors"]
    assert _keys(info) == _keys(soft)
    assert set(info["counters"]["s1"]) == set(soft["counters"]["s1"])


@needs_bmv2
def test_rail_only_cross_rail_collectives_through_bmv2_routes_the_controller_keeps():
    """--collectives on BMv2 with the controller process: each BMv2 is registered with its GPUs'
    /32 routes (agent-less, by the emulation), the controller installs them in `ipv4_lpm` over
    P4Runtime, and the cross-rail TCP (all_to_all, gather, send/recv) crosses both rails exactly."""
    info = run_json("--topo", "rail-only", "--workers", "4", "--gpus", "2", "--backend", "netns", "--switch", "bmv2",
                    "--workload", "ddp", "--steps", "2", "--seed", "3", "--collectives")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["controller"]["mode"] == "process", info["controller"]
        for w in info["ddp"]["per_worker"]:
            assert w["collective_mismatches"] == 0 and w["verified"] is True and w["forwarded_packets"] > 0, w
        for rail in ("rail0", "rail1"):
            seen = info["controller"]["switches"][rail]
            assert seen["target"] == "bmv2" and seen["programmed"] == "ok" and len(seen["routes"]) == 2, seen
            assert counters(info, rail, "FORWARDED") > 0, info["counters"]  # read from BMv2 over P4Runtime
    finally:
        check_clean(info)


def test_runner_without_simple_switch_grpc_is_one_line(tmp_path):
    env = dict(ENV, PATH=str(tmp_path))  # an empty PATH: no simple_switch_grpc
    r = subprocess.run([sys.executable, "-m", "luwu.cli", "mininet", "run", "--switch", "bmv2", "--backend", "netns"],
                       capture_output=True, text=True, env=env, timeout=120, check=False)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "simple_switch_grpc" in r.stderr and "Traceback" not in r.stderr


def test_runner_without_the_compiled_program_is_one_line(tmp_path, monkeypatch, capsys):
    if bmv2_switch.missing() is not None and "simple_switch_grpc" in bmv2_switch.missing():
        pytest.skip("without simple_switch_grpc that is what is missing (the test above)")
    monkeypatch.setattr(bmv2_switch, "BMV2_JSON", tmp_path / "luwu_v1model.json")
    p = argparse.ArgumentParser()
    runner.add_arguments(p)
    assert runner.run(p.parse_args(["run", "--switch", "bmv2", "--backend", "netns"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "luwu_v1model.json" in err and "luwu p4 build" in err, err


def test_bmv2_plans_pools_its_queues_hold_and_pool_is_checked():
    """BMv2 forwards about a thousand packets a second and holds 64 per egress port: with the
    planner's 256-slot pools (each stream's window) a run collapses into resends, so BMv2 runs
    plan every session with `BMV2_POOL` slots unless --pool says otherwise."""
    def pools(*args: str) -> set[int]:
        r = subprocess.run([sys.executable, "-m", "luwu.cli", "mininet", "show", "--topo", "star", "--workers", "2",
                            "--push-pull", *args], capture_output=True, text=True, env=ENV, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        entries = json.loads(r.stdout)["runtime"]["s1"]["table_entries"]
        return {e["action_params"]["pool_size"] for e in entries if e["table"] == "sessions"}

    assert pools("--switch", "bmv2") == {runner.BMV2_POOL}
    assert pools("--switch", "bmv2", "--pool", "32") == {32}
    assert runner.BMV2_POOL not in pools()  # the software switch keeps the planner's defaults
    r = subprocess.run([sys.executable, "-m", "luwu.cli", "mininet", "show", "--pool", "3"], capture_output=True,
                       text=True, env=ENV, timeout=120, check=False)
    assert r.returncode == 2 and "--pool 3" in r.stderr and "power of two" in r.stderr, r.stderr
