"""The emulated job: the controller's planner run on the emulated topology, made ready for Ethernet.

`plan_job` plans one job (all the topology's workers; optimizer nodes when push/pull is asked
for) with `luwu.controller.planner.Planner`, exactly as the controller would, then fills in what
the controller learns only when endpoints join: each endpoint's own address (its interface's IP
and the luwu UDP port, `Wiring(transport="ip")`). It returns the per-switch runtime JSON and
the per-host endpoint plans.

One adjustment works around a gap of the planner (reported, not rewritten): a node with one port
per rail (rail-only, `port_per_rail`) has one address per attachment here, but the planner gives
a node a single address for all of them, so the `endpoints` entries toward the node on each rail
are re-pointed at the node's address on that rail (its MAC is already right: it comes from the
model's `port_mac`).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from luwu.controller.config import ControllerConfig
from luwu.controller.job_spec import JobSpec
from luwu.controller.plan import JobPlan
from luwu.controller.planner import Planner, ip_to_int
from luwu.controller.topology import Topology
from luwu.controller.usage import SwitchUsage
from luwu.dataplane.protocol import NODE
from luwu.dataplane.session import EndpointPlan, Wiring

from .emulation import EmulationSpec

JOB_NAME = "mininet"


@dataclass
class EmulatedJob:
    plan: JobPlan
    runtime: dict[str, dict]  # switch -> p4lang/tutorials runtime JSON
    worker_host: dict[int, str]  # rank -> host name
    worker_plans: dict[int, EndpointPlan]
    node_plans: dict[str, list[EndpointPlan]]  # node host -> one plan per attachment
    layers: list[tuple[int, int]]  # (layer id, elements) the optimizer nodes serve (push/pull)


def plan_job(topo: Topology, spec: EmulationSpec, layers: list[tuple[int, int]] | None = None,
             target: str = "luwu-software-switch", p4info: str = "", bmv2_json: str = "",
             config: ControllerConfig | None = None, seed: int | None = None, nodes: int = 1) -> EmulatedJob:
    """Plan all the topology's workers as one job; with `layers`, `nodes` optimizer nodes per tree serve them."""
    workers = sum(1 for h in topo.hosts.values() if h.kind == "worker")
    lanes = {s.lanes for s in topo.switches.values()}
    if len(lanes) != 1:
        raise ValueError(f"the emulated switches disagree on the lane count: {sorted(lanes)}")
    job = JobSpec(JOB_NAME, workers, list(layers or []), packet_mode=str(lanes.pop()), num_nodes=nodes if layers else 0)
    usage = SwitchUsage({n: s.slots for n, s in topo.switches.items()})
    rng = random.Random(seed)
    epochs = itertools.count(rng.randrange(1, 2**31))  # as the controller's counter: distinct, never 0
    plan = Planner(config or ControllerConfig()).plan("mininet-1", job, topo, usage, lambda: next(epochs))
    worker_host: dict[int, str] = {}
    worker_plans: dict[int, EndpointPlan] = {}
    for p in plan.placements:
        host = topo.worker_host(p.switch, p.port)
        if host is None:
            raise ValueError(f"rank {p.rank} was placed on {p.switch} port {p.port}, where no worker host is")
        worker_host[p.rank] = host.name
        iface = spec.host(host.name).iface_to(p.switch)
        w = plan.worker_wiring[p.rank]
        plan.worker_wiring[p.rank] = Wiring(w.rank, "ip", (iface.ip, w.switch[1]), w.switch, w.switch_port)
        worker_plans[p.rank] = plan.worker_plan(p.rank)
    for node, attachments in plan.node_wiring.items():
        for nw in attachments:
            iface = spec.host(node).iface_to(nw.switch)
            w = nw.wiring
            nw.wiring = Wiring(w.rank, "ip", (iface.ip, w.switch[1]), w.switch, w.switch_port)
            _point_node_endpoints(plan, node, nw.switch, iface.ip)
    node_plans = {node: plan.node_plans(node) for node in plan.node_wiring}
    runtime = {name: prog.runtime_json(p4info, target, bmv2_json) for name, prog in plan.programs.items()}
    return EmulatedJob(plan, runtime, worker_host, worker_plans, node_plans, list(layers or []))


def _point_node_endpoints(plan: JobPlan, node: str, switch: str, ip: str) -> None:
    """The node's endpoint entries on `switch` go to the node's address on that switch's link."""
    sessions = {s.spec.session for s in plan.sessions if s.node == node and s.root == switch}
    for e in plan.programs[switch].entries:
        if e.table == "endpoints" and e.match.get("dst") == NODE and e.match.get("session") in sessions:
            e.action_params["dst_ip"] = ip_to_int(ip)
