"""The optimizer math on one shard, with torch's fused CPU kernels (no Python loop over elements).

AdamW/Adam: `torch._fused_adamw_` / `torch._fused_adam_`; SGD: `torch._fused_sgd_`: the
kernels `torch.optim.AdamW/Adam/SGD(fused=True)` run, called the same way (step counter as an
fp32 tensor incremented before the call, one call per weight-decay group), so results match
torch.optim bit for bit. A shard's tensors are views of its record buffer; a weight-decay group
is the list of the shard's runs with (or without) decay. The step goes group by group of about
CACHE_CHUNK elements, each group's new master weights rounded to the served dtype right after
its step, while still in cache.

Gradient clipping follows `torch.nn.utils.clip_grad_norm_`: per-tensor L2 norms
(`torch._foreach_norm`), the norm of those norms, coefficient `min(1, max / (norm + 1e-6))`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from . import fused
from .layout import LayerPlan, ShardPlan
from .spec import OptimizerSpec

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def tensor_norms(plan: LayerPlan, grad: torch.Tensor) -> list[torch.Tensor]:
    """L2 norm of each named tensor of a layer's flat gradient."""
    return list(torch._foreach_norm([grad[lo:hi] for _, lo, hi, _ in plan.segments], 2))


def clip_coefficient(norms: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    total = torch.linalg.vector_norm(torch.stack(norms), 2)
    return torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)


def apply_clip(grad: torch.Tensor, coef: torch.Tensor | None) -> None:
    if coef is not None and float(coef) != 1.0:  # a multiply by 1.0 is the identity: skip the pass
        grad.mul_(coef)


CACHE_CHUNK = 1 << 18  # elements stepped and rounded together: 1 MiB per fp32 array, within a core's L2


@functools.lru_cache(maxsize=4096)
def chunk_groups(plan: ShardPlan, chunk: int = CACHE_CHUNK) -> tuple[tuple[tuple[int, int, bool], ...], ...]:
    """The shard's runs cut into pieces of `chunk` elements from each run's start (which keeps
    every tensor on torch's vector grid), gathered into contiguous groups of about `chunk`."""
    groups, cur, size = [], [], 0
    for a, b, decay in plan.runs:
        for p in range(a, b, chunk):
            q = min(b, p + chunk)
            cur.append((p, q, decay))
            size += q - p
            if size >= chunk:
                groups.append(tuple(cur))
                cur, size = [], 0
    if cur:
        groups.append(tuple(cur))
    return tuple(groups)


def step_shard(opt: OptimizerSpec, plan: ShardPlan, states: list[torch.Tensor], grad: torch.Tensor, step: int,
               grad_scale: torch.Tensor | None, served: torch.Tensor | None = None) -> None:
    """Optimizer step `step` (0-based) on one shard. `states` are the shard's fp32 arrays
    (master first); `grad` is the shard's slice of the layer gradient. `grad_scale` divides the
    gradient inside the kernel (a sum over N workers -> their mean), and the kernel leaves the
    divided gradient in `grad`. `served`: the shard's slice of the new served copy, rounded from
    each group of new master weights right after its step, while they are still in cache (a
    separate pass would read the master back from memory).

    This is the readable reference. AdamW serving bf16 or fp32 runs `fused.step_shard` instead when
    compiled kernels are on (`LUWU_KERNELS`, luwu.dataplane.kernels): the same results bit for
    bit, in one pass."""
    fn, args = prepare_step(opt, plan, states, grad, step, grad_scale, served)
    fn(*args)


def prepare_step(opt: OptimizerSpec, plan: ShardPlan, states: list[torch.Tensor], grad: torch.Tensor, step: int,
                 grad_scale: torch.Tensor | None,
                 served: torch.Tensor | None = None) -> tuple[Callable[..., None], tuple]:
    """`step_shard` (same arguments) in two parts: whatever can run ahead of the step on another
    thread runs now, and the call doing the rest comes back as (function, arguments), run as
    `fn(*args)`. With the compiled kernel, the first part is torch's scalar remainders and the
    call is the kernel alone (`fused.split_step`: one GIL release on the optimizer's thread);
    on the reference path the call is the whole step."""
    if served is not None and fused.usable(opt, served):  # usable() is False without one; said for mypy
        return fused.split_step(opt, plan, states, grad, step, grad_scale, served)
    return _step_reference, (opt, plan, states, grad, step, grad_scale, served)


def _step_reference(opt: OptimizerSpec, plan: ShardPlan, states: list[torch.Tensor], grad: torch.Tensor, step: int,
                    grad_scale: torch.Tensor | None, served: torch.Tensor | None) -> None:
    """`step_shard` with torch's fused kernels (the readable reference)."""
    lr = opt.lr_at(step)
    step_t = torch.tensor(float(step + 1), dtype=torch.float32)
    for group in chunk_groups(plan):
        for decay in (True, False):
            runs = [(lo, hi) for lo, hi, d in group if d == decay]
            if not runs:
                continue
            wd = opt.weight_decay if decay else 0.0
            params = [states[0][lo:hi] for lo, hi in runs]
            grads = [grad[lo:hi] for lo, hi in runs]
            if opt.name in ("adam", "adamw"):
                fn = torch._fused_adamw_ if opt.name == "adamw" else torch._fused_adam_
                fn(params, grads, [states[1][lo:hi] for lo, hi in runs], [states[2][lo:hi] for lo, hi in runs], [],
                   [step_t] * len(runs), lr=lr, beta1=opt.betas[0], beta2=opt.betas[1], weight_decay=wd, eps=opt.eps,
                   amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None)
            else:
                bufs = [states[1][lo:hi] for lo, hi in runs] if opt.momentum else []
                torch._fused_sgd_(params, grads, bufs, weight_decay=wd, momentum=opt.momentum, lr=lr,
                                  dampening=opt.dampening, nesterov=opt.nesterov, maximize=False,
                                  is_first_step=step == 0, grad_scale=grad_scale, found_inf=None)
        if served is not None:
            lo, hi = group[0][0], group[-1][1]
            served[lo:hi].copy_(states[0][lo:hi])


def served_array(plan: LayerPlan, buf: np.ndarray, shard: ShardPlan) -> np.ndarray:
    """The shard's slice of a served-copy buffer as numpy: bf16 as uint16 bits, else the served dtype."""
    itemsize = plan.served_dtype.itemsize
    return buf[shard.elem_lo * itemsize: (shard.elem_lo + shard.numel) * itemsize].view(plan.served_dtype)


def served_view(plan: LayerPlan, buf: np.ndarray, shard: ShardPlan) -> torch.Tensor:
    """The shard's slice of a served-copy buffer, as a torch tensor of the served dtype."""
    raw = served_array(plan, buf, shard)
    if plan.served_dtype == np.uint16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)


def lean_step(opt: OptimizerSpec, shard: ShardPlan, states: list[np.ndarray], grad: np.ndarray, step: int,
              scale: float | None, plan: LayerPlan, served_buf: np.ndarray) -> tuple[Callable[..., None], tuple] | None:
    """`prepare_step`'s call built from numpy arrays (`states`: the shard's state arrays; `grad`:
    the layer's flat gradient; `scale`: the gradient divisor as a float), when nothing has to run
    ahead of it (no clipping here, no torch remainder): the same call, bit for bit (fused.lean_call).
    None: use `prepare_step`."""
    return fused.lean_call(opt, shard, states, grad[shard.elem_lo: shard.elem_lo + shard.numel], step, scale,
                           served_array(plan, served_buf, shard))


def publish_copy(plan: LayerPlan, buf: np.ndarray, shard: ShardPlan, master: torch.Tensor) -> None:
    """Round the fp32 master weights to the served dtype (round to nearest even)."""
    served_view(plan, buf, shard).copy_(master)
