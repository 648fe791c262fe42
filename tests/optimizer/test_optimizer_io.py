"""File I/O as the kernel counts it (/proc/<pid>/io of a real process): when the state fits the
RAM budget, training touches no file after start-up; when it does not, every step streams the
state through the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from pathlib import Path
from luwu.dataplane.optimizer import JobSpec, NodeConfig, OptimizerNode, OptimizerSpec
from optimizer_reference import initial_values, model_layers, summed_grad

def io():
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}

tmp, budget = Path(sys.argv[2]), int(sys.argv[3])
layers = model_layers(8, 96, 80)
spec = JobSpec("io", OptimizerSpec("adamw", lr=1e-3, clip_grad_norm=1.0), layers, "bf16", initial_values(layers))
node = OptimizerNode(NodeConfig(tmp / "state", ram_budget=budget, max_shard_elems=4096, checkpoint_dir=tmp / "ck"))
node.add_job(spec)
grads = {(ly.layer_id, s): summed_grad(ly, s, 1) for ly in layers for s in range(6)}

def step(s):
    for ly in reversed(layers):
        node.submit_gradient("io", ly.layer_id, s, grads[(ly.layer_id, s)])
    for ly in layers:
        node.params("io", ly.layer_id, s + 1, timeout=60)

step(0)  # start-up: the first step
a = io(); b = io()  # b - a: what reading /proc/self/io itself costs
for s in range(1, 6):
    step(s)
c = io()
state = sum(s.entry_bytes for lr in node.jobs["io"].layers.values() for s in lr.plan.shards)
node.close()
print(json.dumps({"probe": {k: b[k] - a[k] for k in a}, "train": {k: c[k] - b[k] for k in a}, "state": state}))
"""


def _run(tmp_path: Path, budget: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(tmp_path), str(budget)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/<pid>/io (Linux)")
def test_no_file_io_after_startup_when_the_state_fits(tmp_path):
    r = _run(tmp_path, 64 << 20)
    probe, train = r["probe"], r["train"]
    assert train["syscw"] == 0 and train["wchar"] == 0  # not one write call
    assert train["syscr"] <= probe["syscr"] and train["rchar"] <= probe["rchar"]  # only the /proc probe itself


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/<pid>/io (Linux)")
def test_out_of_core_steps_stream_the_state(tmp_path):
    r = _run(tmp_path, 200_000)
    assert r["state"] > 3 * 200_000
    # five steps read and write (at least) most of the state each (rchar/wchar count O_DIRECT I/O too)
    assert r["train"]["rchar"] > 2 * r["state"] and r["train"]["wchar"] > 2 * r["state"]
