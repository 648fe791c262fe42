"""A job's plan as data: sessions, per-switch programs, endpoint plans, the shard map, the why.

`JobPlan` is what the planner produces, what the controller persists (JSON in sqlite), what
the programmer writes to the switches and what JoinJob hands out. Switch programs also render
as p4lang/tutorials runtime JSON (`SwitchProgram.runtime_json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from luwu.dataplane.p4runtime.entries import MulticastGroupEntry, Replica, RuntimeConfig, TableEntry
from luwu.dataplane.session import EndpointPlan, SessionSpec, Wiring


@dataclass
class SwitchProgram:
    switch: str
    entries: list[TableEntry] = field(default_factory=list)
    groups: list[MulticastGroupEntry] = field(default_factory=list)

    def runtime_json(self, p4info: str = "", target: str = "bmv2", bmv2_json: str = "") -> dict:
        """p4lang/tutorials runtime JSON for this switch (matches by field name, aliases), checked
        against the P4Info (RuntimeConfigError says what does not fit)."""
        cfg = RuntimeConfig(target, p4info, bmv2_json, list(self.entries), list(self.groups))
        cfg.validate(p4info or None)
        return cfg.to_dict()


@dataclass
class SessionPlan:
    """A session across its tree: the same id, pool and epoch on every switch listed."""

    spec: SessionSpec
    group: int  # index of the worker group (0; rail k in rail-only)
    switches: list[str]  # the tree, root first
    root: str
    node: str = ""  # node sessions: the optimizer node's name
    fallback: bool = False  # pool exhausted: every GRAD falls back to the node (pool_size 0 on the switch)


@dataclass
class Shard:
    layer_id: int
    offset: int
    numel: int
    node: str
    node_rank: int
    session: int
    group: int


@dataclass
class Placement:
    rank: int
    group: int
    switch: str
    port: int


@dataclass
class NodeWiring:
    switch: str  # the switch this attachment of the node is plugged into (the root of its sessions)
    wiring: Wiring


@dataclass
class JobPlan:
    job_id: str
    num_workers: int
    lanes: int
    groups: list[list[int]]  # ranks of each worker group (one per rail; one for star/multi-rack)
    placements: list[Placement]
    sessions: list[SessionPlan]
    programs: dict[str, SwitchProgram]
    nodes: list[str]  # optimizer nodes serving the job; node_rank = index here
    shards: list[Shard]
    worker_wiring: dict[int, Wiring]  # rank -> wiring (local filled in at JoinJob)
    node_wiring: dict[str, list[NodeWiring]]  # node -> one wiring per attachment (rail-only: per rail)
    explanation: list[str] = field(default_factory=list)

    # -- what endpoints get ---------------------------------------------------------------------
    def group_of(self, rank: int) -> int:
        for g, ranks in enumerate(self.groups):
            if rank in ranks:
                return g
        raise KeyError(f"rank {rank} is not in job {self.job_id} (0..{self.num_workers - 1})")

    def worker_plan(self, rank: int) -> EndpointPlan:
        g = self.group_of(rank)
        return EndpointPlan(self.worker_wiring[rank], [s.spec for s in self.sessions if s.group == g])

    def node_plans(self, node: str) -> list[EndpointPlan]:
        """One EndpointPlan per attachment of the node (one engine per port it is wired to)."""
        return [EndpointPlan(nw.wiring, [s.spec for s in self.sessions if s.node == node and s.root == nw.switch])
                for nw in self.node_wiring.get(node, [])]

    def slot_ranges(self) -> dict[str, list[tuple[int, int, int]]]:
        """switch -> [(pool_base, pool_size, session)] for every non-fallback session."""
        out: dict[str, list[tuple[int, int, int]]] = {}
        for s in self.sessions:
            if s.fallback:
                continue
            for sw in s.switches:
                out.setdefault(sw, []).append((s.spec.pool_base, s.spec.pool_size, s.spec.session))
        return out

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> str:
        raw = asdict(self)
        raw["worker_wiring"] = {str(k): v for k, v in raw["worker_wiring"].items()}
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        raw = json.loads(text)
        sessions = [SessionPlan(SessionSpec(**s["spec"]), s["group"], s["switches"], s["root"], s["node"],
                                s["fallback"]) for s in raw["sessions"]]
        programs = {name: SwitchProgram(p["switch"], [TableEntry(**e) for e in p["entries"]],
                                        [MulticastGroupEntry(g["multicast_group_id"], [Replica(**r) for r in g["replicas"]])
                                         for g in p["groups"]])
                    for name, p in raw["programs"].items()}
        return cls(raw["job_id"], raw["num_workers"], raw["lanes"], raw["groups"],
                   [Placement(**p) for p in raw["placements"]], sessions, programs, raw["nodes"],
                   [Shard(**s) for s in raw["shards"]],
                   {int(k): _wiring(v) for k, v in raw["worker_wiring"].items()},
                   {k: [NodeWiring(w["switch"], _wiring(w["wiring"])) for w in v]
                    for k, v in raw["node_wiring"].items()},
                   raw.get("explanation", []))


def _wiring(raw: dict) -> Wiring:
    return Wiring(raw["rank"], raw["transport"], tuple(raw["local"]), tuple(raw["switch"]), raw.get("switch_port", 0))

