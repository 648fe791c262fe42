"""What a worker of a model-in-network job needs to know about the network: its engine's plan,
where the optimizer nodes take jobs, and which node serves which unit.

`JobNetwork` round-trips through JSON so a launcher can hand it to worker processes. It comes
from a `StarPlan` (loopback, no controller: `JobNetwork.from_star`) or from the controller
(`from_controller`: JoinJob's endpoint plan and the job's shard map, sliced layers included, with
the job's size and this rank's group: a job summed in several groups is rail-only, routes.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from luwu.controller.shards import ShardBalancer
from luwu.dataplane.session import EndpointPlan

if TYPE_CHECKING:  # for annotations only: the loopback switch's module is not needed to read a plan
    from luwu.dataplane.loopback import StarPlan

DEFAULT_JOB_ID = "mnn"


@dataclass(frozen=True)
class Slice:
    """[offset, offset + numel) of a layer on optimizer node `node` (its node session, when known)."""

    offset: int
    numel: int
    node: int
    session: int | None = None


@dataclass
class JobNetwork:
    endpoint: EndpointPlan  # this worker's engine plan (rank, wiring, sessions)
    node_controls: list[str] = field(default_factory=list)  # node index -> control address (rank 0 uses them)
    placement: dict[int, int] | None = None  # unit (layer id) -> node index; None: balanced by size
    job_id: str = DEFAULT_JOB_ID
    control_token: str = ""  # the job's token (or the local nodes' control token): the nodes' control channels need it
    slices: dict[int, list[Slice]] | None = None  # layer -> this rank's group's slices (the controller's shard map)
    world: int | None = None  # ranks of the job; None: the node sessions' workers (one group)
    group_ranks: list[int] | None = None  # the ranks this rank's sessions sum (its rail); None: all
    job_rank: int | None = None  # this rank in the job; None: the endpoint's (a controller's plan numbers
    # its switches' ranks as the job does; a loopback rail of its own, one star per rail, from 0 per rail)

    @property
    def rank(self) -> int:
        return self.endpoint.wiring.rank if self.job_rank is None else self.job_rank

    @property
    def node_sessions(self) -> dict[int, int]:
        """node index -> the node session's id, from the plan's node sessions."""
        nodes = [s for s in self.endpoint.sessions if s.kind == "node"]
        if not nodes:
            raise ValueError("the worker's plan has no node session: the job was planned without optimizer nodes "
                             "(ask for num_nodes >= 1)")
        out: dict[int, int] = {}
        for s in nodes:
            if s.node_rank is None:
                raise ValueError("a node session of the plan has no node_rank; cannot tell which node serves it")
            out[s.node_rank] = s.session
        return out

    def describe_node(self, session: int) -> str:
        """The optimizer node serving node session `session`, for error messages: its index, its
        control channel's address and the job (the engine alone knows only the session)."""
        index = next((s.node_rank for s in self.endpoint.sessions if s.session == session), None)
        if index is None:
            return f"of session {session}"
        control = self.node_controls[index] if 0 <= index < len(self.node_controls) else "unknown"
        return f"#{index} (control channel {control}, job {self.job_id}, session {session})"

    @property
    def world_size(self) -> int:
        if self.world is not None:
            return self.world
        sizes = {s.num_workers for s in self.endpoint.sessions if s.kind == "node"}
        return sizes.pop() if len(sizes) == 1 else max(sizes or {1})

    @property
    def local_size(self) -> int:
        """Groups the job's ranks sum in: 1 on a flat plan; on rail-only the rails, i.e. the ranks
        per server (each server's ranks then reduce-scatter and all-gather over NVLink)."""
        if self.group_ranks is None or not self.group_ranks:
            return 1
        groups, rest = divmod(self.world_size, len(self.group_ranks))
        if rest:
            raise ValueError(f"rank {self.rank}'s group has {len(self.group_ranks)} of the job's {self.world_size} "
                             "ranks: groups of unequal size cannot be one rail per server")
        return groups

    # -- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        placement = None if self.placement is None else {str(k): v for k, v in self.placement.items()}
        slices = None if self.slices is None else {str(k): [vars(s) for s in v] for k, v in self.slices.items()}
        return json.dumps({"endpoint": json.loads(self.endpoint.to_json()), "node_controls": self.node_controls,
                           "placement": placement, "job_id": self.job_id, "control_token": self.control_token,
                           "slices": slices, "world": self.world, "group_ranks": self.group_ranks,
                           "job_rank": self.job_rank})

    @classmethod
    def from_json(cls, text: str) -> JobNetwork:
        raw = json.loads(text)
        placement, slices = raw.get("placement"), raw.get("slices")
        return cls(EndpointPlan.from_json(json.dumps(raw["endpoint"])), list(raw.get("node_controls", [])),
                   None if placement is None else {int(k): int(v) for k, v in placement.items()},
                   raw.get("job_id", DEFAULT_JOB_ID), raw.get("control_token", ""),
                   None if slices is None else {int(k): [Slice(**s) for s in v] for k, v in slices.items()},
                   raw.get("world"), raw.get("group_ranks"), raw.get("job_rank"))

    # -- sources ----------------------------------------------------------------------------------
    @classmethod
    def from_star(cls, plan: StarPlan, rank: int, node_controls: list[str], job_id: str = DEFAULT_JOB_ID,
                  placement: dict[int, int] | None = None, control_token: str = "") -> JobNetwork:
        """From a loopback `StarPlan` whose switch is running (its ports are bound)."""
        return cls(plan.worker_plan(rank), list(node_controls), placement, job_id, control_token)

    @classmethod
    def from_controller(cls, endpoint: EndpointPlan, job_info: dict[str, Any], node_controls: list[str],
                        job_id: str | None = None, job_token: str = "") -> JobNetwork:
        """From JoinJob's answer: the endpoint plan and the job JSON with its shard map (this rank's
        group's shards: `layer_id`, `offset`, `numel`, `node_rank`, `session`), `num_workers` and
        `group_ranks`. Layers the controller cut into slices are pushed and pulled per slice
        (routes.py checks at join that the slices can be honoured)."""
        group = job_info.get("group")
        slices: dict[int, list[Slice]] = {}
        for shard in job_info.get("shards", []):
            if group is not None and shard.get("group", group) != group:
                continue  # another rail's: that rail's ranks push it
            session = shard.get("session")
            slices.setdefault(int(shard["layer_id"]), []).append(
                Slice(int(shard.get("offset", 0)), int(shard["numel"]), int(shard["node_rank"]),
                      None if session is None else int(session)))
        world = job_info.get("num_workers")
        ranks = job_info.get("group_ranks")
        return cls(endpoint, list(node_controls), None, job_id or job_info.get("job_id", DEFAULT_JOB_ID), job_token,
                   slices or None, None if world is None else int(world),
                   None if ranks is None else [int(r) for r in ranks])


def balance(sizes: dict[int, int], nodes: list[int]) -> dict[int, int]:
    """Whole units to nodes with the controller's placer (luwu.controller.shards, LPT: largest
    first to the node that finishes first; equal capacities, no slicing here): deterministic, so
    every rank computes the same map. Units of no elements go to the first node."""
    if not nodes:
        raise ValueError("no optimizer node to place units on")
    whole = ShardBalancer(min_slice=max(sizes.values(), default=1))  # a slice limit no unit exceeds
    pieces = whole.assign(sorted(sizes.items()), [1.0] * len(nodes))
    out = dict.fromkeys(sizes, nodes[0])
    out.update({p.layer_id: nodes[p.node_index] for p in pieces})
    return out
