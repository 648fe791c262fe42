"""Chooses where a job runs: its worker groups, each group's aggregation tree, ranks on ports, nodes.

star: one switch holds the workers and the nodes. multi_rack: top-of-rack switches hold the
workers and partially aggregate; the cluster switch above them is the root and reaches the
nodes (a job with no node that fits on one ToR is rooted at that ToR). rail_only: rank
r = server * K + k sits on rail k (GPU k of server `server`); every rail is its own tree
with its own sessions, rooted at the rail switch, served by the nodes attached to that rail.
Every choice is a sort on names and numbers, so equal inputs give equal placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from luwu.dataplane.protocol import MAX_CONTRIBUTORS

from .job_spec import JobSpec
from .topology import Topology
from .usage import SwitchUsage


class PlacementError(ValueError):
    """The job does not fit; the message says what is missing."""


@dataclass
class Group:
    index: int
    root: str
    ranks: list[int] = field(default_factory=list)
    place: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (switch, port)
    parent: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # child -> (parent, child port, parent port)
    nodes: list[tuple[str, int]] = field(default_factory=list)  # (node, its port on the root)

    @property
    def switches(self) -> list[str]:
        """The tree, root first, then the others by name."""
        return [self.root] + sorted(set(self.parent))

    def children(self, switch: str) -> list[tuple[str, int, int]]:
        """(child, child's up port, this switch's port to it) by child name."""
        return sorted((c, cp, pp) for c, (p, cp, pp) in self.parent.items() if p == switch)

    def local_ranks(self, switch: str) -> list[tuple[int, int]]:
        return sorted((r, port) for r, (sw, port) in self.place.items() if sw == switch)


class Placer:
    def __init__(self, topo: Topology, usage: SwitchUsage, eligible_nodes: set[str],
                 node_order: dict[str, tuple] | None = None):
        self.topo = topo
        self.usage = usage
        self.eligible = eligible_nodes
        self.node_order = node_order or {}  # node -> sort key (load, -capacity, name); name by default

    def layout(self, spec: JobSpec) -> str:
        if spec.layout != "auto":
            return spec.layout
        roles = {s.role for s in self.topo.switches.values() if s.lanes == spec.lanes}
        if "rail" in roles:
            return "rail_only"
        if roles & {"tor", "cluster"}:
            return "multi_rack"
        return "star"

    def place(self, spec: JobSpec) -> tuple[str, list[Group]]:
        matching = sorted(n for n, s in self.topo.switches.items() if s.lanes == spec.lanes)
        if not matching:
            have = sorted({s.lanes for s in self.topo.switches.values()})
            raise PlacementError(f"no registered switch runs packet mode {spec.packet_mode!r} ({spec.lanes} lanes); "
                                 f"registered lane counts: {have or 'none (register a switch first)'}")
        layout = self.layout(spec)
        if layout == "rail_only":
            return layout, self._rails(spec)
        return layout, [self._tree(spec, layout)]

    # -- helpers ------------------------------------------------------------------------------
    def _free_ports(self, switch: str, spec: JobSpec) -> list[int]:
        if spec.switches and switch not in spec.switches:
            return []
        ports = [p for p in self.topo.worker_ports(switch) if self.usage.port_owner(switch, p) is None]
        cap = min(MAX_CONTRIBUTORS, spec.workers_per_switch or MAX_CONTRIBUTORS)
        return ports[:cap]

    def _nodes_on(self, switch: str) -> list[tuple[str, int]]:
        found = [(name, port) for port, name in self.topo.node_ports(switch) if name in self.eligible]
        return sorted(found, key=lambda np_: (self.node_order.get(np_[0], ()), np_[0], np_[1]))

    def _roots(self, role: str, spec: JobSpec) -> list[str]:
        return sorted(n for n, s in self.topo.switches.items() if s.role == role and s.lanes == spec.lanes)

    # -- star and multi-rack --------------------------------------------------------------------
    def _tree(self, spec: JobSpec, layout: str) -> Group:
        role = "star" if layout == "star" else "cluster"
        roots = self._roots(role, spec)
        if not roots:
            raise PlacementError(f"layout {layout}: no {role} switch with {spec.lanes} lanes is registered")
        reasons = []
        for root in roots:
            nodes = self._nodes_on(root)
            if len(nodes) < spec.num_nodes:
                reasons.append(f"{root}: {len(nodes)} usable optimizer node(s) attached, the job asks for "
                               f"{spec.num_nodes}")
                continue
            group = Group(0, root, nodes=nodes[:spec.num_nodes])
            leaves = [root] if role == "star" else [c for _, c, _ in self.topo.switch_neighbours(root)
                                                     if self.topo.switches[c].role == "tor"
                                                     and self.topo.switches[c].lanes == spec.lanes]
            free = {leaf: self._free_ports(leaf, spec) for leaf in sorted(leaves)}
            if sum(len(v) for v in free.values()) < spec.num_workers:
                reasons.append(f"{root}: {sum(len(v) for v in free.values())} free worker port(s) below it, the "
                               f"job needs {spec.num_workers}")
                continue
            rank = 0
            for leaf, ports in free.items():
                for port in ports:
                    if rank == spec.num_workers:
                        break
                    group.place[rank] = (leaf, port)
                    rank += 1
            group.ranks = list(range(spec.num_workers))
            used = sorted({sw for sw, _ in group.place.values()})
            if role == "cluster":
                if len(used) == 1 and spec.num_nodes == 0:
                    group.root = used[0]  # the lowest common ancestor: no need to climb
                else:
                    if len(used) > MAX_CONTRIBUTORS:
                        reasons.append(f"{root}: {len(used)} racks exceed {MAX_CONTRIBUTORS} contributors")
                        continue
                    for up_port, child, child_port in self.topo.switch_neighbours(root):
                        if child in used:
                            group.parent[child] = (root, child_port, up_port)
            return group
        raise PlacementError(f"job {spec.name!r} ({spec.num_workers} workers, {spec.num_nodes} nodes) does not fit: "
                             + "; ".join(reasons))

    # -- rail-only ------------------------------------------------------------------------------
    def _rails(self, spec: JobSpec) -> list[Group]:
        rails = sorted(self._roots("rail", spec), key=lambda n: (self.topo.switches[n].rail, n))
        if spec.switches:
            rails = [r for r in rails if r in spec.switches]
        if not rails:
            raise PlacementError("layout rail_only: no rail switch with the job's lane count is registered")
        k = len(rails)
        if spec.num_workers % k:
            raise PlacementError(f"rail_only: {spec.num_workers} workers do not split over {k} rails "
                                 f"(rank = server * {k} + rail): use a multiple of {k}")
        servers = spec.num_workers // k
        groups = []
        for g, rail in enumerate(rails):
            ports = [p for p in self.topo.worker_ports(rail) if self.usage.port_owner(rail, p) is None]
            if len(ports) < servers:
                raise PlacementError(f"rail {rail}: {len(ports)} free port(s), the job needs {servers} "
                                     "(one per server)")
            if servers > MAX_CONTRIBUTORS:
                raise PlacementError(f"rail {rail}: {servers} servers exceed {MAX_CONTRIBUTORS} contributors per "
                                     "switch")
            nodes = self._nodes_on(rail)
            if spec.num_nodes and not nodes:
                raise PlacementError(f"rail {rail}: no usable optimizer node is attached; every rail needs one "
                                     "(a port per rail, or a node per rail)")
            group = Group(g, rail, nodes=nodes[:spec.num_nodes])
            for s in range(servers):
                rank = s * k + g
                group.ranks.append(rank)
                group.place[rank] = (rail, ports[s])
            groups.append(group)
        return groups
