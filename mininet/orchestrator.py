"""One emulation run, start to finish: network, switches, optimizer nodes, workers, results, teardown.

`Emulation.run()` builds the network with the chosen backend, starts and programs one switch per
switch node, starts the optimizer nodes (push/pull only) and the workers inside their hosts
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
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from luwu.controller.topology import Topology

from .emulation import EmulationSpec
from .job import EmulatedJob
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
    port_drops: dict[str, dict[int, float]] = field(default_factory=dict)  # switch -> port -> ingress loss
    timeout: float = 120.0  # s for the workload, once released
    seed: int = 1
    nvlink_port: int = 19600  # TCP port of the emulated NVLink exchange (rail-only)
    mininet_python: str | None = None


@dataclass
class RunResult:
    workers: list[dict] = field(default_factory=list)  # one result line per worker (or an error)
    nodes: list[dict] = field(default_factory=list)
    switches: dict[str, dict] = field(default_factory=dict)  # name -> counters
    errors: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # what teardown could not remove

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
        self.children = ChildGroup(run_dir, env)
        self.network: MininetNetwork | NetnsNetwork | None = None
        self.switches: list[RunningSwitch] = []

    # -- the network --------------------------------------------------------------------------------
    def _make_network(self) -> MininetNetwork | NetnsNetwork:
        if self.opts.backend == "mininet":
            from .mininet_backend import MininetNetwork

            return MininetNetwork(self.spec, self.opts.mininet_python, self.run_dir)
        from .netns_backend import NetnsNetwork

        return NetnsNetwork(self.spec)

    def run(self) -> RunResult:
        result = RunResult()
        try:
            self.progress(f"building the network ({self.opts.backend})")
            self.network = self._make_network()
            namespaces = self.network.start()
            self._start_switches()
            nodes = self._start_nodes(namespaces)
            workers = self._start_workers(namespaces)
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
            if not self.network.alive():
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
                self.children.close(lambda c: c not in switch_procs)  # workers and nodes first
                live = {s.spec.name: s.counters() for s in self.switches if s.grpc_address}  # BMv2: read while up
                self.children.close()  # the software switch writes its last counters as it stops
                result.switches = {s.spec.name: live.get(s.spec.name) or s.counters() for s in self.switches}
                if self.network is not None:
                    result.leftovers = self.network.stop()
        return result

    def up(self, ready, wait) -> list[str]:
        """`luwu mininet up`: the network and its programmed switches (and, with --workload train,
        the optimizer node daemons) running; `ready(info)` gets how to reach them, `wait()` blocks
        until the user is done (Ctrl-C, SIGTERM or a duration). Tears everything down after, on
        any path; returns what teardown could not remove."""
        leftovers: list[str] = []
        try:
            self.progress(f"building the network ({self.opts.backend})")
            self.network = self._make_network()
            namespaces = self.network.start()
            self._start_switches()
            self._start_nodes(namespaces)
            plans = {}
            for rank, plan in sorted(self.job.worker_plans.items()):
                path = self.run_dir / f"plan-rank{rank}.json"
                path.write_text(plan.to_json())
                plans[rank] = str(path)
            hosts: dict[str, dict[str, Any]] = {
                h.name: {"namespace": namespaces.get(h.name, ""), "kind": h.kind, "server": h.server,
                         "addresses": [i.ip for i in h.interfaces] + ([h.nvlink] if h.nvlink else []),
                         "enter": f"nsenter --net={namespaces.get(h.name, '')} bash"}
                for h in self.spec.hosts}
            for rank, host in self.job.worker_host.items():
                hosts[host]["rank"] = rank
                hosts[host]["plan"] = plans[rank]
            ready({"ready": True, "run_dir": str(self.run_dir), "backend": self.opts.backend, "hosts": hosts,
                   "switches": {s.spec.name: {"ports": len(s.spec.ports), "p4runtime": s.grpc_address or None,
                                              "log": str(s.child.log)}
                                for s in self.switches}})
            wait()
        finally:
            with _shielded():
                self.progress("tearing down")
                self.children.close()
                if self.network is not None:
                    leftovers = self.network.stop()
        return leftovers

    # -- switches -------------------------------------------------------------------------------------
    def _start_switches(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for i, sw in enumerate(self.spec.switches):
            runtime = self.job.runtime[sw.name] if sw.name in self.job.runtime else _empty_runtime()
            self.progress(f"starting {self.opts.switch} switch {sw.name} on {len(sw.ports)} port(s)")
            if self.opts.switch == "bmv2":
                self.switches.append(start_bmv2(self.children, sw, runtime, self.run_dir, deadline))
            else:
                self.switches.append(start_software(self.children, sw, runtime, self.run_dir, self.opts.seed + i,
                                                    deadline))

    # -- hosts ----------------------------------------------------------------------------------------
    def _workload(self, name: str, cfg: dict, ns_path: str):
        path = self.run_dir / f"{name}.workload.json"
        path.write_text(json.dumps(cfg))
        return self.children.start(name, [sys.executable, "-m", "luwu.mininet.workload", str(path)], ns_path)

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
                   "node": {"plans": [json.loads(p.to_json()) for p in plans], "shards": shards}}
            started.append(self._workload(f"node-{node}", cfg, namespaces[node]))
        deadline = time.monotonic() + READY_TIMEOUT
        for child in started:
            child.expect("ready", deadline)
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
            started.append(self.children.start(f"node-{node}", train_workload.node_argv(
                sys.executable, node, plan_file, self.run_dir, token_file, ram), namespaces[node]))
        deadline = time.monotonic() + READY_TIMEOUT
        for child in started:
            child.expect("ready", deadline)

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
            if len(mates) > 1:
                w["nvlink"] = {"index": mates.index(rank), "port": self.opts.nvlink_port,
                               "addresses": [self.spec.host(job.worker_host[r]).nvlink for r in mates]}
            if self.opts.workload == "ddp":
                w["ddp"] = {"world": len(all_ranks), "steps": self.opts.steps, "dir": str(self.run_dir),
                            "store": str(self.run_dir / "ddp-store"), "p2p_host": host.interfaces[0].ip,
                            "local_world_size": 1, "local_rank": 0}
                if len(mates) > 1:  # rail-only: the backend goes hierarchical over the server's NVLink
                    if mates != list(range(mates[0], mates[0] + len(mates))) or mates[0] % len(mates):
                        raise RuntimeError(f"server {host.server} holds ranks {mates}: the backend's rail-only "
                                           "allreduce needs ranks numbered server by server")
                    w["ddp"].update(p2p_host=host.nvlink, local_world_size=len(mates), local_rank=mates.index(rank))
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
                   "timeout": self.opts.timeout + READY_TIMEOUT, "worker": w}
            started.append(self._workload(f"worker-{rank}", cfg, namespaces[host.name]))
        deadline = time.monotonic() + READY_TIMEOUT
        for child in started:
            child.expect("ready", deadline)
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


def _empty_runtime() -> dict:
    return {"table_entries": [], "multicast_group_entries": []}
