"""The optimizer node's step rate in params/s, measured in well under a second of stepping: what
`luwu node` registers with the controller (`NodeCapacity.params_per_second`) unless
`--params-per-second` says otherwise, and what the demo's plan prediction uses.

It is `luwu bench optimizer`'s in-RAM node measurement (`NodeRun`: a real OptimizerNode, every
layer's summed gradient through the engine's gradient sink in backward order, then wait for every
layer's new version; AdamW plus the served bf16 copy) on a small model, timed over a few steps
after warm-up steps that pay for first-touch allocations and the kernels' load or compile (numba
compiles once per machine and caches; loading the cache takes ~0.5 s of CPU, not timed). The
figure is the median step's params/s, so one slow spell of a shared machine does not set it.
Small layers carry more per-layer overhead than a large model's, so on a big model the node
steps somewhat faster than this figure says (docs/simulator.md "Calibration by measurement").
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CALIBRATION_PARAMS = 1 << 20  # parameters stepped per timed step (4 layers of 256K)
CALIBRATION_LAYERS = 4
WARMUP_STEPS = 3  # untimed: allocations, the kernels' load (numba: cached compile), the pipeline's threads
TIMED_STEPS = 20  # ~1-3 ms each here
TIME_BUDGET = 0.5  # s of timed stepping at most; fewer steps on a slow machine (at least one)


@dataclass(frozen=True)
class NodeRate:
    """A measured optimizer node step rate."""

    params_per_second: float
    params: int  # parameters stepped per step
    steps: int  # timed steps (median taken)
    step_seconds: float  # the median timed step
    seconds: float  # wall time of the whole calibration, warm-up included
    served: str  # the served dtype the node wrote beside the fp32 master
    source: str = "measured"

    def to_dict(self) -> dict:
        return asdict(self)


def measure(params: int = CALIBRATION_PARAMS, layers: int = CALIBRATION_LAYERS, served: str = "bf16",
            timed_steps: int = TIMED_STEPS, warmup_steps: int = WARMUP_STEPS, budget: float = TIME_BUDGET,
            workdir: Path | None = None, **node_config: Any) -> NodeRate:
    """Measure this machine's optimizer node step rate on a small model.

    Args:
        params: parameters of the model stepped (split over `layers`, 1024 columns each).
        layers: layers of the model (each a weight, a bias and a norm scale).
        served: the served dtype the node writes ("bf16", "fp16" or "fp32").
        timed_steps: timed steps at most; the median is taken.
        warmup_steps: untimed steps first.
        budget: seconds of timed stepping after which no further timed step starts.
        workdir: where the node's state directory goes (default: a temporary one, removed after).
        **node_config: NodeConfig fields the measured node takes, as the real one does (e.g.
            `pipeline="layer"`, `threads_per_step=2`).

    Returns:
        A `NodeRate`; `params_per_second` is what to register as the node's capacity.

    Examples::

        >>> rate = measure()
        >>> rate.params_per_second > 0
        True
    """
    from luwu.bench.optimizer import NodeRun, _grads, _layers

    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="luwu-node-rate-", dir=workdir))
    try:
        specs = _layers(params, layers)
        n = sum(ly.numel for ly in specs)
        run = NodeRun(root, "calibrate", specs, _grads(specs), served, ram_budget=3 * 16 * n, **node_config)
        try:
            run.run(warmup_steps)
            times: list[float] = []
            deadline = time.perf_counter() + budget
            while len(times) < max(1, timed_steps) and (not times or time.perf_counter() < deadline):
                times += run.run(1)
        finally:
            run.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    step = statistics.median(times)
    return NodeRate(n / step, n, len(times), step, time.perf_counter() - t0, served)
