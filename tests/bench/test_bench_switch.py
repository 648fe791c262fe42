"""`luwu bench switch` as a user runs it, tiny: the switch and the relay each carry every packet of
every run (the workers' sockets are bound once by the bench and handed to each run's workers),
and a worker that dies without a result fails its run at once, by name, instead of leaving the
bench waiting for it. Figures are printed, never asserted on."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from luwu.bench.switch import _results

LUWU = Path(sys.executable).parent / "luwu"


def test_switch_bench_completes_every_packet_of_every_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(LUWU), "bench", "switch", "--workers", "2", "--size", "256KiB", "--repeat", "2",
                          "--json", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["switch_completed"] == res["repeat"] * res["packets_per_worker"]  # a phase completed per packet index
    assert len(res["switch_runs_s"]) == len(res["relay_runs_s"]) == 2
    assert res["switch_cpu_us_per_packet"] > 0 and res["relay_cpu_us_per_packet"] > 0
    assert (tmp_path / "switch_bench.json").is_file()
    print({k: v for k, v in res.items() if not isinstance(v, list)})


def test_a_worker_that_exits_without_its_result_fails_the_run_by_name():
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=sys.exit, args=(3,))]
    procs[0].start()
    procs[0].join(60)
    with pytest.raises(RuntimeError, match="relay run: worker 0 exited with code 3 before its result"):
        _results(SimpleNamespace(kind="relay"), procs, ctx.Queue())
