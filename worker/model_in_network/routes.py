"""Which optimizer node (and node session) each part of each unit goes to, for this rank.

A unit is one layer id on the optimizer nodes. The controller's shard map may cut a layer into
slices (offset, length) for several nodes, and on a rail-only plan (the job's ranks in G groups,
one per rail, G = ranks per server) each rail's node owns one rail shard of every layer: rank k
of a server reduce-scatters the unit's gradient over the server's NVLink, keeps shard k
(`luwu.worker.rails.shard_bounds`, the planner's own cut) and pushes and pulls only that, through
its rail (rails.py in this folder). A `Route` is this rank's part of one unit: its shard [lo, hi)
(the whole unit on a flat plan) and the pieces that tile it, one per slice, each with its node.

`plan_routes` checks what the worker can honour and raises `PlanError` saying why otherwise (at
join, before anything is pushed): slices that do not tile this rank's shard exactly, a slice on a
node this rank has no session with, two slices of one layer on one node (both would be layer L
there), ranks not numbered server by server. Nothing is ever summed partially.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from luwu.dataplane.optimizer.spec import LayerSpec
from luwu.worker.rails import shard_bounds

from .network import JobNetwork, balance
from .units import Unit


class PlanError(ValueError):
    """The job's plan asks for something this worker cannot do; the message says what and why."""


@dataclass(frozen=True)
class Piece:
    offset: int  # in the unit's flat buffer
    numel: int
    node: int  # optimizer node index
    session: int  # its node session in this rank's plan


@dataclass
class Route:
    unit: int
    numel: int  # the unit's elements
    lo: int  # this rank's shard of the unit: [lo, hi) (the whole unit on a flat plan)
    hi: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        """One piece that is the whole unit: the node's layer is the unit itself."""
        return len(self.pieces) == 1 and self.pieces[0].offset == 0 and self.pieces[0].numel == self.numel


def plan_routes(units: list[Unit], network: JobNetwork) -> dict[int, Route]:
    """unit index -> this rank's Route (module docstring); PlanError when the plan cannot be honoured."""
    k_all, rank = network.local_size, network.rank
    sessions = network.node_sessions
    if k_all > 1:
        _check_rail_order(network)
    out: dict[int, Route] = {}
    placement = None
    if network.slices is None:
        if k_all > 1:
            raise PlanError(f"the job's ranks sum in {k_all} groups (rails) but the network description has no shard "
                            "map: a rail-only job needs the controller's slices (JobNetwork.from_controller)")
        placement = network.placement or balance({u.index: u.numel for u in units}, sorted(sessions))
    for u in units:
        lo, hi = shard_bounds(u.numel, k_all)[rank % k_all] if k_all > 1 else (0, u.numel)
        if placement is not None:
            if u.index not in placement:
                raise PlanError(f"the network's placement names no optimizer node for unit {u.label()}")
            node = placement[u.index]
            if node not in sessions:
                raise PlanError(f"unit {u.label()} is placed on optimizer node {node}, with which this rank's plan has "
                                f"no node session (sessions for nodes {sorted(sessions)})")
            out[u.index] = Route(u.index, u.numel, 0, u.numel, [Piece(0, u.numel, node, sessions[node])])
            continue
        assert network.slices is not None
        out[u.index] = _sliced(u, lo, hi, network.slices.get(u.index, []), sessions, rank, k_all)
    extra = sorted(set(network.slices or {}) - {u.index for u in units})
    if extra:
        raise PlanError(f"the job's shard map has layers {extra[:8]} that are no unit of this model ({len(units)} "
                        "units): the job was planned for another model or cut")
    return out


def _sliced(u: Unit, lo: int, hi: int, slices: list, sessions: dict[int, int], rank: int, k_all: int) -> Route:
    where = f"rank {rank}'s shard [{lo}, {hi}) of unit {u.label()} (layer {u.index}, {u.numel} elements" + (
        f", rail {rank % k_all} of {k_all})" if k_all > 1 else ")")
    pieces, at, nodes = [], lo, set()
    for s in sorted(slices, key=lambda s: s.offset):
        if s.offset != at or s.numel <= 0:
            got = [(x.offset, x.offset + x.numel) for x in sorted(slices, key=lambda s: s.offset)]
            raise PlanError(f"the controller's slices of layer {u.index} for this rank are {got}: they do not tile "
                            f"{where} exactly (a gap or overlap would leave elements unsummed or summed twice)")
        if s.node not in sessions or (s.session is not None and s.session != sessions[s.node]):
            raise PlanError(f"a slice of layer {u.index} is on optimizer node {s.node} (session {s.session}), which "
                            f"this rank's plan does not reach (its node sessions: {sessions}); every slice of {where} "
                            "must be on a node of this rank's group")
        if s.node in nodes:
            raise PlanError(f"the controller put two slices of layer {u.index} on optimizer node {s.node}: a node "
                            "serves one buffer per layer id, so ModelInNetwork cannot push both; replan with min_shard "
                            "at least the layer's size or more nodes")
        nodes.add(s.node)
        pieces.append(Piece(s.offset, s.numel, s.node, sessions[s.node]))
        at += s.numel
    if at != hi:
        got = [(x.offset, x.offset + x.numel) for x in sorted(slices, key=lambda s: s.offset)]
        raise PlanError(f"the controller's slices of layer {u.index} for this rank are {got}: they do not cover "
                        f"{where}; the job was planned for other layer sizes, or ranks per server"
                        if got else f"the job's shard map has no slice of layer {u.index} for {where}")
    return Route(u.index, u.numel, lo, hi, pieces)


def _check_rail_order(network: JobNetwork) -> None:
    """Rank r's group must be the ranks r % K, r % K + K, ... (servers numbered in order)."""
    k_all, rank, world = network.local_size, network.rank, network.world_size
    want = list(range(rank % k_all, world, k_all))
    if network.group_ranks is not None and sorted(network.group_ranks) != want:
        raise PlanError(f"rank {rank} sums with ranks {sorted(network.group_ranks)} on its rail, but a rail-only job "
                        f"needs ranks numbered server by server ({k_all} per server: rail {rank % k_all} holds ranks "
                        f"{want}); fix the launcher's rank order")


def piece_spec(u: Unit, piece: Piece, whole: bool) -> tuple[LayerSpec, dict[str, tuple[int, int]]]:
    """The node's LayerSpec for one piece of unit `u`, and each of its tensors' [lo, hi) in the
    unit's flat buffer. A whole unit keeps its parameters' names and shapes; a slice names the
    parts of the parameters it holds `name[a:b]` (flat, weight decay as their parameter's)."""
    if whole:
        return u.layer_spec(), {name: span for (name, _), span in zip(u.params, u.offsets)}
    full = u.layer_spec()
    shapes, spans, no_decay = {}, {}, set()
    end = piece.offset + piece.numel
    for (name, _), (plo, phi) in zip(u.params, u.offsets):
        a, b = max(plo, piece.offset), min(phi, end)
        if a >= b:
            continue
        key = f"{name}[{a - plo}:{b - plo}]"
        shapes[key], spans[key] = (b - a,), (a, b)
        if name in full.no_decay:
            no_decay.add(key)
    return LayerSpec(u.index, shapes, frozenset(no_decay)), spans


def piece_initial(flat_values: np.ndarray, spans: dict[str, tuple[int, int]],
                  shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """A piece's initial values from the unit's flat fp32 values."""
    return {name: flat_values[a:b].reshape(shapes[name]) for name, (a, b) in spans.items()}
