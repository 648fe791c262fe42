"""The emulation's controller: `luwu controller` as a child process on the management network.

`EmulatedController.start()` runs the real daemon in the root namespace, listening on the
management bridge's address (mgmt.py), with an admin token in a file of the run directory. Who
registers what, as on a real cluster:

* a software switch (`luwu switch --controller`) registers itself, declaring its raw ports, what
  is behind each (worker, optimizer node, another switch and its port), the MACs there, its
  service address and its static IPv4 routes (`switch_args`: `--route`, the spec's `ipv4_routes`,
  rail-only's GPU-to-GPU TCP), and heartbeats; the controller installs its pipeline and
  entries over the switch's P4Runtime server (loopback, with the switch's derived token) and keeps
  the routes in `ipv4_lpm`;
* a BMv2 has no luwu agent, so the emulation registers it as an operator would
  (`register_bmv2`: RegisterSwitch with its P4Runtime address and routes) and reports its health while its
  process lives; the controller programs it over P4Runtime like any switch;
* optimizer nodes are registered with their data address (`register_nodes`) before the job is
  created, because the planner places layers on registered nodes (a `luwu node` daemon, started
  with the controller's plan for it, then re-registers itself, heartbeats and checks the workers'
  job token with the controller);
* the emulation creates the job (CreateJob, as a launcher would) and reads its plan (GetPlan)
  to know which host holds which rank; every worker then joins the job itself (JoinJob from
  inside its host, over the management network), and the controller re-programs the switch
  with the endpoint it joined from: the allreduce/push-pull workload itself, torch's backend at
  init_process_group (--workload ddp), ModelInNetwork's JobNetwork (--workload train).
"""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from luwu.controller.client import ControllerClient, ControllerRefused, ControllerUnreachable
from luwu.controller.daemon_link import HEARTBEAT_INTERVAL
from luwu.controller.plan import JobPlan
from luwu.controller.topology import Topology
from luwu.dataplane.protocol import DEFAULT_UDP_PORT
from luwu.proto import controller_pb2 as pb

from .emulation import EmulationSpec, EmuSwitch
from .job import JOB_NAME, EmulatedJob
from .processes import Child, ChildError, ChildGroup
from .switches import luwu_command

POLL = 0.2  # s between looks at the controller while waiting for it
ROLES = {"star": pb.STAR, "tor": pb.TOR, "cluster": pb.CLUSTER, "rail": pb.RAIL}
RPC_TIMEOUT = 30.0  # s per controller call (CreateJob programs every switch of the job)


class ControllerFailed(ChildError):
    """The controller did not start, refused something or programmed a switch wrongly; the message
    names it and its log."""


class _Dead(ValueError):
    """Ends a heartbeat thread (Heartbeat stops on ValueError): the switch's process is gone."""


def _stop_beating() -> dict:
    raise _Dead("switch process gone")


def _free_tcp_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmulatedController:
    """The controller child of one run.

    Args:
        children: the run's ChildGroup (the controller is stopped with the rest at teardown).
        run_dir: where its database, token file and log go.
        gateway: the management network's root address (mgmt.MgmtNetwork.gateway).
        pool: every session's pool size (None: the controller's defaults).
    """

    def __init__(self, children: ChildGroup, run_dir: Path, gateway: str, pool: int | None = None):
        self.children, self.run_dir, self.gateway, self.pool = children, run_dir, gateway, pool
        self.token = secrets.token_hex(16)
        self.token_file = run_dir / "controller-token"
        self.address = ""
        self.child: Child | None = None
        self.client: ControllerClient | None = None
        self.job_id = ""
        self.job_token = ""
        self.registered_by_emulation: list[str] = []  # switches without an agent (BMv2)
        self._beats: list = []  # their heartbeat threads
        self.metrics = ""  # the controller's /metrics URL once started

    # -- the process ------------------------------------------------------------------------------------
    def start(self, deadline: float) -> str:
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.address = f"{self.gateway}:{_free_tcp_port(self.gateway)}"
        # /metrics on the root namespace's loopback, where the user runs curl (docs/observability.md)
        metrics_port = _free_tcp_port("127.0.0.1")
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        argv = luwu_command() + ["controller", "--listen", self.address, "--db", str(self.run_dir / "controller.sqlite"),
                                 "--token-file", str(self.token_file), "--metrics", f"127.0.0.1:{metrics_port}",
                                 "--audit-log", str(self.run_dir / "controller-p4runtime-audit.jsonl")]
        if self.pool is not None:
            argv += ["--meta-pool", str(self.pool), "--data-pool", str(self.pool), "--node-pool", str(self.pool),
                     "--param-window", str(self.pool), "--min-pool", str(min(self.pool, 16))]
        child = self.child = self.children.start("controller", argv)
        self.client = ControllerClient(self.address, self.token, timeout=RPC_TIMEOUT)
        while True:
            try:
                self.client.status()
                return self.address
            except ControllerUnreachable:
                pass
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                raise ControllerFailed(f"controller {self.address} did not answer in time; see {child.log}")
            time.sleep(POLL)

    def _check_alive(self, when: str) -> None:
        if self.child is not None and not self.child.alive():
            raise ControllerFailed(f"controller {self.address} exited ({self.child.proc.returncode}) {when}: "
                                   f"{self.child.tail()}")

    def _call(self, what: str, fn, *args):
        if self.client is None:
            raise ControllerFailed("the controller was not started")
        try:
            return fn(*args)
        except (ControllerUnreachable, ControllerRefused) as e:
            self._check_alive(what)
            raise ControllerFailed(f"controller {self.address}: {what}: {e}") from None

    def close(self) -> None:
        for beat in self._beats:
            beat.stop()
        self._beats.clear()
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- registrations ----------------------------------------------------------------------------------
    def switch_args(self, topo: Topology, sw: EmuSwitch) -> list[str]:
        """`luwu switch` options that make it register itself (and what is behind each port) and heartbeat."""
        args = ["--controller", self.address, "--token-file", str(self.token_file), "--name", sw.name,
                "--role", topo.switches[sw.name].role, "--rail", str(topo.switches[sw.name].rail)]
        for port in sorted(sw.ports):
            peer = topo.peer(sw.name, port)
            if peer is not None and peer[0] in topo.switches:
                args += ["--peer-port", f"{port}={peer[0]}:{peer[1]}"]
            elif peer is not None and topo.hosts[peer[0]].kind == "node":
                args += ["--node-port", f"{port}={peer[0]}"]
            mac = topo.switches[sw.name].port_mac.get(port)
            if mac:
                args += ["--port-mac", f"{port}={mac}"]
        for prefix, plen, port, mac in sw.ipv4_routes:  # kept in ipv4_lpm by the controller
            args += ["--route", f"{prefix}/{plen}={port},mac={mac}"]
        return args

    def register_bmv2(self, topo: Topology, sw: EmuSwitch, p4runtime: str, port_drops: dict[int, int],
                      deadline: float) -> None:
        """Register a BMv2 as an operator would and wait until the controller programmed it."""
        spec = topo.switches[sw.name]
        rec = pb.Switch(name=sw.name, p4runtime_address=p4runtime, device_id=0, target="bmv2", lanes=sw.lanes,
                        slots=sw.slots, role=ROLES[spec.role], rail=spec.rail, service_address=sw.service_ip,
                        udp_port=sw.udp_port or DEFAULT_UDP_PORT)
        for port in sorted(sw.ports):
            p = rec.ports.add(number=port, interface=sw.ports[port], mac=spec.port_mac.get(port, ""),
                              ingress_drop_threshold=port_drops.get(port, 0))
            peer = topo.peer(sw.name, port)
            if peer is not None and peer[0] in topo.switches:
                p.peer_kind, p.peer, p.peer_port = pb.PEER_SWITCH, peer[0], peer[1]
            elif peer is not None and topo.hosts[peer[0]].kind == "node":
                p.peer_kind, p.peer = pb.PEER_NODE, peer[0]
            else:
                p.peer_kind = pb.PEER_WORKER
        for prefix, plen, port, mac in sw.ipv4_routes:  # the routes an agent would declare (`luwu switch --route`)
            rec.routes.add(prefix=f"{prefix}/{plen}", port=port, mac=mac)
        while True:  # BMv2's gRPC server comes up a moment after its process
            resp = self._call(f"registering BMv2 {sw.name}", self.client.register_switch, rec)  # type: ignore[union-attr]
            if resp.message == "registered and programmed":
                break
            if time.monotonic() > deadline:
                raise ControllerFailed(f"controller {self.address} could not program BMv2 {sw.name}: {resp.message}")
            time.sleep(0.5)
        self.registered_by_emulation.append(sw.name)

    def watch_agentless(self, name: str, alive, kind: str = "switch") -> None:
        """Report an agent-less component's health (a BMv2 switch, or the push/pull workload's node
        processes, kind "node") every HEARTBEAT_INTERVAL while `alive()`: the emulation stands in for
        the agent a real deployment runs (luwu switch, luwu node), and stops when the process dies."""
        if self.client is None:
            raise ControllerFailed("the controller was not started")
        self._beats.append(self.client.heartbeat_loop(kind, name, HEARTBEAT_INTERVAL,
                                                      counters=lambda: {} if alive() else _stop_beating()))

    def wait_switches(self, names: list[str], deadline: float, alive) -> dict[str, pb.Switch]:
        """Every switch in `names` registered and programmed "ok" by the controller; `alive()`
        raises when a switch process died meanwhile."""
        while True:
            self._check_alive("while the switches registered")
            alive()
            seen = {s.name: s for s in self._call("listing switches", self.client.switches)}  # type: ignore[union-attr]
            if all(n in seen and seen[n].programmed == "ok" for n in names):
                return seen
            if time.monotonic() > deadline:
                state = ", ".join(f"{n}: {seen[n].programmed or 'not programmed'}" if n in seen else f"{n}: not "
                                  "registered" for n in names)
                raise ControllerFailed(f"controller {self.address}: switches not registered and programmed in time "
                                       f"({state})")
            time.sleep(POLL)

    def register_nodes(self, spec: EmulationSpec) -> None:
        """Optimizer nodes at their data address (their interface's IP, the luwu UDP port)."""
        for host in spec.hosts:
            if host.kind != "node":
                continue
            if len(host.interfaces) != 1:
                raise ControllerFailed(f"node {host.name} has {len(host.interfaces)} data interfaces; a controller "
                                       "node registration holds one address")
            iface = host.interfaces[0]
            udp = spec.switch(iface.switch).udp_port or DEFAULT_UDP_PORT
            self._call(f"registering node {host.name}", self.client.register_node,  # type: ignore[union-attr]
                       pb.Node(name=host.name, data_address=f"{iface.ip}:{udp}"))

    # -- the job ------------------------------------------------------------------------------------------
    def create_job(self, spec: EmulationSpec, workers: int, lanes: int, layers: list[tuple[int, int]],
                   nodes: int) -> EmulatedJob:
        """CreateJob, then GetPlan: the job as the rest of the emulation needs it (which host holds
        which rank, the nodes' plans). The switches are programmed by the controller already."""
        job = pb.Job(name=JOB_NAME, num_workers=workers, packet_mode=str(lanes), num_nodes=nodes if layers else 0)
        for lid, numel in layers:
            job.layers.add(layer_id=lid, numel=numel)
        created, self.job_token = self._call("creating the job", self.client.create_job, job)  # type: ignore[union-attr]
        self.job_id = created.job_id
        raw = self._call("reading the plan", self.client.plan, self.job_id)  # type: ignore[union-attr]
        plan = JobPlan.from_json(raw.plan_json)
        at = {(i.switch, i.port): h.name for h in spec.hosts for i in h.interfaces if i.switch}
        worker_host = {}
        for p in plan.placements:
            if (p.switch, p.port) not in at:
                raise ControllerFailed(f"controller placed rank {p.rank} on {p.switch} port {p.port}, where no "
                                       "emulated host is")
            worker_host[p.rank] = at[(p.switch, p.port)]
        worker_plans = {r: plan.worker_plan(r) for r in worker_host}
        node_plans = {node: plan.node_plans(node) for node in plan.node_wiring}
        return EmulatedJob(plan, {}, worker_host, worker_plans, node_plans, list(layers))

    def worker_config(self, host_ip: str, udp_port: int) -> dict:
        """What a worker needs to join the job itself."""
        return {"address": self.address, "job": self.job_id, "token": self.job_token,
                "endpoint": f"{host_ip}:{udp_port}"}

    def report(self) -> dict:
        """The controller's view of the switches (for --json): programmed by it, health, drift."""
        try:
            switches = self.client.switches() if self.client is not None else []
            nodes = self.client.nodes() if self.client is not None else []
        except (ControllerUnreachable, ControllerRefused) as e:
            return {"address": self.address, "job": self.job_id, "error": str(e)}
        return {"address": self.address, "job": self.job_id, "token_file": str(self.token_file),
                "registered_by_emulation": self.registered_by_emulation,
                "switches": {s.name: {"programmed": s.programmed, "health": s.health, "target": s.target,
                                      "p4runtime": s.p4runtime_address, "jobs": list(s.jobs),
                                      "routes": [f"{r.prefix}={r.port}" for r in s.routes]} for s in switches},
                "nodes": {n.name: {"health": n.health, "data_address": n.data_address, "jobs": list(n.jobs)}
                          for n in nodes}}
