"""`luwu bench observability` as a user runs it, tiny: the four configurations run, the traced ones
record the switch's turns, and the temporary trace directories are gone afterwards. Its figures
are printed, never asserted on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LUWU = Path(sys.executable).parent / "luwu"


def test_the_bench_runs_every_configuration_and_cleans_up(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    for k in ("LUWU_TRACE_DIR", "LUWU_METRICS"):
        env.pop(k, None)
    out = subprocess.run([str(LUWU), "bench", "observability", "--workers", "2", "--size", "1MiB", "--iters", "1",
                          "--rounds", "1", "--json", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert {len(res["runs"][c]) for c in ("off", "trace", "metrics", "both")} == {1}
    for c in ("off", "trace", "metrics", "both"):
        assert res[f"{c}_cpu_s_per_gb"] > 0 and res[f"{c}_goodput_gbps"] > 0
    assert res["runs"]["off"][0]["events"] == res["runs"]["metrics"][0]["events"] == 0
    assert res["runs"]["trace"][0]["events"] > 0 and res["runs"]["both"][0]["events"] > 0  # the switch's turns
    assert not list(tmp_path.glob("luwu-bench-trace-*"))
    assert (tmp_path / "out" / "observability.png").stat().st_size > 1000
    print({k: v for k, v in res.items() if k != "runs"})
