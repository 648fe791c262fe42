"""`luwu-ctl plan JOB --explain`: the predicted iteration time and bottleneck of a planned job, read
from a running controller (its plan, the nodes' registered params/s) by the real `luwu-ctl`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ctl_helpers import ADMIN, LANES, job, node, star_switch

from luwu.controller.planner import wire_efficiency

CTL = str(Path(sys.executable).parent / "luwu-ctl")
LAYERS = [5000, 7000, 100]
NODE_RATE = 3e6  # params/s the node registers


def ctl(address: str, *args: str, token: str = ADMIN) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    env.pop("LUWU_CONTROLLER", None)
    env.pop("LUWU_TOKEN", None)
    return subprocess.run([CTL, "--controller", address, f"--token={token}", *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.fixture
def planned(controller, software_switch):
    bc, admin = controller
    _, p4rt = software_switch()
    admin.register_node(node("n0", NODE_RATE))
    admin.register_switch(star_switch("s1", p4rt, 4, ["n0"]))
    created, token = admin.create_job(job("train", 3, LAYERS, nodes=1))
    return bc.address, created.job_id, token


def expected_seconds(link_gbps: float, compute_s: float = 0.0) -> float:
    """The pipeline by hand: forward pulls each layer (2 B/param) beside a quarter of the GPU time;
    backward pulls again, pushes 4 B/param and the node steps it, beside three quarters; then the
    first layer's step, which the next forward waits for."""
    rate = link_gbps * 1e9 / 8 * wire_efficiency(4 * LANES)
    total = sum(LAYERS)
    fwd = sum(max(2 * n / rate, compute_s / 4 * n / total) for n in LAYERS)
    bwd = sum(max(4 * n / rate, n / NODE_RATE, compute_s * 3 / 4 * n / total) for n in LAYERS)
    return fwd + bwd + LAYERS[0] / NODE_RATE


def prediction(address: str, job_id: str, *flags: str) -> dict:
    out = ctl(address, "--json", "plan", job_id, *flags)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["prediction"]


def test_explain_shows_the_predicted_iteration(planned):
    address, job_id, _ = planned
    out = ctl(address, "plan", job_id, "--explain")
    assert out.returncode == 0, out.stderr
    assert "predicted iteration" in out.stdout and "s per iteration, bottleneck: optimizer node" in out.stdout, out.stdout

    fast = prediction(address, job_id)  # 100 Gbit/s: the node's 3M params/s set the pace
    assert fast["iteration_s"] == pytest.approx(expected_seconds(100.0), rel=1e-9)
    assert fast["bottleneck"] == "optimizer node" and fast["layers"] == len(LAYERS)

    slow = prediction(address, job_id, "--link-gbps", "0.01")  # a slow link: now the pulls do
    assert slow["iteration_s"] == pytest.approx(expected_seconds(0.01), rel=1e-9)
    assert slow["bottleneck"] == "worker link in" and slow["iteration_s"] > fast["iteration_s"]

    busy = prediction(address, job_id, "--compute-s", "1.0")  # a GPU slower than both
    assert busy["iteration_s"] == pytest.approx(expected_seconds(100.0, 1.0), rel=1e-9)
    assert busy["bottleneck"] == "worker GPU"


def test_a_job_token_is_told_what_the_prediction_needs(planned):
    address, job_id, token = planned
    out = ctl(address, "plan", job_id, "--explain", token=token)
    assert out.returncode == 0, out.stderr
    assert "layout star" in out.stdout and "need the admin token" in out.stdout


def test_bad_prediction_flags_are_one_line(planned):
    address, job_id, _ = planned
    out = ctl(address, "plan", job_id, "--explain", "--link-gbps", "fast")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len([ln for ln in out.stderr.splitlines() if ln.strip()]) == 1 and "--link-gbps" in out.stderr
