"""The optimizer node's state per job and per layer (`OptimizerNode.jobs`): what node.py and its
checkpoint half (node_checkpoints.py) both read, in a module of its own so neither imports the other.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .layout import LayerPlan
from .pipeline import LayerStep
from .spec import JobSpec


@dataclass(eq=False)
class LayerRuntime:
    plan: LayerPlan
    version: int = 0
    next_step: int = 0
    pending: collections.deque[LayerStep] = field(default_factory=collections.deque)
    in_flight: object = None  # LayerStep, node.py's _QUIESCE marker or None


@dataclass(eq=False)
class JobRuntime:
    spec: JobSpec
    max_shard_elems: int
    layers: dict[int, LayerRuntime]
    rank: dict[int, int]  # layer id -> position in the spec (forward order; the global norm's order)
    order: list[int] = field(default_factory=list)  # layer ids in forward order
    arrivals: dict[int, list[int]] = field(default_factory=dict)  # step -> layer ids in arrival order
    skipped: dict[int, list[int]] = field(default_factory=dict)  # step -> layer ids whose step was skipped
