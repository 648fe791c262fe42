"""`luwu mininet run --switch bmv2`: BMv2 programmed over P4Runtime from the controller's plan on the
netns backend (root); exact int32 sums and push/pull through the optimizer node, counters read back
over P4Runtime, the same JSON keys as the software switch, nothing left behind; a missing BMv2 or
build is one line on stderr."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from luwu.mininet import runner
from luwu.p4 import bmv2_switch

from mininet_helpers import ENV, check_clean, counters, run_json

pytestmark = pytest.mark.bmv2
LANES = 64
SIZE = "32KiB"  # 8192 int32 = 128 packets of 64 lanes per worker
CHUNKS = 128
needs_bmv2 = pytest.mark.skipif(
    os.geteuid() != 0 or bmv2_switch.missing() is not None,
    reason=f"needs root and BMv2: {bmv2_switch.missing() or 'not root'}")


def _keys(d: dict, prefix: str = "") -> set[str]:
    """Every key path of a run's JSON, minus the per-switch and per-worker ones that name things."""
    out = set()
    for k, v in d.items():
        if k.startswith("_") or k in ("counters", "per_worker"):
            continue
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, f"{prefix}{k}.")
    return out


@needs_bmv2
def test_star_of_two_workers_sums_exactly_through_bmv2_and_reports_like_the_software_switch():
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--switch", "bmv2", "--size", SIZE,
                    "--push-pull")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["switch"] == "bmv2" and info["lanes"] == LANES
        assert info["allreduce"]["verified"] == 2 and info["pushpull"]["verified"] == 2
        for w in info["allreduce"]["per_worker"]:
            assert w["mismatches"] == 0 and w["contributors"] == 2 and w["elements"] == 8192
        # counters read back from BMv2 over P4Runtime: every chunk summed in the switch (and the
        # push/pull gradients after them), each slot completed once and absorbed once (2 workers)
        completed = counters(info, "s1", "COMPLETED")
        assert completed > CHUNKS and counters(info, "s1", "ABSORBED") == completed
        assert info["pushpull"]["node_gradients"] >= 2
    finally:
        check_clean(info)
    soft = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--size", SIZE, "--push-pull")
    check_clean(soft)
    assert soft["passed"], soft["errors"]
    assert _keys(info) == _keys(soft)
    assert set(info["counters"]["s1"]) == set(soft["counters"]["s1"])


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
