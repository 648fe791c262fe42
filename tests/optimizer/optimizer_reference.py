"""Test helpers: a small layered model, deterministic summed gradients, and the same training
run done by torch.optim in one process (the reference the node must match)."""

from __future__ import annotations

import math

import numpy as np
import torch

from luwu.dataplane.optimizer import JobSpec, LayerSpec, OptimizerSpec


def model_layers(n_layers: int, rows: int = 48, cols: int = 40) -> list[LayerSpec]:
    """Transformer-ish layers: a weight matrix (decay), a bias and a norm scale (no decay)."""
    return [LayerSpec(i, {"weight": (rows + i, cols), "bias": (rows + i,), "norm": (cols,)},
                      frozenset({"bias", "norm"})) for i in range(n_layers)]


def initial_values(layers: list[LayerSpec], seed: int = 5) -> dict:
    rng = np.random.default_rng(seed)
    return {ly.layer_id: {n: (rng.standard_normal(s, dtype=np.float32) * 0.1) for n, s in ly.shapes.items()}
            for ly in layers}


def summed_grad(layer: LayerSpec, step: int, contributors: int, scale: float = 1.0) -> np.ndarray:
    """The layer's gradient of `step`, summed over `contributors` workers (deterministic)."""
    rng = np.random.default_rng([layer.layer_id, step, 17])
    per_worker = rng.standard_normal((contributors, layer.numel), dtype=np.float32) * np.float32(scale)
    return per_worker.sum(axis=0, dtype=np.float32)


def hf_factor(kind: str, warmup: int, total: int, min_ratio: float, step: int) -> float:
    """Hugging Face-style warmup + decay, written independently of the node's ScheduleSpec."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    decayed = 0.5 * (1 + math.cos(math.pi * p)) if kind == "cosine" else 1 - p
    return min_ratio + (1 - min_ratio) * decayed


def reference_run(spec: JobSpec, steps: int, contributors: int, fused: bool | None, grad_scale: float = 1.0):
    """torch.optim on the same parameters and gradients. Returns {layer_id: {state name: flat array}}."""
    opt_spec: OptimizerSpec = spec.optimizer
    params: dict[int, dict[str, torch.nn.Parameter]] = {}
    for ly in spec.layers:
        params[ly.layer_id] = {n: torch.nn.Parameter(torch.from_numpy(np.array(spec.initial[ly.layer_id][n],
                                                                                 dtype=np.float32)).clone())
                               for n in ly.shapes}
    ordered = [(ly, n, params[ly.layer_id][n]) for ly in spec.layers for n in ly.shapes]
    decay = [p for ly, n, p in ordered if n not in ly.no_decay]
    no_decay = [p for ly, n, p in ordered if n in ly.no_decay]
    groups = [{"params": decay, "weight_decay": opt_spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {} if fused is None else {"fused": fused}
    if opt_spec.name == "adamw":
        opt = torch.optim.AdamW(groups, lr=opt_spec.lr, betas=opt_spec.betas, eps=opt_spec.eps, **kw)
    elif opt_spec.name == "adam":
        opt = torch.optim.Adam(groups, lr=opt_spec.lr, betas=opt_spec.betas, eps=opt_spec.eps, **kw)
    else:
        opt = torch.optim.SGD(groups, lr=opt_spec.lr, momentum=opt_spec.momentum, dampening=opt_spec.dampening,
                              nesterov=opt_spec.nesterov, **kw)
    sch = opt_spec.schedule
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: hf_factor(sch.kind, sch.warmup_steps, sch.total_steps, sch.min_lr_ratio, s))
    for step in range(steps):
        for ly in spec.layers:
            g = torch.from_numpy(summed_grad(ly, step, contributors, grad_scale))
            if contributors > 1:
                g = g / contributors
            lo = 0
            for n, shape in ly.shapes.items():
                k = int(np.prod(shape))
                params[ly.layer_id][n].grad = g[lo:lo + k].reshape(shape).clone()
                lo += k
        if opt_spec.clip_grad_norm is not None:
            if opt_spec.clip_scope == "global":
                torch.nn.utils.clip_grad_norm_([p for _, _, p in ordered], opt_spec.clip_grad_norm)
            else:
                for ly in spec.layers:
                    torch.nn.utils.clip_grad_norm_(list(params[ly.layer_id].values()), opt_spec.clip_grad_norm)
        opt.step()
        sched.step()
    out = {}
    for ly in spec.layers:
        names = opt_spec.state_names
        flat = {k: [] for k in names}
        for n in ly.shapes:
            p = params[ly.layer_id][n]
            st = opt.state[p]
            flat["master"].append(p.detach().reshape(-1))
            if "exp_avg" in flat:
                flat["exp_avg"].append(st["exp_avg"].reshape(-1))
                flat["exp_avg_sq"].append(st["exp_avg_sq"].reshape(-1))
            if "momentum_buffer" in flat:
                flat["momentum_buffer"].append(st["momentum_buffer"].reshape(-1))
        out[ly.layer_id] = {k: torch.cat(v).numpy() for k, v in flat.items()}
    return out


def drive(node, spec: JobSpec, steps: int, contributors: int, grad_scale: float = 1.0, start: int = 0) -> None:
    """Feed the node the same gradients, layers in backward order, then wait for the last version."""
    for step in range(start, steps):
        for ly in reversed(spec.layers):
            node.submit_gradient(spec.job_id, ly.layer_id, step, summed_grad(ly, step, contributors, grad_scale),
                                 contributors=contributors)
    for ly in spec.layers:
        node.params(spec.job_id, ly.layer_id, steps, timeout=120)


def assert_matches(node, spec: JobSpec, ref: dict, rtol: float) -> None:
    """Every state array within `rtol` of the reference (relative to the array's largest
    magnitude, so elements that cancel to ~0 are not divided by ~0); rtol=0: bit-identical."""
    for ly in spec.layers:
        got = node.layer_state(spec.job_id, ly.layer_id, timeout=60)
        for name, want in ref[ly.layer_id].items():
            have = got[name]
            if rtol == 0:
                bad = np.flatnonzero(have.view(np.uint32) != want.view(np.uint32))
                assert bad.size == 0, f"layer {ly.layer_id} {name}: {bad.size} elements differ, first at {bad[:5]}"
            else:
                scale = float(np.abs(want).max()) or 1.0
                err = float(np.abs(have.astype(np.float64) - want).max()) / scale
                assert err <= rtol, f"layer {ly.layer_id} {name}: max error {err:.3g} x max|value| > {rtol}"
