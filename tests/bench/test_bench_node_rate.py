"""The optimizer node's start-up rate measurement (luwu/bench/node_rate.py) and what `luwu node`
registers with it: a real OptimizerNode steps a small model; --params-per-second overrides it.
No assertion on the figure's size (the machine is shared): only that it is a real measurement."""

from __future__ import annotations

import argparse
import math

from luwu.bench.node_rate import measure
from luwu.daemons.node import node_capacity


def test_measure_steps_a_real_node_and_reports_its_rate(tmp_path):
    rate = measure(params=1 << 16, layers=2, timed_steps=3, warmup_steps=1, workdir=tmp_path)
    assert rate.params == 2 * 32 * 1024 + 2 * 32 + 2 * 1024  # _layers: (rows, 1024) weight, bias, norm per layer
    assert 1 <= rate.steps <= 3 and rate.step_seconds > 0 and rate.seconds >= rate.step_seconds * rate.steps
    assert math.isfinite(rate.params_per_second)
    assert rate.params_per_second == rate.params / rate.step_seconds
    assert rate.to_dict()["source"] == "measured" and rate.served == "bf16"
    assert list(tmp_path.iterdir()) == []  # its node's state directory is gone


def test_luwu_node_registers_the_flag_or_else_its_measurement():
    given = node_capacity(argparse.Namespace(params_per_second=2.5e8))
    assert given == {"params_per_second": 2.5e8, "source": "--params-per-second"}
    measured = node_capacity(argparse.Namespace(params_per_second=None, pipeline="step", threads_per_step=1))
    assert measured["source"] == "measured" and measured["params_per_second"] > 0
    assert measured["params_per_second"] == measured["params"] / measured["step_seconds"]
