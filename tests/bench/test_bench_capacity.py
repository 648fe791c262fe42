"""`luwu bench capacity` as a user runs it, tiny (hidden 32, a few hundred tokens): the JSON says how
the cap was held, each system's largest size is the parameter count of its largest trial that fit,
the ratios are the quotients of those, and a cap too small for even one layer is reported as
nothing fitting (None), not a crash. Figures are printed, never asserted on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from luwu.bench.capacity_search import _next_layers

LUWU = Path(sys.executable).parent / "luwu"
TINY = ["--hidden", "32", "--heads", "2", "--vocab", "256", "--seq", "16", "--batch", "2", "--steps", "2",
        "--node-memory", "256MiB"]
RUN_TIMEOUT = 600  # s a tiny bench may take on a loaded 2-core machine before the test gives up


def _bench(*flags: str, out: Path | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    argv = [str(LUWU), "bench", "capacity", *TINY, *flags, "--json"] + (["--out", str(out)] if out else [])
    got = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert got.returncode == 0, got.stderr[-3000:]
    return got, json.loads(got.stdout)


def test_capacity_reports_each_systems_largest_fitting_trial_and_the_ratio(tmp_path):
    _, res = _bench("--systems", "luwu,ddp", "--max-layers", "1", "--worker-memory", "3GiB",
                    "--time-budget", "300", out=tmp_path)
    assert res["enforced"] in ("cgroup-v2", "cgroup-v1", "rlimit-as", "measured")
    assert res["systems"] == ["luwu", "ddp"] and res["errors"] == []
    for system in ("luwu", "ddp"):
        trials = [t for t in res["trials"] if t["system"] == system]
        assert [t["layers"] for t in trials] == [1]  # --max-layers 1: one size
        fit = [t for t in trials if t["fits"]]
        assert fit, trials  # 3 GiB holds a 1-layer model of hidden 32
        assert res["largest_params"][system] == max(t["params"] for t in fit) > 0
        assert res["largest_layers"][system] == 1
        assert res["tokens_per_s"][system] > 0
        peaks = fit[0]["worker_capped_peak_bytes"]
        assert len(peaks) == 2 and all(0 < p <= res["worker_memory_bytes"] for p in peaks)
        assert res["worker_peak_rss_bytes"][system] == max(peaks)
        each = fit[0]["worker_processes_peak_rss_bytes"]
        assert peaks == [sum(e) if res["enforced"] == "measured" else max(e) for e in each]
        assert fit[0]["worker_tree_peak_rss_bytes"] == [sum(e) for e in each]
        if system == "luwu":  # its engine daemon is a process of the worker's, counted with it
            assert all(len(e) >= 2 for e in each), each
    assert res["ratio_to_ddp"] == res["largest_params"]["luwu"] / res["largest_params"]["ddp"]
    assert "ratio_to_fsdp" not in res  # FSDP was not run
    luwu = next(t for t in res["trials"] if t["system"] == "luwu")
    assert luwu["node"]["peak_rss_bytes"] > 0 and res["node_peak_rss_bytes"] == luwu["node"]["peak_rss_bytes"]
    assert res["node_disk_read_bytes"] is not None and res["node_disk_write_bytes"] is not None
    assert (tmp_path / "capacity.png").stat().st_size > 1000
    assert json.loads((tmp_path / "capacity.json").read_text())["largest_params"] == res["largest_params"]
    print({k: v for k, v in res.items() if k not in ("trials", "config")})


@pytest.mark.parametrize("enforce", ["auto", "rlimit-as"])
def test_a_cap_too_small_for_one_layer_is_reported_as_nothing_fitting(enforce):
    # 96 MiB: less than torch itself takes; the cgroup kills the workers (or RLIMIT_AS refuses them,
    # or their peak is found over it afterwards): no size fits, and the bench says so
    _, res = _bench("--systems", "ddp,luwu", "--worker-memory", "96MiB", "--time-budget", "200", "--enforce", enforce)
    assert res["errors"] == [], res["errors"]
    if enforce != "auto":
        assert res["enforced"] == enforce
    for system in ("ddp", "luwu"):
        trials = [t for t in res["trials"] if t["system"] == system]
        assert len(trials) == 1 and trials[0]["layers"] == 1 and not trials[0]["fits"], trials
        assert trials[0]["reason"] in ("oom", "over-cap"), trials[0]
        if res["enforced"].startswith("cgroup"):
            assert trials[0]["reason"] == "oom" and any(trials[0]["cgroup_oom_kills"]), trials[0]
        assert res["largest_params"][system] is None and res["largest_layers"][system] == 0
        assert res["tokens_per_s"][system] is None
    assert res["ratio_to_ddp"] is None  # nothing to divide by


def test_the_search_doubles_then_bisects_to_an_eighth():
    assert _next_layers(0, None, 64) == 1
    assert _next_layers(1, None, 64) == 2
    assert _next_layers(16, None, 20) == 20  # never past --max-layers
    assert _next_layers(20, None, 20) is None
    assert _next_layers(16, 32, 64) == 24
    assert _next_layers(1, 2, 64) is None
    assert _next_layers(64, 72, 1024) is None  # within 64 / 8
    assert _next_layers(64, 80, 1024) == 72
    assert _next_layers(0, 1, 64) is None  # one layer does not fit


def test_layers_runs_one_fixed_size_per_system_instead_of_a_search():
    # a fixed model compared in one run (issue 26's 136M LLaMA: --hidden 768 --layers 12), here tiny
    _, res = _bench("--systems", "luwu,ddp", "--layers", "3", "--worker-memory", "3GiB", "--time-budget", "300")
    assert res["errors"] == [], res["errors"]
    for system in ("luwu", "ddp"):
        trials = [t for t in res["trials"] if t["system"] == system]
        assert [t["layers"] for t in trials] == [3] and trials[0]["fits"], trials  # 3 is not on the search's path
        assert res["largest_layers"][system] == 3
    luwu = next(t for t in res["trials"] if t["system"] == "luwu")
    assert len(luwu["mnn_memory"]) == 2 and all(m["peak_bytes"] > 0 for m in luwu["mnn_memory"])
