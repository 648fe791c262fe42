"""A layer's starting state: from the caller's tensors, from a seed, or from a checkpoint record.

Each source yields, per shard, a function that fills an entry buffer (header and fp32 states)
and returns the shard's step count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import OptimizerInputError
from .layout import LayerPlan, ShardPlan
from .spec import DEFAULT_INIT_STD

Filler = Callable[[np.ndarray], int]


def _as_fp32(name: str, layer_id: int, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        if not value.dtype.is_floating_point:
            raise OptimizerInputError(f"initial value of layer {layer_id} tensor {name!r} is {value.dtype}, "
                                      f"not floating point")
        value = value.detach().cpu().float().numpy()
    arr = np.asarray(value)
    if arr.dtype != np.float32:
        if not np.issubdtype(arr.dtype, np.floating):
            raise OptimizerInputError(f"initial value of layer {layer_id} tensor {name!r} is {arr.dtype}, "
                                      f"not floating point")
        arr = arr.astype(np.float32)
    if tuple(arr.shape) != tuple(shape) and arr.size != int(np.prod(shape)):
        raise OptimizerInputError(f"initial value of layer {layer_id} tensor {name!r} has shape {tuple(arr.shape)}, "
                                  f"the layer spec says {tuple(shape)}")
    if not np.isfinite(arr).all():
        raise OptimizerInputError(f"initial value of layer {layer_id} tensor {name!r} has NaN or Inf")
    return arr.reshape(-1)


def check_initial(plans: list[LayerPlan], initial: Any) -> None:
    """The structure of `initial` (a seed, None for zeros, or every layer's tensors by name with
    their shapes); the values are checked as each layer is loaded."""
    if initial is None or (isinstance(initial, (int, np.integer)) and not isinstance(initial, bool)):
        return
    if not isinstance(initial, dict):
        raise OptimizerInputError("initial must be an int seed or {layer_id: {name: fp32 array}}")
    for plan in plans:
        spec = plan.spec
        tensors = initial.get(spec.layer_id)
        if tensors is None:
            raise OptimizerInputError(f"initial has no entry for layer {spec.layer_id}")
        missing = [n for n in spec.shapes if n not in tensors]
        extra = [n for n in tensors if n not in spec.shapes]
        if missing or extra:
            raise OptimizerInputError(f"initial values of layer {spec.layer_id}: missing {missing}, unexpected {extra}")
        for name, shape in spec.shapes.items():
            got = tuple(getattr(tensors[name], "shape", ()))
            if got != tuple(shape) and int(np.prod(got)) != int(np.prod(shape)):
                raise OptimizerInputError(f"initial value of layer {spec.layer_id} tensor {name!r} has shape {got}, "
                                          f"the layer spec says {tuple(shape)}")


def initial_master(plan: LayerPlan, initial: Any) -> np.ndarray:
    """The layer's flat fp32 starting weights (None: zeros, whose untouched pages cost no RAM)."""
    spec = plan.spec
    if initial is None:
        return np.zeros(plan.numel, dtype=np.float32)
    if isinstance(initial, (int, np.integer)) and not isinstance(initial, bool):
        rng = np.random.default_rng([int(initial), spec.layer_id])
        return rng.standard_normal(plan.numel, dtype=np.float32) * np.float32(DEFAULT_INIT_STD)
    if not isinstance(initial, dict):
        raise OptimizerInputError("initial must be an int seed or {layer_id: {name: fp32 array}}")
    tensors = initial.get(spec.layer_id)
    if tensors is None:
        raise OptimizerInputError(f"initial has no entry for layer {spec.layer_id}")
    flat = layer_values(plan, tensors)
    out = np.empty(plan.numel, dtype=np.float32)
    for name, lo, hi, _ in plan.segments:
        out[lo:hi] = flat[name]
    return out


def layer_values(plan: LayerPlan, tensors: Any) -> dict[str, np.ndarray]:
    """A layer's starting tensors ({name: values}) checked (names, sizes, finite) and flat fp32,
    without a copy where they are already that."""
    spec = plan.spec
    if not isinstance(tensors, dict):
        raise OptimizerInputError(f"initial values of layer {spec.layer_id} must be {{name: fp32 array}}")
    missing = [n for n in spec.shapes if n not in tensors]
    extra = [n for n in tensors if n not in spec.shapes]
    if missing or extra:
        raise OptimizerInputError(f"initial values of layer {spec.layer_id}: missing {missing}, unexpected {extra}")
    return {name: _as_fp32(name, spec.layer_id, tensors[name], spec.shapes[name]) for name in spec.shapes}


def values_filler(plan: LayerPlan, shard: ShardPlan, flat: dict[str, np.ndarray]) -> Filler:
    """Step 0 from a layer's checked tensors (`layer_values`): the shard's master copied from the
    pieces of them it holds, optimizer state zero (no whole-layer copy: one shard at a time)."""

    def fill(buf: np.ndarray) -> int:
        buf[:] = 0  # pooled buffers hold old data
        master = shard.state_views(buf)[0]
        s_lo, s_hi = shard.elem_lo, shard.elem_lo + shard.numel
        for name, lo, hi, _ in plan.segments:
            a, b = max(lo, s_lo), min(hi, s_hi)
            if a < b:
                master[a - s_lo: b - s_lo] = flat[name][a - lo: b - lo]
        shard.write_header(buf, 0)
        return 0

    return fill


def fresh_filler(shard: ShardPlan, master: np.ndarray) -> Filler:
    """Step 0: master from the layer's weights, optimizer state zero."""

    def fill(buf: np.ndarray) -> int:
        buf[:] = 0  # pooled buffers hold old data
        views = shard.state_views(buf)
        views[0][:] = master[shard.elem_lo: shard.elem_lo + shard.numel]
        shard.write_header(buf, 0)
        return 0

    return fill


def record_filler(shard: ShardPlan, load: Callable[[], np.ndarray]) -> Filler:
    """A checkpoint record, byte for byte; `load()` reads and verifies it (when it is needed)."""

    def fill(buf: np.ndarray) -> int:
        n = shard.entry_bytes
        np.copyto(buf[:n], load()[:n])
        return shard.read_header(buf, "checkpoint record")

    return fill
