"""Optimizer specs for model-in-network training: `luwu.AdamW(lr=...)`, `luwu.Adam`, `luwu.SGD`.

These only describe the optimizer (they build the node's `OptimizerSpec`); the optimizer runs
on the in-network optimizer node, never on the worker. Defaults follow torch.optim for each
name (AdamW's weight decay is 1e-2 as in `torch.optim.AdamW`), so the same settings give the
same training as the torch optimizer they are named after.
"""

from __future__ import annotations

from luwu.dataplane.optimizer.spec import OptimizerSpec, ScheduleSpec

TORCH_ADAMW_WEIGHT_DECAY = 1e-2  # torch.optim.AdamW's default


def _schedule(schedule) -> ScheduleSpec:
    if schedule is None:
        return ScheduleSpec()
    if isinstance(schedule, ScheduleSpec):
        return schedule
    if isinstance(schedule, str):
        return ScheduleSpec(kind=schedule)
    return ScheduleSpec(**dict(schedule))


def AdamW(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = TORCH_ADAMW_WEIGHT_DECAY, schedule=None, clip_grad_norm: float | None = None,
          clip_scope: str = "global") -> OptimizerSpec:
    """torch.optim.AdamW on the optimizer node. Norms and biases (tensors of fewer than two
    dimensions) get no weight decay unless the unit's LayerSpec says otherwise."""
    return OptimizerSpec("adamw", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         schedule=_schedule(schedule), clip_grad_norm=clip_grad_norm, clip_scope=clip_scope)


def Adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
         schedule=None, clip_grad_norm: float | None = None, clip_scope: str = "global") -> OptimizerSpec:
    """torch.optim.Adam (L2 weight decay added to the gradient) on the optimizer node."""
    return OptimizerSpec("adam", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         schedule=_schedule(schedule), clip_grad_norm=clip_grad_norm, clip_scope=clip_scope)


def SGD(lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, schedule=None, clip_grad_norm: float | None = None,
        clip_scope: str = "global") -> OptimizerSpec:
    """torch.optim.SGD on the optimizer node."""
    return OptimizerSpec("sgd", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, schedule=_schedule(schedule), clip_grad_norm=clip_grad_norm,
                         clip_scope=clip_scope)


def as_optimizer_spec(optimizer) -> OptimizerSpec:
    """Accept an OptimizerSpec, or a dict in its JSON form; refuse a torch optimizer with advice."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if isinstance(optimizer, dict):
        return OptimizerSpec.from_dict(optimizer)
    try:
        import torch

        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("ModelInNetwork runs the optimizer on the optimizer node: pass a spec such as "
                            "luwu.AdamW(lr=...) instead of a torch.optim optimizer (which would hold state here)")
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    raise TypeError(f"optimizer must be luwu.AdamW(...), luwu.Adam(...), luwu.SGD(...) or an OptimizerSpec, "
                    f"got {type(optimizer).__name__}")
