"""Turns a job into a plan: sessions with ids, epochs and slot pools, switch entries, endpoint wiring, shards.

Per worker group (one tree; one per rail in rail-only) a job gets a `collective` pair (purpose
`meta`, small pool, and `data`) and one `node` session per optimizer node serving the group.
A session's id and pool are the same on every switch of its tree and free on all of them;
epochs come from the controller's persisted counter and are never reused. On each switch a
session has a `sessions` entry (num_workers = local contributors: the ranks on its ports plus
one per child switch), `workers` entries (bit = local index), `endpoints` entries (rank or a
child's up_worker -> address; 0xFFFF -> the node at the root, the parent elsewhere) and a
multicast group (id = session id) with one replica per contributor (docs/protocol.md 6.1).
A non-root switch contributes to its parent as worker `up_worker` = N + its index among the
tree's non-root switches (sorted by name): above every rank, below 0xFFFF, unique in the job.
`predict_iteration` gives a planned job's iteration time and bottleneck (`luwu-ctl plan --explain`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from luwu.dataplane.p4runtime.entries import (
    TableEntry,
    child_port_entry,
    endpoint_entry,
    multicast_group,
    session_entry,
    worker_entry,
)
from luwu.dataplane.protocol import DEFAULT_UDP_PORT, DTYPE_ITEMSIZE, HEADER_LEN, NODE, Dtype, NextStep
from luwu.dataplane.session import SHM_SCHEME, SessionSpec, Wiring, parse_port_address

from .config import ControllerConfig
from .job_spec import JobSpec
from .placer import Group, PlacementError, Placer
from .plan import JobPlan, NodeWiring, Placement, SessionPlan, Shard, SwitchProgram
from .shards import ShardBalancer, split_even
from .topology import Topology
from .usage import SwitchUsage


class PlanError(ValueError):
    """The job cannot be planned; the message says why and what to change."""


class Planner:
    def __init__(self, config: ControllerConfig | None = None):
        self.config = config or ControllerConfig()

    def plan(self, job_id: str, spec: JobSpec, topo: Topology, usage: SwitchUsage, next_epoch: Callable[[], int],
             capacities: dict[str, float] | None = None, eligible_nodes: set[str] | None = None,
             node_load: dict[str, int] | None = None, node_addresses: dict[str, str] | None = None) -> JobPlan:
        """Plan `spec` on `topo` around what `usage` says is taken (it is updated in place)."""
        spec.validate()
        capacities = capacities or {}
        eligible = set(eligible_nodes if eligible_nodes is not None else
                       (h.name for h in topo.hosts.values() if h.kind == "node"))
        load = node_load or {}
        order = {n: (load.get(n, 0), -capacities.get(n, 0.0)) for n in eligible}
        try:
            layout, groups = Placer(topo, usage, eligible, order).place(spec)
        except PlacementError as exc:
            raise PlanError(str(exc)) from exc
        self._topo, self._usage, self._spec, self._epoch = topo, usage, spec, next_epoch
        self._addresses = node_addresses or {}
        # ids unique across the whole job (not only per tree): a node serving several rails
        # then never sees two of the job's sessions under one id
        self._job_switches = sorted({sw for g in groups for sw in g.switches})
        nodes = []
        for g in groups:
            nodes += [n for n, _ in g.nodes if n not in nodes]
        why = [f"layout {layout}: {len(groups)} worker group(s), {spec.num_workers} workers, packet mode "
               f"{spec.packet_mode} ({spec.lanes} lanes)"]
        plan = JobPlan(job_id, spec.num_workers, spec.lanes, [g.ranks for g in groups], [], [], {}, nodes, [], {}, {},
                       why)
        for g in groups:
            self._plan_group(plan, g, nodes)
        self._shards(plan, groups, capacities)
        for p in plan.placements:
            usage.take_port(p.switch, p.port, job_id)
        return plan

    # -- one tree -----------------------------------------------------------------------------
    def _plan_group(self, plan: JobPlan, g: Group, nodes: list[str]) -> None:
        spec, cfg = self._spec, self.config
        tree = g.switches
        up_worker = {sw: spec.num_workers + i for i, sw in enumerate(sorted(g.parent))}
        plan.explanation.append(
            f"group {g.index}: root {g.root}, tree {' '.join(tree)}; "
            + ", ".join(f"{sw}: {len(g.local_ranks(sw))} rank(s) + {len(g.children(sw))} child switch(es)"
                        for sw in tree))
        for rank in g.ranks:
            sw, port = g.place[rank]
            plan.placements.append(Placement(rank, g.index, sw, port))
            plan.worker_wiring[rank] = self._wiring(rank, sw, port, ("127.0.0.1", 0))
        wanted = [("collective", "meta", spec.meta_pool or cfg.meta_pool, ""),
                  ("collective", "data", spec.data_pool or cfg.data_pool, "")]
        wanted += [("node", "data", spec.node_pool or cfg.node_pool, node) for node, _ in g.nodes]
        for kind, purpose, size, node in wanted:
            s = self._session(plan, g, tree, kind, purpose, size, node, nodes)
            plan.sessions.append(s)
            for sw in tree:
                self._program(plan, g, s, sw, up_worker)
        for node, port in g.nodes:
            addr = self._node_udp(node, ("127.0.0.1", 0))
            plan.node_wiring.setdefault(node, []).append(NodeWiring(g.root, self._wiring(NODE, g.root, port, addr)))

    def _session(self, plan: JobPlan, g: Group, tree: list[str], kind: str, purpose: str, size: int, node: str,
                 nodes: list[str]) -> SessionPlan:
        cfg, usage = self.config, self._usage
        sid = usage.free_session_id(self._job_switches)
        cap = 1 << (min(usage.slots[s] for s in tree).bit_length() - 1)
        want = min(size, cap)
        base, got = None, want
        while got >= cfg.min_pool and base is None:
            base = usage.free_pool(tree, got)
            if base is None:
                got //= 2
        fallback = base is None
        label = f"{kind}/{purpose}" + (f" -> {node}" if node else "")
        if base is None:  # == fallback; tested on `base` so that mypy narrows it to int below
            free = ", ".join(f"{s}: {usage.free_slots(s)} free" for s in tree)
            if kind != "node" or not cfg.allow_fallback:
                raise PlanError(f"no {cfg.min_pool}+ slot pool is free on every switch of the tree for the {label} "
                                f"session ({free}): end a job, or lower --min-pool / the job's pool sizes")
            base, got = 0, want
            plan.explanation.append(f"session {sid} {label}: switches full ({free}); pool size 0 on the switch, "
                                    "every GRAD falls back to the node (ATP-style)")
        else:
            note = f" (asked {size}, shrunk: switch full)" if got < want else ""
            note += f" (capped at {cap} slots per set)" if want < size else ""
            plan.explanation.append(f"session {sid} {label}: slots [{base}, {base + got}) on {', '.join(tree)}{note}")
        epoch = self._epoch()
        spec = SessionSpec(sid, kind, epoch, base, got, len(g.ranks), plan.lanes,
                           param_window=cfg.param_window, node_rank=nodes.index(node) if node else None,
                           purpose=purpose)
        spec.validate()
        usage.take_session(tree, sid, base, got, plan.job_id, fallback=fallback)
        return SessionPlan(spec, g.index, tree, g.root, node, fallback)

    def _program(self, plan: JobPlan, g: Group, s: SessionPlan, sw: str, up_worker: dict[str, int]) -> None:
        prog = plan.programs.setdefault(sw, SwitchProgram(sw))
        sid = s.spec.session
        contributors = [(rank, port, self._rank_address(sw, port)) for rank, port in g.local_ranks(sw)]
        contributors += [(up_worker[child], pport, self._switch_address(child, pport, sw))
                         for child, _, pport in g.children(sw)]
        mask = (1 << len(contributors)) - 1
        if sw == g.root:
            node_port = dict(g.nodes).get(s.node, 0)
            step, up_port, upw = NextStep.ROOT, node_port, 0
            up_addr = self._node_address(s.node, sw, node_port) if s.node else None
        else:
            parent, child_port, _parent_port = g.parent[sw]
            step, up_port, upw = NextStep.UPSTREAM, child_port, up_worker[sw]
            up_addr = self._switch_address(parent, child_port, sw)
        prog.entries.append(session_entry(
            sid, pool_base=s.spec.pool_base, pool_size=0 if s.fallback else s.spec.pool_size,
            num_workers=len(contributors), worker_mask=mask, epoch=s.spec.epoch, mcast_grp=sid,
            next_step=int(step), up_port=up_port, up_worker=upw))
        for bit, (wid, port, addr) in enumerate(contributors):
            prog.entries.append(worker_entry(sid, wid, worker_bit=1 << bit, port=port))
            prog.entries.append(_endpoint(sid, wid, addr))
        if up_addr is not None:
            prog.entries.append(_endpoint(sid, NODE, up_addr))
        for _child, _, pport in g.children(sw):  # GRADs passing up from below enter on these ports only
            prog.entries.append(child_port_entry(sid, pport))
        prog.groups.append(multicast_group(sid, [(port, wid) for wid, port, _ in contributors]))

    # -- addresses ------------------------------------------------------------------------------
    def _udp_port(self, sw: str) -> int:
        return self._topo.switches[sw].udp_port or DEFAULT_UDP_PORT

    def _rank_address(self, sw: str, port: int) -> tuple[int, int, int]:
        host = self._topo.worker_host(sw, port)
        mac = self._topo.switches[sw].port_mac.get(port) or (host.mac if host else "")
        return _mac(mac), ip_to_int(host.ip if host else ""), self._udp_port(sw)

    def _switch_address(self, other: str, port: int, sw: str) -> tuple[int, int, int]:
        """Where `sw` sends to reach switch `other` through its `port`: the other's service address."""
        mac = _mac(self._topo.switches[sw].port_mac.get(port, ""))
        return mac, ip_to_int(self._topo.switches[other].service_address), self._udp_port(other)

    def _node_address(self, node: str, sw: str, port: int) -> tuple[int, int, int]:
        host = self._topo.hosts.get(node)
        mac = self._topo.switches[sw].port_mac.get(port) or (host.mac if host else "")
        ip, udp = self._node_udp(node, (host.ip if host else "", self._udp_port(sw)))
        return _mac(mac), ip_to_int(ip), udp

    def _node_udp(self, node: str, default: tuple[str, int]) -> tuple[str, int]:
        """The node's registered UDP address; `default` without one or for a node on a shared-memory
        port (no socket: the ring is its identity, and the switch consults no endpoint address there)."""
        text = self._addresses.get(node, "")
        if text.startswith(SHM_SCHEME):
            return default
        return _split(text, default)

    def _wiring(self, rank: int, sw: str, port: int, local: tuple[str, int]) -> Wiring:
        spec = self._topo.switches[sw]
        if spec.port_udp.get(port):  # a software switch's UDP or shared-memory port (its registered address)
            try:
                transport, switch = parse_port_address(spec.port_udp[port], f"switch {sw} port {port}")
            except ValueError as exc:
                raise PlanError(str(exc)) from None
            return Wiring(rank, transport, local, switch, port)
        return Wiring(rank, "ip", local, (spec.service_address or "0.0.0.0", self._udp_port(sw)), port)

    # -- shards ---------------------------------------------------------------------------------
    def _shards(self, plan: JobPlan, groups: list[Group], capacities: dict[str, float]) -> None:
        spec = self._spec
        if not plan.nodes:
            if spec.layers:
                plan.explanation.append("no optimizer node: layers are not sharded (allreduce-only job)")
            return
        balancer = ShardBalancer(self.config.min_shard)
        session_of = {(s.group, s.node): s.spec.session for s in plan.sessions if s.node}
        for g in groups:
            names = [n for n, _ in g.nodes]
            layers, bases = [], {}
            for lid, numel in spec.layers:
                off, part = split_even(numel, len(groups))[g.index]
                if part:
                    layers.append((lid, part))
                    bases[lid] = off
            pieces = balancer.assign(layers, [capacities.get(n, 0.0) for n in names])
            for p in pieces:
                node = names[p.node_index]
                plan.shards.append(Shard(p.layer_id, bases[p.layer_id] + p.offset, p.numel, node,
                                         plan.nodes.index(node), session_of[(g.index, node)], g.index))
            total = sum(n for _, n in layers) or 1
            for i, node in enumerate(names):
                mine = sum(p.numel for p in pieces if p.node_index == i)
                cap = capacities.get(node, 0.0)
                eta = f", {mine / cap:.3g} s per step at {cap:.3g} params/s" if cap > 0 else ""
                plan.explanation.append(f"group {g.index} node {node}: {mine} params ({100 * mine / total:.1f}%) in "
                                        f"{sum(1 for p in pieces if p.node_index == i)} shard(s){eta}")
        plan.shards.sort(key=lambda s: (s.layer_id, s.offset))


def _endpoint(sid: int, dst: int, addr: tuple[int, int, int]) -> TableEntry:
    mac, ip, udp = addr
    return endpoint_entry(sid, dst, dst_mac=mac, dst_ip=ip, dst_udp=udp)


def _mac(text: str) -> int:
    return int(text.replace(":", "").replace("-", ""), 16) if text else 0


def ip_to_int(text: str) -> int:
    try:
        return int(ipaddress.IPv4Address(text))
    except (ipaddress.AddressValueError, ValueError):
        return 0  # a host name or nothing: the switch port decides (UDP attachment)


def _split(address: str, default: tuple[str, int]) -> tuple[str, int]:
    """"HOST:PORT" -> (host, port); `default` when empty."""
    if not address:
        return default
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise PlanError(f"address {address!r} must look like HOST:PORT")
    return host, int(port)


# -- predicted iteration time (`luwu-ctl plan JOB --explain`) ----------------------------------------
# The closed form of what docs/simulator.md simulates event by event: per layer, forward streams the
# pull beside the GPU's forward; backward streams the pull, the GPU's backward, the push and the
# node's step; each pass takes, per layer, its slowest. `luwu simulate` checks it against its timeline.

FRAME_OVERHEAD = 14 + 20 + 8 + 24  # Ethernet/IPv4/UDP headers, then preamble, FCS and inter-frame gap


def wire_efficiency(payload: int, frame_overhead: int = FRAME_OVERHEAD) -> float:
    """Payload bytes per byte on the wire for luwu packets of `payload` bytes (luwu header + framing)."""
    return payload / (payload + HEADER_LEN + frame_overhead)


@dataclass(frozen=True)
class LayerLoad:
    """One layer's work in one iteration, in seconds of each resource it uses."""

    pull: float  # a worker's link in, per pull (forward and backward each pull once)
    push: float  # a worker's link out (the gradient)
    step: float  # the slowest optimizer node's step of its shards of the layer
    node_out: float  # the busiest node's link out (its shards' parameters, once per pass)
    node_in: float  # the busiest node's link in (its shards' summed gradient)
    fwd: float = 0.0  # GPU forward
    bwd: float = 0.0  # GPU backward (recompute included)


def iteration_bound(layers: list[LayerLoad]) -> tuple[float, dict[str, float]]:
    """Seconds of one steady-state iteration of layers streamed in order (forward) and in reverse
    (backward): per layer the slowest of its resources in each pass, plus the last layer's step
    (the next forward waits for it). Returns (seconds, busy seconds per resource)."""
    fwd = sum(max(x.pull, x.fwd, x.node_out) for x in layers)
    bwd = sum(max(x.pull, x.bwd, x.push, x.step, x.node_out, x.node_in) for x in layers)
    tail = layers[0].step if layers else 0.0  # the first layer is stepped last
    busy = {"worker link in": sum(2 * x.pull for x in layers), "worker link out": sum(x.push for x in layers),
            "worker GPU": sum(x.fwd + x.bwd for x in layers), "optimizer node": sum(x.step for x in layers),
            "optimizer node link out": sum(2 * x.node_out for x in layers),
            "optimizer node link in": sum(x.node_in for x in layers)}
    return fwd + bwd + tail, busy


def predict_iteration(plan: JobPlan, capacities: dict[str, float], link_bytes_per_s: float,
                      param_bytes: int = 2, compute_s: float = 0.0) -> dict:
    """Predict one training iteration of a planned model-in-network job.

    Each worker pulls every layer twice (forward and backward) and pushes its gradient once,
    over its own link (a worker group, e.g. a rail, carries its share of each layer); the switch
    sums the gradients, so each optimizer node receives one gradient stream and sends one
    parameter stream for the shards it holds, and steps them at its registered params/s.

    Args:
        plan: the job's plan (its shards, worker groups, lanes per packet).
        capacities: params/s of each optimizer node (`luwu-ctl nodes`); a node missing or at 0
            is left out of the step time (and named in `unknown_nodes`).
        link_bytes_per_s: each worker's and node's link, each direction, in bytes/s.
        param_bytes: bytes per parameter the workers pull (2 for bf16/fp16, 4 for fp32).
        compute_s: the worker GPU's forward + backward seconds per iteration (0: not known),
            spread over layers by parameters, a quarter forward and three quarters backward
            (backward is twice the forward plus the recompute of activation checkpointing).

    Returns:
        A dict: `iteration_s`, `bottleneck` (the busiest resource), `busy_s` (seconds per resource),
        `layers`, `link_gbps`, `wire_efficiency`, `unknown_nodes`.

    Examples::

        >>> p = predict_iteration(plan, {"n0": 5e9}, 100e9 / 8, compute_s=0.5)
        >>> p["iteration_s"] > 0
        True
    """
    rate = link_bytes_per_s * wire_efficiency(4 * plan.lanes)
    grad_bytes = DTYPE_ITEMSIZE[Dtype.FIXED32]  # GRAD/AGG lanes are 32-bit fixed point
    numel: dict[int, int] = {}
    share: dict[tuple[int, str], int] = {}
    for s in plan.shards:
        numel[s.layer_id] = numel.get(s.layer_id, 0) + s.numel
        share[(s.layer_id, s.node)] = share.get((s.layer_id, s.node), 0) + s.numel
    total, groups = sum(numel.values()) or 1, max(1, len(plan.groups))
    unknown = sorted({n for _, n in share if not capacities.get(n, 0.0) > 0})
    loads = []
    for lid in sorted(numel):
        per_worker = numel[lid] / groups
        mine = [(n, k) for (layer, n), k in share.items() if layer == lid]
        frac = numel[lid] / total
        loads.append(LayerLoad(
            pull=per_worker * param_bytes / rate, push=per_worker * grad_bytes / rate,
            step=max((k / capacities[n] for n, k in mine if n not in unknown), default=0.0),
            node_out=max((k * param_bytes / rate for _, k in mine), default=0.0),
            node_in=max((k * grad_bytes / rate for _, k in mine), default=0.0),
            fwd=compute_s / 4 * frac, bwd=compute_s * 3 / 4 * frac))
    seconds, busy = iteration_bound(loads)
    if compute_s <= 0:
        busy.pop("worker GPU")
    return {"iteration_s": seconds, "bottleneck": max(busy, key=busy.__getitem__) if busy else "",
            "busy_s": busy, "layers": len(loads), "link_gbps": link_bytes_per_s * 8 / 1e9,
            "wire_efficiency": wire_efficiency(4 * plan.lanes), "unknown_nodes": unknown}
