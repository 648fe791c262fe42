"""What the optimizer node is told: the node's configuration, a job's optimizer, schedule and
layers. Everything here is validated on construction with messages that say what to fix, and
round-trips through JSON (checkpoint manifests store job specs).

A *layer* is the unit the workers pull and push as one buffer: named tensors flattened in the
order of `LayerSpec.shapes`. Versions count optimizer steps: a layer at version v has had v
steps; the gradient of step s (0-based) turns version s into s + 1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import OptimizerInputError

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # same rule as the controller's job names
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine", "linear")
SERVED_DTYPES: dict[str, np.dtype] = {"bf16": np.dtype(np.uint16), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
CLIP_SCOPES = ("global", "layer")
PIPELINES = ("step", "layer")
SHARD_ALIGN_ELEMS = 4096  # a tensor split across shards is cut on a multiple of this (the kernels' vector grid)
DEFAULT_INIT_STD = 0.02  # `initial=<seed>`: weights ~ N(0, 0.02^2), GPT-2's init
# bytes a `luwu node` process holds beyond its ram_budget, whatever the model (docs/optimizer.md "RAM"):
# measured 440-475 MiB peak (VmHWM) at 4-16 MiB budgets on this VM: Python and torch ~225 MB, numba and
# llvmlite (the compiled AdamW kernel) ~150 MB, the shared-memory rings ~31 MB, engine, pipeline and heap the rest;
# 548 MiB on a fresh install, whose first node compiles the kernels (LLVM maps ~100 MiB more of its library)
NODE_RSS_OVERHEAD = 640 << 20


def _bad(msg: str) -> OptimizerInputError:
    return OptimizerInputError(msg)


@dataclass(frozen=True)
class ScheduleSpec:
    """Learning-rate multiplier as a function of the 0-based step index.

    constant: 1 after warmup. cosine / linear: decay from 1 to `min_lr_ratio` over
    `total_steps - warmup_steps` steps, then stay there. Warmup is linear from 0:
    factor(s) = s / warmup_steps for s < warmup_steps (the Hugging Face convention, so the
    first warmup step has lr 0).
    """

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise _bad(f"schedule kind {self.kind!r}: choose one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise _bad(f"schedule warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.kind != "constant" and self.total_steps <= self.warmup_steps:
            raise _bad(f"schedule {self.kind!r} needs total_steps > warmup_steps "
                       f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise _bad(f"schedule min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, float(step - self.warmup_steps) / float(max(1, self.total_steps - self.warmup_steps)))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer settings of a job (torch.optim semantics and defaults for each name).

    clip_grad_norm: None, or the max L2 norm of the gradient. With clip_scope="global" the norm is
    over every layer of the job (torch.nn.utils.clip_grad_norm_ on all parameters), which holds
    every layer's step until the last layer's gradient of that step has arrived; "layer" clips
    each layer on its own and keeps the overlap.
    """

    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    clip_grad_norm: float | None = None
    clip_scope: str = "global"

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise _bad(f"optimizer {self.name!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule is None:
            object.__setattr__(self, "schedule", ScheduleSpec())
        elif isinstance(self.schedule, Mapping):
            object.__setattr__(self, "schedule", ScheduleSpec(**self.schedule))
        elif isinstance(self.schedule, str):
            object.__setattr__(self, "schedule", ScheduleSpec(kind=self.schedule))
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise _bad(f"lr must be a finite number >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise _bad(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise _bad(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise _bad(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.momentum < 0 or self.dampening < 0:
            raise _bad("momentum and dampening must be >= 0")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise _bad("nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD)")
        if self.name != "sgd" and (self.momentum or self.nesterov or self.dampening):
            raise _bad(f"momentum/nesterov/dampening are SGD settings; optimizer is {self.name!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise _bad(f"clip_grad_norm must be None or > 0, got {self.clip_grad_norm}")
        if self.clip_scope not in CLIP_SCOPES:
            raise _bad(f"clip_scope {self.clip_scope!r}: choose one of {', '.join(CLIP_SCOPES)}")

    @property
    def state_names(self) -> tuple[str, ...]:
        """fp32 arrays per parameter: the master weights and the optimizer's state."""
        if self.name in ("adam", "adamw"):
            return ("master", "exp_avg", "exp_avg_sq")
        return ("master", "momentum_buffer") if self.momentum else ("master",)

    def lr_at(self, step: int) -> float:
        return self.lr * self.schedule.factor(step)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OptimizerSpec:
        """From JSON, or the controller's `{"name": ..., "params": {...}}` form."""
        d = dict(d)
        params = d.pop("params", None) or {}
        d.pop("param_dtype", None)
        merged = {**d, **params}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(merged) - known)
        if unknown:
            raise _bad(f"unknown optimizer setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**merged)


@dataclass(frozen=True)
class LayerSpec:
    """One buffer of the model: named tensors flattened in `shapes` order. Names in `no_decay`
    (norms and biases, usually) get no weight decay."""

    layer_id: int
    shapes: Mapping[str, tuple[int, ...]]
    no_decay: frozenset[str] = frozenset()

    def __post_init__(self):
        if not isinstance(self.layer_id, (int, np.integer)) or not 0 <= int(self.layer_id) < 2**32:
            raise _bad(f"layer_id must be an integer in [0, 2^32) (it is the wire's tensor id), got {self.layer_id!r}")
        object.__setattr__(self, "layer_id", int(self.layer_id))
        if not self.shapes:
            raise _bad(f"layer {self.layer_id}: shapes is empty")
        shapes = {}
        for name, shape in dict(self.shapes).items():
            shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
            if any(s <= 0 for s in shape):
                raise _bad(f"layer {self.layer_id}: tensor {name!r} has a non-positive dimension {shape}")
            shapes[str(name)] = shape
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "no_decay", frozenset(self.no_decay))
        missing = sorted(self.no_decay - set(shapes))
        if missing:
            raise _bad(f"layer {self.layer_id}: no_decay names {missing} are not in shapes")

    @property
    def numel(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes.values())

    @classmethod
    def from_named_parameters(cls, layer_id: int, named, no_decay: str | set = "auto") -> LayerSpec:
        """From (name, tensor) pairs, e.g. `module.named_parameters()`; "auto": tensors of fewer
        than 2 dimensions (biases, norm scales) get no weight decay."""
        named = list(named)
        shapes = {n: tuple(t.shape) for n, t in named}
        nd = {n for n, t in named if t.dim() < 2} if no_decay == "auto" else set(no_decay)
        return cls(layer_id, shapes, frozenset(nd))


@dataclass
class JobSpec:
    """A training job on this node. `initial` is {layer_id: {name: fp32 array/tensor}}, an int
    seed (weights ~ N(0, 0.02^2), deterministic per seed and layer), or None: zeros, for values that
    follow layer by layer (`OptimizerNode.set_initial`)."""

    job_id: str
    optimizer: OptimizerSpec
    layers: list[LayerSpec]
    served_dtype: str = "bf16"
    initial: Any = 0

    def __post_init__(self):
        if not isinstance(self.job_id, str) or not JOB_ID_RE.match(self.job_id):
            raise _bad(f"job_id {self.job_id!r}: use 1-63 letters, digits, '_', '.', '-' "
                       f"(starting with a letter or digit)")
        if isinstance(self.optimizer, Mapping):
            self.optimizer = OptimizerSpec.from_dict(self.optimizer)
        if self.served_dtype not in SERVED_DTYPES:
            raise _bad(f"served_dtype {self.served_dtype!r}: choose one of {', '.join(SERVED_DTYPES)}")
        if not self.layers:
            raise _bad(f"job {self.job_id}: no layers")
        seen = set()
        for layer in self.layers:
            if layer.layer_id in seen:
                raise _bad(f"job {self.job_id}: layer id {layer.layer_id} appears twice")
            seen.add(layer.layer_id)

    def to_json(self) -> dict:
        """Everything but `initial` (a checkpoint holds the state itself)."""
        opt = asdict(self.optimizer)
        return {"job_id": self.job_id, "served_dtype": self.served_dtype, "optimizer": opt,
                # shapes as [name, shape] pairs: their order is the flattening order (JSON objects get sorted)
                "layers": [{"layer_id": ly.layer_id, "shapes": [[k, list(v)] for k, v in ly.shapes.items()],
                            "no_decay": sorted(ly.no_decay)} for ly in self.layers]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], initial: Any = 0) -> JobSpec:
        opt = dict(d["optimizer"])
        opt["betas"] = tuple(opt["betas"])
        def shapes(s):  # [name, shape] pairs (to_json), or an object (its key order is the flattening order)
            return {k: tuple(v) for k, v in (s.items() if isinstance(s, Mapping) else s)}

        layers = [LayerSpec(ly["layer_id"], shapes(ly["shapes"]), frozenset(ly.get("no_decay", ())))
                  for ly in d["layers"]]
        return cls(d["job_id"], OptimizerSpec(**opt), layers, d["served_dtype"], initial)


@dataclass
class NodeConfig:
    """The node's resources. Sizes are bytes.

    state_dir: scratch files of the working state (one per shard), owned exclusively by this node.
    ram_budget: RAM for shard state and served copies; when the state does not fit, shards stream
        through it and `served_fraction` of it caches served copies.
    threads_per_step: threads of each pipeline step (receive, read, optimize, write, publish).
    pipeline: "step" (step-centric: a thread pool per step, layers rotate through them) or
        "layer" (layer-centric: each layer's whole sequence on one thread of a pool of the same size).
    queue_depth: bound of the queues between steps.
    inline_elems: a layer of at most this many elements whose state is in RAM is stepped and
        published on the thread that submits its gradient (the engine's, on the network), not
        handed to the pipeline's threads; 0 turns that off (docs/optimizer.md "Pipeline").
    max_shard_elems: a layer larger than this is split into shards (a multiple of 4096).
    prefetch: shards whose state is read ahead, in predicted arrival (backward) order.
    direct_io: O_DIRECT for state files; None tries it and falls back to buffered I/O plus
        posix_fadvise(DONTNEED) on file systems without it (tmpfs).
    checkpoint_dir: where checkpoints go (None: checkpoints are refused).
    checkpoint_keep: complete checkpoints kept; older ones are deleted after a new one commits.
    checkpoint_staging: RAM for copy-on-write snapshots of shards whose next step arrives before
        their checkpoint copy is written; beyond it the step waits for the writer.
    checkpoint_rate: bytes/s cap of checkpoint writes (None: as fast as the disk goes).
    checkpoint_chunk: bytes per checkpoint write call (and checksum update).
    checkpoint_nice: the checkpoint writer's threads run at this nice value (Linux per-thread
        priority), so its checksums use CPU the pipeline leaves idle; 0 keeps normal priority.
    """

    state_dir: Path
    ram_budget: int = 1 << 30
    threads_per_step: int = 1
    pipeline: str = "step"
    queue_depth: int = 4
    inline_elems: int = 1 << 18
    max_shard_elems: int = 1 << 22
    prefetch: int = 2
    served_fraction: float = 0.25
    direct_io: bool | None = None
    checkpoint_dir: Path | None = None
    checkpoint_keep: int = 2
    checkpoint_staging: int = 256 << 20
    checkpoint_rate: float | None = None
    checkpoint_chunk: int = 8 << 20
    checkpoint_nice: int = 10

    def __post_init__(self):
        self.state_dir = Path(self.state_dir)
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = Path(self.checkpoint_dir)
        if self.ram_budget <= 0:
            raise _bad(f"ram_budget must be > 0 bytes, got {self.ram_budget}")
        if self.threads_per_step < 1 or self.queue_depth < 1:
            raise _bad("threads_per_step and queue_depth must be >= 1")
        if self.inline_elems < 0:
            raise _bad(f"inline_elems must be >= 0 (0: never inline), got {self.inline_elems}")
        if self.pipeline not in PIPELINES:
            raise _bad(f"pipeline {self.pipeline!r}: choose one of {', '.join(PIPELINES)}")
        if self.max_shard_elems < SHARD_ALIGN_ELEMS or self.max_shard_elems % SHARD_ALIGN_ELEMS:
            raise _bad(f"max_shard_elems must be a positive multiple of {SHARD_ALIGN_ELEMS}, "
                       f"got {self.max_shard_elems}")
        if self.prefetch < 0:
            raise _bad(f"prefetch must be >= 0, got {self.prefetch}")
        if not 0.0 < self.served_fraction < 1.0:
            raise _bad(f"served_fraction must be in (0, 1), got {self.served_fraction}")
        if self.checkpoint_keep < 1:
            raise _bad(f"checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if self.checkpoint_rate is not None and not self.checkpoint_rate > 0:
            raise _bad(f"checkpoint_rate must be None or > 0 bytes/s, got {self.checkpoint_rate}")
        if not 0 <= self.checkpoint_nice <= 19:
            raise _bad(f"checkpoint_nice must be 0..19, got {self.checkpoint_nice}")
        if self.checkpoint_chunk < 4096 or self.checkpoint_chunk % 4096:
            raise _bad(f"checkpoint_chunk must be a positive multiple of 4096, got {self.checkpoint_chunk}")
