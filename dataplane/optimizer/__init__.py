"""The in-network optimizer node's core: out-of-core optimizer state, torch's fused optimizer
kernels, the step-centric pipeline and lazy asynchronous checkpoints (docs/optimizer.md).

    node = OptimizerNode(NodeConfig(state_dir=..., ram_budget=..., checkpoint_dir=...))
    node.add_job(JobSpec("job", OptimizerSpec("adamw", lr=1e-3), layers=[LayerSpec(0, {"w": (64, 64)})]))
    node.submit_gradient("job", 0, step=0, grad=summed_fp32_flat, contributors=n_workers)
    w = node.params("job", 0, version=1, timeout=10)     # bf16 bits as np.uint16, fp16, or fp32

The network side (`service.py`, `daemon.py`) hosts a node behind an engine; the core does not
import the engine.
"""

from .checkpoint import CheckpointHandle
from .errors import (
                     BadGradient,
                     CheckpointError,
                     NodeFailed,
                     NonFiniteGradient,
                     OptimizerInputError,
                     StepOutOfOrder,
                     UnknownJob,
                     UnknownLayer,
)
from .node import OptimizerNode
from .spec import JobSpec, LayerSpec, NodeConfig, OptimizerSpec, ScheduleSpec

__all__ = [
    "BadGradient", "CheckpointError", "CheckpointHandle", "JobSpec", "LayerSpec", "NodeConfig", "NodeFailed",
    "NonFiniteGradient", "OptimizerInputError", "OptimizerNode", "OptimizerSpec", "ScheduleSpec", "StepOutOfOrder",
    "UnknownJob", "UnknownLayer",
]
