"""The Mininet backend end to end: Debian's mininet (system python) builds the network, the venv runs the
switches and the engines in its hosts. Skipped, naming what to install, where Mininet is missing."""

from __future__ import annotations

import os

import pytest
from mininet_helpers import check_clean, counters, needs_root, run_json

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.protocol import Dtype
from luwu.mininet import mininet_backend


def _missing() -> str | None:
    return mininet_backend.missing() if os.geteuid() == 0 else "needs root"


pytestmark = [needs_root, pytest.mark.netns,
              pytest.mark.skipif(_missing() is not None, reason=f"Mininet backend unavailable: {_missing()}")]


def test_star_on_mininet_with_shaped_links_sums_exactly():
    info = run_json("--topo", "star", "--workers", "3", "--backend", "mininet", "--size", "64KiB", "--bw", "200")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["backend"] == "mininet" and info["bw_mbit"] == 200
        assert info["allreduce"]["verified"] == 3
        assert all(w["mismatches"] == 0 and w["contributors"] == 3 for w in info["allreduce"]["per_worker"])
        assert counters(info, "s1", "COMPLETED") == -(-16384 // data_lanes(2048, Dtype.INT32))  # 9
    finally:
        check_clean(info)


def test_rail_only_on_mininet_with_nvlink_bridges_and_push_pull():
    info = run_json("--topo", "rail-only", "--workers", "4", "--gpus", "2", "--backend", "mininet", "--size", "64KiB",
                    "--push-pull")
    try:
        assert info["_returncode"] == 0 and info["passed"], (info["errors"], info["_logs"])
        assert info["allreduce"]["verified"] == 4 and info["pushpull"]["verified"] == 4
        assert all(w["contributors"] == 4 for w in info["allreduce"]["per_worker"])
        assert info["pushpull"]["node_gradients"] > 0
    finally:
        check_clean(info)
