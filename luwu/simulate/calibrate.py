"""`luwu simulate --calibrate`: set the model's software speeds from luwu's own optimizer benchmark
(`luwu bench optimizer`, run briefly here) instead of the documented defaults.

What it sets, and why that is the right measurement (docs/simulator.md "Calibration"):
* `adam_params_per_core`: the node's in-RAM step rate (`node_params_per_s`). The node runs one
  thread per pipeline step, so that rate is what one core of AdamW (plus the bf16 served copy)
  achieves; the model multiplies it by the node's cores and caps it by memory bandwidth.
* `disk_efficiency`: `fraction_of_disk_bandwidth`, the node's out-of-core state traffic over the
  disk's own read+write bandwidth on the same files: how much of its SSDs the node would use.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from luwu.simulate.hardware import Config

BENCH_ARGS = ["--params", "4M", "--layers", "4", "--steps", "2", "--ooc-params", "2M", "--ooc-ratio", "4"]


class _Status:
    def __init__(self, progress):
        self.progress = progress

    def update(self, text: str) -> None:
        if self.progress:
            self.progress(f"calibrating: {text}")


def measure(progress=None) -> dict:
    """Run the optimizer benchmark's in-RAM and out-of-core parts briefly; returns its figures."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from luwu.bench import optimizer as bench

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(BENCH_ARGS)
    root = Path(tempfile.mkdtemp(prefix="luwu-simulate-calibrate-"))
    try:
        res = dict(bench.bench_ram(root, args, _Status(progress)))
        res.update(bench.bench_out_of_core(root, args, _Status(progress)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def apply(cfg: Config, measured: dict) -> Config:
    """The config with the measured software speeds in place of the defaults."""
    node = replace(cfg.node, adam_params_per_core=float(measured["node_params_per_s"]),
                   disk_efficiency=min(1.0, float(measured["fraction_of_disk_bandwidth"])))
    return cfg.with_(node=node)
