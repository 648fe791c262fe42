"""`luwu mininet run` writes one timeline of the run (root, netns backend): the workers, the switch
and the optimizer node in their own namespaces, on the host's one clock, in a Chrome trace whose
path the run reports."""

from __future__ import annotations

import json

import pytest
from mininet_helpers import check_clean, needs_root, run_json

pytestmark = [needs_root, pytest.mark.netns]


def test_a_push_pull_run_traces_workers_switch_and_node_on_one_clock(tmp_path):
    out = tmp_path / "run-trace.json"
    info = run_json("--topo", "star", "--workers", "2", "--backend", "netns", "--size", "64KiB", "--push-pull",
                    "--trace", str(out))
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["trace"] == str(out)
        events = json.loads(out.read_text())["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
        assert sorted(names.values()) == ["optimizer node (n0)", "switch (switch-s1)", "worker 0 (w0)",
                                          "worker 1 (w1)"], names
        spans: dict[str, dict[str, list[dict]]] = {}
        for e in events:
            if e["ph"] == "X":
                spans.setdefault(names[e["pid"]], {}).setdefault(e["name"], []).append(e)
        assert spans["switch (switch-s1)"]["pipeline turn"]
        assert len(spans["optimizer node (n0)"]["optimize"]) == 2  # two layers, one summed gradient each
        workers = [spans[f"worker {r} (w{r})"] for r in (0, 1)]
        pushes = [w["push wait"][0] for w in workers]
        pulls = [next(p for p in w["pull wait"] if p["args"]["version"] == 1) for w in workers]
        # one clock across the namespaces, by causality alone: the node applies a gradient after both
        # workers began to push it (the switch sums both), and a worker has the new version only after
        for step in spans["optimizer node (n0)"]["optimize"]:
            assert max(p["ts"] for p in pushes) <= step["ts"]
            assert step["ts"] + step["dur"] <= min(p["ts"] + p["dur"] for p in pulls)
    finally:
        check_clean(info)
