"""`luwu bench optimizer` runs end to end on a small model: grep-able lines, one JSON object with
the headline ratios, and JSON + PNG in --out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SMALL = ["--params", "2M", "--layers", "12", "--steps", "2", "--ooc-params", "1M", "--checkpoint-every", "3"]


def _bench(tmp_path, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "luwu.cli", "bench", "optimizer", *SMALL, "--dir", str(tmp_path),
                          *extra], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_json_and_files(tmp_path):
    res = json.loads(_bench(tmp_path, "--json", "--out", str(tmp_path / "out")).strip().splitlines()[-1])
    for key in ("ratio_to_fused_adamw", "fraction_of_disk_bandwidth", "checkpoint_overhead",
                "step_centric_speedup_ram", "step_centric_speedup_ooc", "disk_rw_gbps", "node_params_per_s",
                "ratio_to_fused_adamw_fp32_serving", "cpu_ratio_to_fused_adamw_fp32_serving"):
        assert isinstance(res[key], float) and res[key] == res[key], key  # a number, not NaN
    assert res["node_params_per_s"] > 0 and res["fused_adamw_params_per_s"] > 0
    assert res["ooc_state_bytes"] > 4 * res["ooc_budget_bytes"]
    # the bandwidth bound: 28 B a parameter for fused AdamW, 28 + 2 x 2 for a node serving bf16
    assert res["bandwidth_ceiling_ratio"] == 28 / 32
    assert res["memory_gbps"] > 0 and res["fused_adamw_fraction_of_memory_bandwidth"] > 0
    assert abs(res["ratio_to_bandwidth_ceiling"] * res["bandwidth_ceiling_ratio"] - res["ratio_to_fused_adamw"]) < 1e-9
    assert res["ram_file_reads"] == 0 and res["ram_file_writes"] == 0
    assert json.loads((tmp_path / "out" / "optimizer.json").read_text())["params"] == res["params"]
    assert (tmp_path / "out" / "optimizer.png").stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("luwu-bench-opt-")]  # cleaned up


def test_key_value_lines(tmp_path):
    lines = dict(line.split(": ", 1) for line in _bench(tmp_path).strip().splitlines())
    for key in ("ratio_to_fused_adamw", "ratio_to_fused_adamw_fp32_serving", "fraction_of_disk_bandwidth",
                "checkpoint_overhead", "io_mode"):
        assert key in lines
    float(lines["ratio_to_fused_adamw"])
