"""A paper-scale simulator and capacity planner for luwu and the systems a user would pick instead
(`luwu simulate`, docs/simulator.md). Application layer: it reads packet sizes from
luwu.dataplane.protocol and runs luwu.bench for `--calibrate`; only luwu/cli.py imports it.
"""

from luwu.simulate.core import simulate
from luwu.simulate.hardware import MODELS, PRESETS, Config, model_named

__all__ = ["MODELS", "PRESETS", "Config", "model_named", "simulate"]
