"""`torchrun --standalone --nproc-per-node 2 examples/ddp_luwu.py` works, with the luwu backend and with
--backend gloo, and the two runs end with the same parameters (within the fixed-point tolerance of
test_backend_ddp.py) and identical replicas."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_luwu.py"
STEPS, LR = 6, 0.05
RUN_TIMEOUT = 150  # s per torchrun
# the bound of test_backend_ddp.py, 10 * S * lr * (N * 2^(c - 30) + 2^-22) * max|g|, for N = 2 (c = 1) and a
# generous max|g| <= 100 for this model and data (its loss starts near 14): about 7e-5
TOLERANCE = 10 * STEPS * LR * (2 * 2.0 ** (1 - 30) + 2.0 ** -22) * 100


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [shutil.which("torchrun") or "torchrun"]


def _run(backend: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{backend}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", LUWU_WORKDIR=str(tmp_path / "luwu"))
    cmd = _torchrun() + ["--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--backend", backend,
                         "--steps", str(STEPS), "--lr", str(LR), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
    if backend == "gloo" and proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # the Gloo baseline only: Gloo itself sometimes aborts a rank in its own teardown, after the barrier
        # (a full suite here saw it once, after the run had printed identical replicas); the reference gets
        # one more run, the luwu run (the system under test) none
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
    assert proc.returncode == 0, f"torchrun ({backend}) failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert f"backend {backend}, 2 ranks: replicas identical: True" in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def test_torchrun_example_with_luwu_matches_gloo(tmp_path):
    luwu = _run("luwu", tmp_path)
    gloo = _run("gloo", tmp_path)
    assert luwu["world_size"] == gloo["world_size"] == 2
    assert len(set(luwu["digests"])) == 1
    assert luwu["losses"][-1] < luwu["losses"][0]
    for name, values in gloo["params"].items():
        a, b = np.array(luwu["params"][name]), np.array(values)
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE, err_msg=name)
