"""`luwu bench allreduce` as a user runs it, tiny. By default through torch: `dist.all_reduce` on
the luwu backend and on Gloo for each size of the sweep, every element of luwu's results verified,
the ratio per size derived from the two times, CPU per call of every process of each job there and
positive, JSON and PNG written. `--engine` (the engine-only
diagnostic): both luwu transports and the relay ceiling run, every element is verified, and each
CPU-per-GB figure the issue asks for (luwu, the relay) is there and positive, with the ratios
derived from them and the cores each run kept busy. Figures are printed, never asserted on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LUWU = Path(sys.executable).parent / "luwu"


def test_allreduce_bench_reports_cpu_per_gb_for_luwu_and_the_relay(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(LUWU), "bench", "allreduce", "--engine", "--workers", "2", "--size", "1MiB", "--iters", "2",
                          "--no-gloo", "--no-setup", "--verify", "--json", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["verified"] is True
    assert res["luwu"]["verify"]["mismatches"] == res["luwu_udp"]["verify"]["mismatches"] == 0
    for key in ("cpu_s_per_gb", "cpu_s_per_gb_udp", "udp_ceiling_cpu_s_per_gb", "udp_ceiling_gbps"):
        assert res[key] > 0, key
    assert res["cpu_ratio_to_udp_ceiling"] == res["cpu_s_per_gb_udp"] / res["udp_ceiling_cpu_s_per_gb"]
    assert res["fraction_of_udp_ceiling"] == res["goodput_gbps_udp"] / res["udp_ceiling_gbps"]
    # cores kept busy: the run's CPU seconds over its timed iterations' wall time (none of it idle time)
    for key, run in (("cores_busy", res["luwu"]), ("cores_busy_udp", res["luwu_udp"])):
        assert res[key] == pytest.approx((run["cpu_s"]["workers"] + run["cpu_s"]["switch"]) / sum(run["seconds"])), key
        assert res[key] > 0, key
    assert res["cores"] == len(os.sched_getaffinity(0))
    assert (tmp_path / "allreduce.png").stat().st_size > 1000
    print({k: v for k, v in res.items() if not isinstance(v, dict)})


def test_allreduce_bench_through_torch_sweeps_sizes_against_gloo(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(LUWU), "bench", "allreduce", "--workers", "2", "--sizes", "1KiB,64KiB", "--iters", "2",
                          "--warmup", "0.2", "--no-setup", "--verify", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(ln.split(": ", 1) for ln in out.stdout.splitlines() if ": " in ln)
    for label in ("1KiB", "64KiB"):
        luwu, gloo = float(lines[f"allreduce_{label}_luwu_ms"]), float(lines[f"allreduce_{label}_gloo_ms"])
        assert luwu > 0 and gloo > 0
        assert float(lines[f"allreduce_{label}_ratio_to_gloo"]) == pytest.approx(gloo / luwu, rel=1e-2, abs=1e-4)
        luwu_cpu, gloo_cpu = float(lines[f"allreduce_{label}_luwu_cpu_ms"]), float(lines[f"allreduce_{label}_gloo_cpu_ms"])
        assert luwu_cpu > 0 and gloo_cpu > 0
        assert float(lines[f"allreduce_{label}_cpu_ratio_to_gloo"]) == pytest.approx(luwu_cpu / gloo_cpu, rel=1e-2)
        assert lines[f"allreduce_{label}_verify_mismatches"] == "0"
    assert lines["verified"] == "True"
    res = json.loads((tmp_path / "allreduce.json").read_text())
    assert res["through"] == "torch.distributed"
    assert [row["bytes"] for row in res["sweep"]] == [1024, 65536]
    for row in res["sweep"]:
        assert len(res["luwu"][str(row["bytes"])]["seconds"]) == len(res["gloo"][str(row["bytes"])]["seconds"]) == 2
        assert row["verify"]["checked"] == row["bytes"] // 4 and row["verify"]["mismatches"] == 0
        assert row["ratio_to_gloo"] == row["gloo_s"] / row["luwu_s"]
        # CPU per call: every process of the job -- the ranks, and for luwu the engine daemons and
        # the loopback switch, which the ranks started -- summed by role
        luwu_cpu = res["luwu"][str(row["bytes"])]["cpu_s_per_call_by_role"]
        gloo_cpu = res["gloo"][str(row["bytes"])]["cpu_s_per_call_by_role"]
        assert row["luwu_cpu_s"] == pytest.approx(sum(luwu_cpu.values())) and row["gloo_cpu_s"] == pytest.approx(sum(gloo_cpu.values()))
        assert luwu_cpu["rank"] > 0 and luwu_cpu["switch"] > 0 and gloo_cpu["rank"] > 0
        if res["engine"] == "process":
            assert luwu_cpu["engine"] > 0
        else:  # embedded (the default): the engine is a thread of the rank, counted as the rank's
            assert luwu_cpu["engine"] == 0.0
        assert gloo_cpu["engine"] == gloo_cpu["switch"] == 0.0  # Gloo starts no process
        assert row["cpu_ratio_to_gloo"] == row["luwu_cpu_s"] / row["gloo_cpu_s"]
    assert (tmp_path / "allreduce.png").stat().st_size > 1000
    print(out.stdout)


def test_verify_holds_each_format_to_its_own_bound():
    """`--verify` of a FIXED16 sum uses FIXED16's bound (an exponent per block, 16-bit slots), not
    FIXED32's, which such a sum exceeds by design; and a FIXED32 bound still catches a FIXED16 sum."""

    from luwu.bench import allreduce_check
    from luwu.dataplane.integrity import data_lanes
    from luwu.dataplane.loopback import local_star
    from luwu.dataplane.protocol import Dtype

    n, numel = 2, 40_000
    results = {}
    for fmt in ("fixed32", "fixed16"):
        with local_star(n, mode="loopback") as (plan, _sw, engines):
            hs = [e.allreduce(allreduce_check.inputs(r, numel, "float32"), "sum", grad_format=fmt)
                  for r, e in enumerate(engines)]
            results[fmt] = hs[0].wait(60.0)
            lanes = data_lanes(plan.lanes, Dtype.FIXED32)
    for fmt, r in results.items():
        v = allreduce_check.verify(r, n, numel, "float32", lanes, grad_format=fmt)
        assert v["checked"] == numel and v["mismatches"] == 0, (fmt, v)
    wrong = allreduce_check.verify(results["fixed16"], n, numel, "float32", lanes, grad_format="fixed32")
    assert wrong["mismatches"] > 0, "a FIXED16 sum within FIXED32's bound: the bounds no longer differ"
