"""`luwu bench allreduce --grad-format both` as a user runs it, tiny: one job per format through
torch, each size's ms and CPU ms per call (all processes, and by role), the endpoint kernels' s/GB,
and the fixed16/fixed32 ratios derived from them; a flag it cannot take is one line and exit 2.
Figures are printed, never asserted on beyond being there and consistent."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

LUWU = Path(sys.executable).parent / "luwu"


def test_grad_format_bench_compares_both_formats_in_one_run():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(LUWU), "bench", "allreduce", "--grad-format", "both", "--workers", "2", "--sizes",
                          "64KiB", "--iters", "2", "--json"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert sorted(res["formats"]) == ["fixed16", "fixed32"]
    for fmt, r in res["formats"].items():
        row = r["sizes"]["65536"]
        assert row["ms"] > 0, fmt
        for key in ("cpu_ms", "cpu_ms_switch", "cpu_ms_engines", "cpu_ms_ranks"):
            assert math.isfinite(row[key]), (fmt, key)
        k = r["kernel_s_per_gb"]
        assert k["encode"] > 0 and k["decode"] > 0 and k["total"] == pytest.approx(k["encode"] + k["decode"]), fmt
    a, b = res["formats"]["fixed16"], res["formats"]["fixed32"]
    ratio = res["ratios"]["65536"]
    assert ratio["cpu"] == a["sizes"]["65536"]["cpu_ms"] / b["sizes"]["65536"]["cpu_ms"]
    assert ratio["ms"] == a["sizes"]["65536"]["ms"] / b["sizes"]["65536"]["ms"]
    assert res["kernel_ratio"] == a["kernel_s_per_gb"]["total"] / b["kernel_s_per_gb"]["total"]
    print(out.stdout)


def test_grad_format_bench_refuses_the_engine_diagnostic_in_one_line():
    out = subprocess.run([str(LUWU), "bench", "allreduce", "--grad-format", "fixed16", "--engine"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "--grad-format" in out.stderr
    assert "Traceback" not in out.stderr
