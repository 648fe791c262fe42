"""One emulation run, start to finish: network, switches, optimizer nodes, workers, results, teardown.

`Emulation.run()` builds the network with the chosen backend, (with a controller) a management
network and `luwu controller` on it (control.py), starts one switch per switch node -- programmed
by the controller over P4Runtime, or from a runtime file when the runner planned in process --,
has the controller create the job, starts the optimizer nodes (push/pull only) and the workers inside their hosts
(workload.py, the venv's python), releases them together, collects every result within the
deadline and tears everything down in reverse order -- on success, on failure and on Ctrl-C /
SIGTERM alike (the runner turns SIGTERM into KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from luwu.controller.topology import Topology
from luwu.dataplane.observe import trace
from luwu.dataplane.process.children import python_module

from .control import EmulatedController
from .emulation import EmulationSpec
from .job import EmulatedJob
from .mgmt import MGMT_SUBNET, MgmtNetwork
from .processes import ChildError, ChildGroup
from .switches import RunningSwitch, start_bmv2, start_software

if TYPE_CHECKING:  # imported where used: a backend's dependencies load only when it runs
    from .mininet_backend import MininetNetwork
    from .netns_backend import NetnsNetwork

READY_TIMEOUT = 60.0  # s for a switch or host process to come up (python start-up on a loaded machine)
NODE_STOP_TIMEOUT = 15.0  # s for an optimizer node to report after the workers are done


@dataclass
class RunOptions:
    backend: str = "netns"  # "netns" or "mininet"
    switch: str = "software"  # "software" or "bmv2"
    elements: int = 65536  # int32 elements each worker allreduces
    push_pull: bool = False
    workload: str = "allreduce"  # "allreduce" (engine checks), "ddp" (torch DDP over the luwu backend) or
    # "train" (ModelInNetwork: AdamW on `luwu node` daemons, train_workload.py)
    steps: int = 20  # DDP training steps
    collectives: bool = False  # ddp: also all_to_all, gather and send/recv between every pair of ranks
    port_drops: dict[str, dict[int, float]] = field(default_factory=dict)  # switch -> port -> ingress loss
    timeout: float = 120.0  # s for the workload, once released
    seed: int = 1
    nvlink_port: int = 19600  # TCP port of the emulated NVLink exchange (rail-only)
    mininet_python: str | None = None
    trace_out: Path | None = None  # where the run's trace.json goes (default: in the run directory)
    # a `luwu controller` process on a management network plans the job and programs the switches
    # (control.py); False: the runner plans in process and hands each switch a runtime file
    controller: bool = False
    mgmt_subnet: str = MGMT_SUBNET
    pool: int | None = None  # every session's pool (None: the planner's defaults)


@dataclass
class RunResult:
    workers: list[dict] = field(default_factory=list)  # one result line per worker (or an error)
    nodes: list[dict] = field(default_factory=list)
    switches: dict[str, dict] = field(default_factory=dict)  # name -> counters
    errors: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # what teardown could not remove
    trace: str | None = None  # the run's merged timeline (Chrome trace), when its processes wrote one
    controller: dict = field(default_factory=dict)  # the controller's address and view of the switches
    metrics: dict[str, str] = field(default_factory=dict)  # component -> its /metrics URL while it ran

    @property
    def passed(self) -> bool:
        ok = bool(self.workers) and all(w.get("verified") for w in self.workers)
        ok = ok and all(w.get("pushpull", {}).get("verified", True) for w in self.workers)
        return ok and not self.errors


class Emulation:
    def __init__(self, topo: Topology, spec: EmulationSpec, job: EmulatedJob, opts: RunOptions, run_dir: Path,
                 progress=None):
        self.topo, self.spec, self.job, self.opts, self.run_dir = topo, spec, job, opts, run_dir
        self.progress = progress or (lambda msg: None)
        env = dict(os.environ, LUWU_NO_BACKEND="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        # every process it starts writes its timeline here; the namespaces share the host's clock, so
        # merge_trace() makes one trace of the run (docs/observability.md)
        env[trace.ENV] = str(run_dir / "trace")
        self.children = ChildGroup(run_dir, env)
        self.network: MininetNetwork | NetnsNetwork | None = None
        self.switches: list[RunningSwitch] = []
        self.mgmt: MgmtNetwork | None = None
        self.ctl: EmulatedController | None = None
        self.metrics: dict[str, str] = {}  # component -> its Prometheus /metrics URL (reachable from the root namespace)

    # -- the network --------------------------------------------------------------------------------
    def _make_network(self) -> MininetNetwork | NetnsNetwork:
        if self.opts.backend == "mininet":
            from .mininet_backend import MininetNetwork

            return MininetNetwork(self.spec, self.opts.mininet_python, self.run_dir)
        from .netns_backend import NetnsNetwork

        return NetnsNetwork(self.spec)

    def _bring_up(self) -> tuple[dict[str, str], list]:
        """The network, the controller, the programmed switches, the job and the optimizer nodes (what
        `run` and `up` share); returns the hosts' namespaces and the node processes with a result line."""
        self.progress(f"building the network ({self.opts.backend})")
        self.network = self._make_network()
        namespaces = self.network.start()
        self._start_controller(namespaces)
        self._start_switches()
        self._controller_job()
        nodes = self._start_nodes(namespaces)
        if self.ctl is not None and self.ctl.metrics:
            self.metrics["controller"] = self.ctl.metrics
        self.metrics.update({f"switch {s.spec.name}": s.metrics for s in self.switches if s.metrics})
        return namespaces, nodes

    def _metrics_address(self, host: str) -> str | None:
        """HOST:0 on `host`'s management address, where the root namespace reaches a /metrics endpoint
        (None without a management network: nothing outside the host would reach it)."""
        if self.mgmt is None or host not in self.mgmt.addresses:
            return None
        return f"{self.mgmt.addresses[host]}:0"

    def _note_metrics(self, who: str, ready: dict) -> None:
        if ready.get("metrics"):
            self.metrics[who] = str(ready["metrics"])

    def run(self) -> RunResult:
        result = RunResult(metrics=self.metrics)
        try:
            namespaces, nodes = self._bring_up()
            workers = self._start_workers(namespaces)
            for who, url in sorted(self.metrics.items()):  # every component's endpoint, while the run lasts
                self.progress(f"metrics of {who}: curl -s {url}")
            self.progress(f"running: {len(workers)} worker(s), {len(nodes)} optimizer node(s)")
            for child in nodes + workers:
                child.tell("go")
            deadline = time.monotonic() + self.opts.timeout
            for child in workers:
                try:
                    result.workers.append(child.expect("result", deadline))
                except ChildError as e:
                    result.errors.append(str(e))
            for child in workers:
                child.tell("stop")
            if self.network is not None and not self.network.alive():
                result.errors.append(f"the {self.opts.backend} network went away during the run (see "
                                     f"{self.run_dir / 'mininet.log'})")
            for child in nodes:
                child.tell("stop")
            node_deadline = time.monotonic() + NODE_STOP_TIMEOUT
            for child in nodes:
                try:
                    result.nodes.append(child.expect("result", node_deadline))
                except ChildError as e:
                    result.errors.append(str(e))
        except ChildError as e:
            result.errors.append(str(e))
        except KeyboardInterrupt:
            result.errors.append("interrupted")
            raise
        except Exception as e:  # reported, with the traceback in the run directory
            import traceback

            (self.run_dir / "runner.log").write_text(traceback.format_exc())
            result.errors.append(f"{type(e).__name__}: {e} (traceback in {self.run_dir / 'runner.log'})")
        finally:
            with _shielded():  # a second Ctrl-C must not cut the teardown short
                self.progress("tearing down")
                switch_procs = {s.child for s in self.switches}
                self.children.close(lambda c: c not in switch_procs and c is not getattr(self.ctl, "child", None))
                if self.ctl is not None:  # its view of the switches, while both are up
                    result.controller = self.ctl.report()
                    self.ctl.close()
                    if not any(self.ctl.address in e for e in result.errors):  # named once is enough
                        result.errors += _unprogrammed(result.controller, [sw.name for sw in self.spec.switches])
                live = {s.spec.name: s.counters() for s in self.switches  # BMv2: read while up
                        if s.grpc_address and s.stats_file is None}
                self.children.close()  # the software switch writes its last counters as it stops
                result.switches = {s.spec.name: live.get(s.spec.name) or s.counters() for s in self.switches}
                if self.mgmt is not None:
                    result.leftovers = self.mgmt.stop()
                if self.network is not None:
                    result.leftovers += self.network.stop()
                try:
                    out = self.merge_trace(self.opts.trace_out or self.run_dir / "trace.json")
                    result.trace = str(out) if out is not None else None
                except OSError as e:
                    result.errors.append(f"cannot write the trace: {e}")
        return result

    def merge_trace(self, out: Path) -> Path | None:
        """The run's processes' timelines as one Chrome trace at `out`; None when no process wrote one.
        Hosts name their tracks themselves ("worker 0 (w0)"); a switch daemon does not know which
        switch it is, so its track gets the child's name: "switch (switch-s1)"."""
        if not list((self.run_dir / "trace").glob("trace-*.jsonl")):
            return None
        switches = {pid: name for pid, name in self.children.started.items() if name.startswith("switch-")}
        return trace.merge(self.run_dir / "trace", out, labels=switches)

    def up(self, ready, wait) -> list[str]:
        """`luwu mininet up`: the network and its programmed switches (and, with --workload train,
        the optimizer node daemons) running; `ready(info)` gets how to reach them, `wait()` blocks
        until the user is done (Ctrl-C, SIGTERM or a duration). Tears everything down after, on
        any path; returns what teardown could not remove."""
        leftovers: list[str] = []
        if self.children.env is not None:  # open-ended: no timeline growing until Ctrl-C
            self.children.env = {k: v for k, v in self.children.env.items() if k != trace.ENV}
        try:
            namespaces, _ = self._bring_up()
            hosts: dict[str, dict[str, Any]] = {
                h.name: {"namespace": namespaces.get(h.name, ""), "kind": h.kind, "server": h.server,
                         "addresses": [i.ip for i in h.interfaces] + ([h.nvlink] if h.nvlink else []),
                         "enter": f"nsenter --net={namespaces.get(h.name, '')} bash"}
                for h in self.spec.hosts}
            for rank, host in self.job.worker_host.items():
                hosts[host]["rank"] = rank
                if self.ctl is not None:  # a rank joins the controller's job itself (the backend's JoinJob)
                    ip = self._rank_ip(rank)
                    hosts[host]["join"] = (f"LUWU_CONTROLLER={self.ctl.address} LUWU_JOB={self.ctl.job_id} "
                                           f"LUWU_TOKEN={self.ctl.job_token} LUWU_ENDPOINT_HOST={ip}")
                else:
                    path = self.run_dir / f"plan-rank{rank}.json"
                    path.write_text(self.job.worker_plans[rank].to_json())
                    hosts[host]["plan"] = str(path)
            if self.mgmt is not None:
                for name, address in self.mgmt.addresses.items():
                    hosts[name]["management"] = address
            info: dict[str, Any] = {
                "ready": True, "run_dir": str(self.run_dir), "backend": self.opts.backend, "hosts": hosts,
                "switches": {s.spec.name: {"ports": len(s.spec.ports), "p4runtime": s.grpc_address or None,
                                           "metrics": s.metrics or None, "log": str(s.child.log)}
                             for s in self.switches}}
            info["metrics"] = self.metrics
            if self.ctl is not None:
                info["controller"] = {"address": self.ctl.address, "token_file": str(self.ctl.token_file),
                                      "job": self.ctl.job_id, "log": str(self.ctl.child.log) if self.ctl.child else "",
                                      "metrics": self.ctl.metrics or None,
                                      "luwu_ctl": f"LUWU_CONTROLLER={self.ctl.address} LUWU_TOKEN=$(cat "
                                                  f"{self.ctl.token_file}) luwu-ctl switches"}
            ready(info)
            wait()
        finally:
            with _shielded():
                self.progress("tearing down")
                if self.ctl is not None:
                    self.ctl.close()
                self.children.close()
                if self.mgmt is not None:
                    leftovers = self.mgmt.stop()
                if self.network is not None:
                    leftovers += self.network.stop()
        return leftovers

    # -- switches -------------------------------------------------------------------------------------
    def _start_switches(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for i, sw in enumerate(self.spec.switches):
            runtime = self.job.runtime[sw.name] if sw.name in self.job.runtime else _empty_runtime()
            self.progress(f"starting {self.opts.switch} switch {sw.name} on {len(sw.ports)} port(s)")
            drops = self.opts.port_drops.get(sw.name, {})
            if self.opts.switch == "bmv2":
                running = start_bmv2(self.children, sw, None if self.ctl else runtime, self.run_dir, deadline)
                if self.ctl is not None:  # no agent on BMv2: registered as an operator would
                    from luwu.dataplane.switch.controls.drop_simulator import threshold_for

                    self.ctl.register_bmv2(self.topo, sw, running.grpc_address,
                                           {p: threshold_for(v) for p, v in drops.items() if v}, deadline)
                    self.ctl.watch_agentless(sw.name, running.child.alive)
                self.switches.append(running)
            elif self.ctl is not None:  # registers itself; the controller programs it over P4Runtime
                args = self.ctl.switch_args(self.topo, sw)
                args += [a for p, v in sorted(drops.items()) if v for a in ("--drop", f"{p}:ingress={v!r}")]
                self.switches.append(start_software(self.children, sw, None, self.run_dir, self.opts.seed + i,
                                                    deadline, args))
            else:
                self.switches.append(start_software(self.children, sw, runtime, self.run_dir, self.opts.seed + i,
                                                    deadline))

    # -- the controller -------------------------------------------------------------------------------
    def _start_controller(self, namespaces: dict[str, str]) -> None:
        """The management network and `luwu controller` on it (with RunOptions.controller)."""
        if not self.opts.controller:
            return
        self.progress("building the management network")
        self.mgmt = MgmtNetwork(self.spec.run_id, namespaces, self.opts.mgmt_subnet)
        gateway = self.mgmt.start()
        self.progress(f"starting the controller on {gateway}")
        self.ctl = EmulatedController(self.children, self.run_dir, gateway, self.opts.pool)
        self.ctl.start(time.monotonic() + READY_TIMEOUT)

    def _controller_job(self) -> None:
        """Wait until every switch is registered and programmed, register the nodes, create the
        job; from here on `self.job` is the controller's."""
        if self.ctl is None:
            return
        names = [sw.name for sw in self.spec.switches]

        def alive() -> None:
            for s in self.switches:
                if not s.child.alive():
                    raise ChildError(f"{s.child.name} exited ({s.child.proc.returncode}): {s.child.tail()}")

        self.progress("waiting for the switches to register with the controller")
        self.ctl.wait_switches(names, time.monotonic() + READY_TIMEOUT, alive)
        preview = self.job
        nodes = len(preview.plan.nodes) if preview.layers else 0
        if nodes:
            self.ctl.register_nodes(self.spec)
        self.progress("creating the job at the controller")
        self.job = self.ctl.create_job(self.spec, len(preview.worker_host), preview.plan.lanes, preview.layers,
                                       max(1, nodes // max(1, len(preview.plan.groups))))

    def _rank_ip(self, rank: int) -> str:
        """The address rank `rank` joins from: its host's interface toward the switch it was placed on."""
        placement = next(p for p in self.job.plan.placements if p.rank == rank)
        return self.spec.host(self.job.worker_host[rank]).iface_to(placement.switch).ip

    # -- hosts ----------------------------------------------------------------------------------------
    def _workload(self, name: str, cfg: dict, ns_path: str):
        path = self.run_dir / f"{name}.workload.json"
        path.write_text(json.dumps(cfg))
        return self.children.start(name, python_module("luwu.mininet.workload", str(path)), ns_path)

    def _start_nodes(self, namespaces: dict[str, str]) -> list:
        if self.opts.workload == "train":
            self._start_optimizer_daemons(namespaces)
            return []  # daemons: stopped with the rest at teardown, no result line
        if not self.opts.push_pull:
            return []
        started = []
        for node, plans in sorted(self.job.node_plans.items()):
            shards = [_shard(self.job, s) for s in self.job.plan.shards if s.node == node]
            cfg = {"role": "node", "host": node, "seed": self.opts.seed, "timeout": self.opts.timeout + READY_TIMEOUT,
                   "node": {"plans": [json.loads(p.to_json()) for p in plans], "shards": shards},
                   "metrics": self._metrics_address(node)}
            started.append(self._workload(f"node-{node}", cfg, namespaces[node]))
        deadline = time.monotonic() + READY_TIMEOUT
        for node, child in zip(sorted(self.job.node_plans), started, strict=True):
            self._note_metrics(f"node {node}", child.expect("ready", deadline))
        if self.ctl is not None:  # registered by the emulation (register_nodes): it reports their health too
            for node, child in zip(sorted(self.job.node_plans), started, strict=True):
                self.ctl.watch_agentless(node, child.alive, kind="node")
        return started

    def _start_optimizer_daemons(self, namespaces: dict[str, str]) -> None:
        """--workload train: a `luwu node` daemon per optimizer node (AdamW, out of core), its
        control channel a Unix socket in the run directory (every namespace sees it)."""
        from . import train_workload

        self.train_token = secrets.token_hex(16)
        token_file = self.run_dir / "node-token"
        token_file.write_text(self.train_token)
        token_file.chmod(0o600)
        ram = max(1 << 16, int(train_workload.state_bytes(self.opts.seed) * train_workload.NODE_RAM_FRACTION))
        started = []
        for node, plans in sorted(self.job.node_plans.items()):
            if len(plans) != 1:
                raise RuntimeError(f"optimizer node {node} has {len(plans)} attachments; --workload train runs a "
                                   "node on one attachment (star, multi-rack)")
            plan_file = self.run_dir / f"{node}-plan.json"
            plan_file.write_text(plans[0].to_json())
            self.progress(f"starting optimizer node {node} (AdamW, RAM budget {ram} bytes)")
            argv = train_workload.node_argv(node, plan_file, self.run_dir, token_file, ram)
            if self.ctl is not None:  # re-registers itself, heartbeats, checks the workers' job token with it
                argv += ["--controller", self.ctl.address, "--token-file", str(self.ctl.token_file), "--name", node]
            if self._metrics_address(node):
                argv += ["--metrics", str(self._metrics_address(node))]
            started.append(self.children.start(f"node-{node}", argv, namespaces[node]))
        deadline = time.monotonic() + READY_TIMEOUT
        for node, child in zip(sorted(self.job.node_plans), started, strict=True):
            ready = child.expect("ready", deadline)
            if ready.get("metrics"):  # `luwu node` names HOST:PORT
                self.metrics[f"node {node}"] = f"http://{ready['metrics']}/metrics"

    def _start_workers(self, namespaces: dict[str, str]) -> list:
        plan, job = self.job.plan, self.job
        all_ranks = sorted(job.worker_host)
        servers: dict[str, list[int]] = {}
        for r in all_ranks:
            servers.setdefault(self.spec.host(job.worker_host[r]).server, []).append(r)
        started = []
        for rank in all_ranks:
            host = self.spec.host(job.worker_host[rank])
            group = plan.groups[plan.group_of(rank)]
            mates = servers.get(host.server, []) if host.server else []
            w = {"rank": rank, "plan": json.loads(job.worker_plans[rank].to_json()), "elements": self.opts.elements,
                 "group": group, "all_ranks": all_ranks, "nvlink": None, "pushpull": None}
            if self.ctl is not None:  # the worker joins the job itself (its plan above is the controller's draft)
                placed = next(p for p in job.plan.placements if p.rank == rank)
                w["controller"] = self.ctl.worker_config(self._rank_ip(rank), self.spec.switch(placed.switch).udp_port)
                w["controller"]["controls"] = [f"unix:{self.run_dir / (n + '.sock')}" for n in job.plan.nodes]
            if len(mates) > 1:
                w["nvlink"] = {"index": mates.index(rank), "port": self.opts.nvlink_port,
                               "addresses": [self.spec.host(job.worker_host[r]).nvlink for r in mates]}
            if self.opts.workload == "ddp":
                w["ddp"] = {"world": len(all_ranks), "steps": self.opts.steps, "dir": str(self.run_dir),
                            "store": str(self.run_dir / "ddp-store"), "p2p_host": host.interfaces[0].ip,
                            "local_world_size": 1, "local_rank": 0, "collectives": self.opts.collectives}
                if len(mates) > 1:  # rail-only: the backend goes hierarchical over the server's NVLink
                    if mates != list(range(mates[0], mates[0] + len(mates))) or mates[0] % len(mates):
                        raise RuntimeError(f"server {host.server} holds ranks {mates}: the backend's rail-only "
                                           "allreduce needs ranks numbered server by server")
                    # p2p stays on the rail address: every GPU reaches it, mates over NVLink (topologies._cross_rail)
                    w["ddp"].update(local_world_size=len(mates), local_rank=mates.index(rank))
            if self.opts.workload == "train":
                from . import train_workload

                w["train"] = {"spec": train_workload.spec(len(all_ranks), self.opts.steps, self.opts.seed),
                              "network": train_workload.network_json(job, rank, self.run_dir, self.train_token),
                              "params_out": str(self.run_dir / "train-params-rank0.npz")}
            if self.opts.push_pull:
                g = plan.group_of(rank)
                w["pushpull"] = {"lanes": plan.lanes, "group": group,
                                 "shards": [_shard(job, s) for s in plan.shards if s.group == g]}
            cfg = {"role": "worker", "host": host.name, "seed": self.opts.seed,
                   "timeout": self.opts.timeout + READY_TIMEOUT, "worker": w,
                   "metrics": self._metrics_address(host.name)}
            started.append(self._workload(f"worker-{rank}", cfg, namespaces[host.name]))
        deadline = time.monotonic() + READY_TIMEOUT
        for rank, child in zip(all_ranks, started, strict=True):
            self._note_metrics(f"worker {rank}", child.expect("ready", deadline))
        return started


@contextlib.contextmanager
def _shielded():
    """SIGINT and SIGTERM held off (main thread only) while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _shard(job: EmulatedJob, s) -> dict:
    numel = dict(job.layers)[s.layer_id]
    return {"layer": s.layer_id, "offset": s.offset, "numel": s.numel, "session": s.session, "layer_numel": numel}


def _unprogrammed(report: dict, names: list[str]) -> list[str]:
    """Errors for the switches the controller does not report as programmed by it."""
    if report.get("error"):
        return [f"controller {report.get('address')}: {report['error']}"]
    seen = report.get("switches", {})
    return [f"controller {report.get('address')}: switch {n} " + (f"not programmed: {seen[n]['programmed']}"
                                                                  if n in seen else "never registered")
            for n in names if seen.get(n, {}).get("programmed") != "ok"]


def _empty_runtime() -> dict:
    return {"table_entries": [], "multicast_group_entries": []}
