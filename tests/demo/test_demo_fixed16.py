"""`luwu demo --grad-format fixed16` on the default tiny model (0.82M parameters, 7 units): every
gradient packet the engines sent is one `push_bytes.structure` counts (report.json
traffic.push_breakdown), push bytes per parameter are that structure plus resends and heartbeats,
and the losses stay within 0.5% of fixed32's at the same seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from luwu.demo import push_bytes

LUWU = Path(sys.executable).parent / "luwu"
STEPS = 3
RUN_TIMEOUT = 600  # s a demo may take on a loaded 2-core machine before the test gives up


def _demo(out: Path, grad_format: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.run([str(LUWU), "demo", "--out", str(out), "--steps", str(STEPS), "--no-baseline", "--quiet",
                           "--packet-mode", "loopback", "--grad-format", grad_format], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, env=env, cwd=out.parent)
    assert proc.returncode == 0, f"luwu demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads((out / "report.json").read_text())


def test_fixed16_demo_bytes_and_losses(tmp_path):
    f16 = _demo(tmp_path / "f16", "fixed16")
    units = [u["numel"] for u in f16["model"]["units"]]
    assert sum(units) == 819968 and len(units) == 7  # the default tiny model
    t = f16["traffic"]
    b = t["push_breakdown"]
    s = push_bytes.structure(units, 16000, "fixed16")
    assert b["structural_bytes_per_param"] == s["bytes_per_param"] and b["data_packets_per_step"] == 31
    assert s["bytes_per_param"] <= 2.1  # issue 29: packets cut to whole chunks (docs/protocol.md 3.3)
    # every GRAD packet the workers' engines sent is a data packet of the structure, or a resend of one
    grad = [v for k, v in b["streams_all_workers"].items() if k.endswith("grad_stream")]
    assert sum(g["packets"] - g["retransmitted"] for g in grad) == 2 * STEPS * s["data"]["packets"], b
    assert t["push_bytes_per_param"] == pytest.approx(b["measured_bytes_per_param"])
    assert t["push_bytes_per_param"] >= s["bytes_per_param"]
    assert b["per_step_bytes"]["other"] >= 0, b
    f32 = _demo(tmp_path / "f32", "fixed32")
    assert f32["traffic"]["push_bytes_per_param"] > 1.8 * t["push_bytes_per_param"]  # about half the bytes
    # the same seed and data: fixed16's rounding (relative ~7e-5 per sum) leaves the losses within 0.5%
    assert f16["luwu"]["losses"] == pytest.approx(f32["luwu"]["losses"], rel=5e-3)
