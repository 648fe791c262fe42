"""How an optimizer node splits its RAM budget, and the least a job needs (docs/optimizer.md "RAM").

The budget holds shard records (the state: master weights and optimizer arrays) and served copies
(each layer's parameters as the workers pull them). The floor of a set of layers is two shard
records (the one stepped, the next one read or the last one written back) and two served copies
of the largest layer (the version being built beside the one the workers pull). A shard can be
cut smaller to lower the floor; a served copy cannot (the engine streams a pull out of one array
per layer).
"""

from __future__ import annotations

from .errors import OptimizerInputError
from .layout import LayerPlan, plan_layer
from .spec import SHARD_ALIGN_ELEMS, JobSpec, NodeConfig

MIN_SHARD_ELEMS = 16 * SHARD_ALIGN_ELEMS  # a small budget shrinks shards down to this (768 KiB AdamW records)


def floor(plans: list[LayerPlan]) -> int:
    """The least RAM a node can step these layers in, in bytes."""
    return (2 * max(s.entry_bytes for p in plans for s in p.shards)
            + 2 * max(p.served_buffer_bytes for p in plans))


def shard_elems_for(config: NodeConfig, others: list[LayerPlan], spec: JobSpec) -> int:
    """`config.max_shard_elems`, halved (down to MIN_SHARD_ELEMS) while the floor of the job's
    layers with the node's `others` does not fit `config.ram_budget`. Cuts stay on the kernels'
    4096-element grid, so the results are the same bits; smaller shards cost more calls and files,
    so they are cut only as far as the budget needs."""
    elems = config.max_shard_elems
    while elems > MIN_SHARD_ELEMS:
        if floor(others + [plan_layer(spec, ly, elems) for ly in spec.layers]) <= config.ram_budget:
            break
        elems = max(MIN_SHARD_ELEMS, elems // 2 // SHARD_ALIGN_ELEMS * SHARD_ALIGN_ELEMS)
    return elems


def split(config: NodeConfig, plans: list[LayerPlan]) -> tuple[int, int]:
    """(state budget, served budget) for these layers. When everything fits, served copies get
    twice their size (a new version is built beside the old) and nothing moves after start-up.
    Otherwise each side gets at least its floor, served copies `served_fraction` of the budget
    when that leaves the state its floor, and the state the rest. OptimizerInputError, with the
    floor, when the budget is below it."""
    budget = config.ram_budget
    big_entry = max(s.entry_bytes for p in plans for s in p.shards)
    big_served = max(p.served_buffer_bytes for p in plans)
    if sum(s.entry_bytes for p in plans for s in p.shards) + 2 * sum(p.served_buffer_bytes for p in plans) <= budget:
        served = 2 * sum(p.served_buffer_bytes for p in plans)
    else:
        served = min(max(int(config.served_fraction * budget), 2 * big_served), budget - 2 * big_entry)
    if budget - served < 2 * big_entry or served < 2 * big_served:
        raise OptimizerInputError(
            f"ram_budget {budget} bytes is too small: it needs at least {floor(plans)} bytes, twice the largest "
            f"shard record ({big_entry} bytes, at shards of {max(s.numel for p in plans for s in p.shards)} "
            f"elements) plus twice the largest served copy ({big_served} bytes: a unit's copy is one array, "
            "the one being built beside the one being pulled); raise ram_budget, or cut the model into "
            "smaller units")
    return budget - served, served
