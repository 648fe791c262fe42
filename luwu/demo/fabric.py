"""The demo's network: everything but the workers, started on loopback and stopped with the demo.

`ControllerFabric` is the real deployment shape: a `luwu controller` process, the software switch
(`luwu switch`, registering itself and served over P4Runtime), `luwu node` optimizer node(s)
registering themselves and reporting their health, and a job created through it: the controller plans sessions and
pools and programs the switch; workers JoinJob for their plans. `LocalFabric` is the fallback
without a controller (a StarPlan's switch and in-process optimizer nodes). Either way the
switch's ports are shared-memory rings (`luwu switch --port N=shm`, addresses shm:/dev/shm/NAME
that the controller's plans hand to the workers and nodes) or loopback UDP sockets (`transport`).
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from luwu.dataplane.loopback import free_udp_port

from .launch import Child, luwu_command

if TYPE_CHECKING:  # imported where used: the embedded fabric runs without the controller's dependencies
    from luwu.controller.client import ControllerClient

READY_TIMEOUT = 60.0  # s a daemon may take to come up
SWITCH_SLOTS = 1024  # aggregation slots per set of the demo's switch
# the placeholder capacity each node is registered with before it starts (equal nodes: an even shard split);
# each node then re-registers the rate it measures at start (luwu/bench/node_rate.py), which predictions use
NODE_PARAMS_PER_SECOND = 1e7
NODE_DISK_BYTES = 1 << 34


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_line(who: str, address: str) -> str:
    """The line that names a component's Prometheus endpoint, the same for every component."""
    return f"curl http://{address}/metrics   # {who}"


class ControllerFabric:
    kind = "controller"

    def __init__(self, workdir: Path, workers: int, nodes: int, lanes: str, drop: float, seed: int, node_ram: int,
                 checkpoints: Path | None = None, checkpoint_every: int = 0, restore: dict | None = None,
                 transport: str = "udp"):
        self.dir = Path(workdir)
        self.workers, self.nodes, self.lanes = workers, nodes, lanes
        self.transport = transport  # the switch's ports: "shm" (ring pairs in /dev/shm) or "udp" (loopback sockets)
        self.checkpoints, self.checkpoint_every = checkpoints, checkpoint_every
        self.restore = restore  # {"job_id": ..., "paths": {node name: checkpoint dir}} to resume from
        self.notes: list[str] = []  # what the report lacks or took from elsewhere, and why
        self.drop, self.seed, self.node_ram = drop, seed, node_ram
        self.children: list[Child] = []
        self.admin: ControllerClient | None = None  # set by start(), None again after stop()
        self.token = secrets.token_hex(16)
        self.address = ""
        self.job_id = ""
        self.job_token = ""
        self.node_names = [f"node{i}" for i in range(nodes)]
        self.stats_file = self.dir / "switch-stats.json"  # the switch's own counters: the report needs no controller
        self.restart: list[str] = []  # per node: the command that restarts it from its newest checkpoint
        self.node_controls: list[str] = []
        self.metrics: dict[str, str] = {}  # component -> HOST:PORT of its /metrics (Prometheus)
        self.node_rates: dict[str, dict] = {}  # node -> the params/s it registered and where that came from

    def start(self, layers: list[tuple[int, int]], optimizer: dict, served_dtype: str) -> ControllerFabric:
        from luwu.controller.client import ControllerClient
        from luwu.proto import controller_pb2 as pb

        token_file = self.dir / "token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        self.address = f"127.0.0.1:{free_tcp_port()}"
        self.metrics["controller"] = f"127.0.0.1:{free_tcp_port()}"  # it prints no JSON ready line: pick the port
        ctl = Child("the controller", luwu_command() + ["controller", "--listen", self.address, "--db",
                                                          str(self.dir / "controller.sqlite"), "--token-file",
                                                          str(token_file), "--metrics", self.metrics["controller"]],
                    log=self.dir / "controller.log")
        self.children.append(ctl)
        self.admin = ControllerClient(self.address, self.token)
        self._wait_controller(ctl)
        for name in self.node_names:  # placeholders for the planner; each node re-registers itself when it starts
            self.admin.register_node(pb.Node(name=name, data_address=f"127.0.0.1:{free_udp_port()}",
                                             capacity=pb.NodeCapacity(params_per_second=NODE_PARAMS_PER_SECOND,
                                                                      ram_bytes=self.node_ram,
                                                                      disk_bytes=NODE_DISK_BYTES)))
        # the switch reports each port's address (HOST:PORT or shm:/dev/shm/NAME) in its registration; the
        # controller's plans hand it to the workers and nodes, whose engines open that transport
        spec = "shm" if self.transport == "shm" else "127.0.0.1:0"
        ports = [a for p in range(1, self.workers + self.nodes + 1) for a in ("--port", f"{p}={spec}")]
        node_ports = [a for i, name in enumerate(self.node_names)
                      for a in ("--node-port", f"{self.workers + 1 + i}={name}")]
        drop = ["--drop", f"all:ingress={self.drop},egress={self.drop}"] if self.drop else []
        switch = Child("the software switch", luwu_command() + [
            "switch", "--lanes", str(self.lanes), "--slots", str(SWITCH_SLOTS), "--seed", str(self.seed), *ports,
            "--p4runtime", "127.0.0.1:0", "--controller", self.address, "--token-file", str(token_file),
            "--name", "demo-switch", *node_ports, *drop, "--stats-file", str(self.stats_file),
            "--metrics", "127.0.0.1:0"],
            log=self.dir / "switch.log")
        self.children.append(switch)
        self.switch_info = switch.read_json_line(READY_TIMEOUT)
        if self.switch_info.get("metrics"):
            self.metrics["switch"] = str(self.switch_info["metrics"])
        job = pb.Job(name="demo", num_workers=self.workers, packet_mode=str(self.lanes), num_nodes=self.nodes,
                     layers=[pb.LayerSpec(layer_id=lid, numel=n) for lid, n in layers],
                     optimizer=pb.OptimizerSpec(name=optimizer["name"], params=optimizer["params"],
                                                param_dtype=served_dtype))
        created, self.job_token = self.admin.create_job(job)
        self.job_id = created.job_id
        if self.restore and self.job_id != self.restore["job_id"]:  # the nodes bind restored jobs by id
            raise RuntimeError(f"--resume: the checkpoints hold job {self.restore['job_id']!r}, but the controller "
                               f"planned {self.job_id!r}")
        for name in self.node_names:
            (plan,) = self.admin.node_plans(self.job_id, name, token=self.job_token)
            plan_path = self.dir / f"{name}-plan.json"
            plan_path.write_text(plan.to_json())
            control = f"unix:{self.dir / (name + '.sock')}"
            argv = ["node", "--plan", str(plan_path), "--state-dir", str(self.dir / f"{name}-state"), "--control",
                    control, "--ram-budget", str(self.node_ram), "--controller", self.address, "--token-file",
                    str(token_file), "--name", name, "--metrics", "127.0.0.1:0"]
            if self.checkpoints is not None:
                ckpt = self.checkpoints / name
                ckpt.mkdir(parents=True, exist_ok=True)
                (ckpt / "plan.json").write_text(plan.to_json())  # a restart needs the node's plan: keep it beside
                argv += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(self.checkpoint_every)]
                # the run's own paths (state, socket, token) go with it: the restart names what the user picks
                self.restart.append(" ".join(luwu_command() + [
                    "node", "--plan", str(ckpt / "plan.json"), "--checkpoint-dir", str(ckpt), "--restore", "latest",
                    "--checkpoint-every", str(self.checkpoint_every), "--state-dir", "STATE_DIR", "--control",
                    "unix:SOCKET", "--control-token-file", "TOKEN_FILE"]))
            if self.restore:
                argv += ["--restore", str(self.restore["paths"][name])]
            node = Child(f"optimizer node {name}", luwu_command() + argv, log=self.dir / f"{name}.log")
            self.children.append(node)
            ready = node.read_json_line(READY_TIMEOUT)
            self.node_controls.append(ready.get("control") or control)
            if ready.get("metrics"):
                self.metrics[f"node {name}"] = str(ready["metrics"])
            self.node_rates[name] = {"params_per_second": ready.get("params_per_second"),
                                     "source": ready.get("params_per_second_source")}
        return self

    def checkpoint_summary(self) -> dict:
        """{node: {"dir": ..., "newest": path or None, "version": the job's version in it}}."""
        from luwu.dataplane.optimizer.checkpoint_files import latest_checkpoint

        out: dict[str, dict] = {}
        if self.checkpoints is None:
            return out
        for name in self.node_names:
            newest = latest_checkpoint(self.checkpoints / name)
            version = None
            if newest is not None:
                try:
                    state = json.loads((newest / "manifest.json").read_text())["jobs"][0]["state"]
                    version = max(int(layer["version"]) for layer in state)
                except (OSError, ValueError, KeyError, IndexError):
                    pass
            out[name] = {"dir": str(self.checkpoints / name), "newest": str(newest) if newest else None,
                         "version": version}
        return out

    def _client(self) -> ControllerClient:
        if self.admin is None:
            raise RuntimeError("the controller fabric is not started (or already stopped)")
        return self.admin

    def _wait_controller(self, ctl: Child) -> None:
        from luwu.controller.client import ControllerUnreachable

        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                self._client().status()
                return
            except ControllerUnreachable:
                if not ctl.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the controller did not come up{ctl.log_hint()}") from None
                time.sleep(0.1)

    def worker_spec(self) -> dict:
        return {"controller": {"address": self.address, "token": self.job_token, "job_id": self.job_id,
                               "node_controls": self.node_controls}}

    def inspect_hint(self) -> str:
        """How to look at the running network: luwu-ctl, and one Prometheus endpoint per component
        (the workers print theirs as they come up, luwu/demo/command.py)."""
        scrape = "".join(f"\n  {metrics_line(who, addr)}" for who, addr in sorted(self.metrics.items()))
        return (f"LUWU_CONTROLLER={self.address} LUWU_TOKEN={self.token} luwu-ctl status   "
                f"(also: jobs, plan {self.job_id} --explain, counters){scrape}")

    def counters(self) -> dict:
        """Switch counters over P4Runtime, through the controller: {counter: {label: [packets, bytes]}}.
        Without a controller that answers, the switch's own stats file (rewritten every second), and
        a note in `notes` naming the controller."""
        from luwu.controller.client import ControllerRefused, ControllerUnreachable

        out: dict = {}
        try:
            for sw in self._client().counters():
                for v in sw.values:
                    out.setdefault(v.counter, {})[v.label] = [int(v.packets), int(v.bytes)]
            return out
        except (ControllerUnreachable, ControllerRefused) as exc:
            why = f"the controller {self.address} did not answer GetCounters ({str(exc)[:200]})"
        try:
            stats = json.loads(self.stats_file.read_text())["counters"]
        except (OSError, ValueError, KeyError) as exc:
            self.notes.append(f"switch_counters missing: {why}, and the switch's stats file {self.stats_file} is "
                              f"unreadable ({exc})")
            return {}
        self.notes.append(f"switch_counters from the switch's stats file (up to 1 s old), not P4Runtime: {why}")
        out = {}
        for counter, values in stats.items():  # the controller's shape: non-zero entries, sessions as "session N"
            if counter in ("ports", "stragglers"):  # not [packets, bytes] pairs, and not P4 counters
                continue
            label = (lambda k: f"session {k}") if counter == "session_packets" else (lambda k: k)
            kept = {label(k): v for k, v in values.items() if v[0] or v[1]}
            if kept:
                out[counter] = kept
        return out

    def node_stats(self) -> list[dict]:
        from luwu.dataplane.optimizer.control import ControlClient

        out = []
        for addr in self.node_controls:  # the admin token: a job token would be checked with the controller
            c = ControlClient(addr, token=self.token)
            try:
                out.append(c.stats())
            finally:
                c.close()
        return out

    def node_peak_rss(self) -> dict[str, int | None]:
        """{node: its process's peak RSS (VmHWM) so far}: read while the nodes run (None: /proc did not say)."""
        from .rss import vm_hwm_bytes

        return {c.name.removeprefix("optimizer node "): vm_hwm_bytes(c.proc.pid) for c in self.children
                if c.name.startswith("optimizer node ")}

    def stop(self) -> None:
        if self.admin is not None and self.job_id:
            try:
                self.admin.end_job(self.job_id)
            except Exception:  # noqa: BLE001 - the demo is going away either way
                pass
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self.admin is not None:
            self.admin.close()
            self.admin = None


class LocalFabric:
    """No controller: a StarPlan's switch (its own process) and the node(s) in this process."""

    kind = "embedded"

    def __init__(self, workdir: Path, workers: int, nodes: int, lanes: str, drop: float, seed: int, node_ram: int,
                 transport: str = "udp"):
        from luwu.worker.model_in_network.local import LocalNetwork

        drop_sim = {"ingress": drop, "egress": drop} if drop else None
        self.transport = transport
        self.net = LocalNetwork(workers, nodes, mode=lanes, drop=drop_sim, state_dir=Path(workdir) / "local",
                                job_id="demo", seed=seed, node_ram=node_ram, transport=transport)
        self.workers = workers

    def start(self, layers: list[tuple[int, int]], optimizer: dict, served_dtype: str) -> LocalFabric:
        self.net.start()
        return self

    def worker_spec(self) -> dict:
        return {"networks": [self.net.network(r).to_json() for r in range(self.workers)]}

    def inspect_hint(self) -> str:
        return "no controller in this run (--no-controller): nothing for luwu-ctl to inspect"

    def counters(self) -> dict:
        """The switch's counters in the controller's shape: {counter: {label: [packets, bytes]}}."""
        from luwu.dataplane.protocol import DropReason, Event, MsgType

        raw = self.net.counters()
        names = {"drops": DropReason, "events": Event, "rx_types": MsgType}
        out: dict = {}
        for counter, enum in names.items():
            for code, (packets, nbytes) in raw.get(counter, {}).items():
                if packets:
                    label = enum(int(code)).name if int(code) in enum._value2member_map_ else str(code)
                    out.setdefault(counter, {})[label] = [int(packets), int(nbytes)]
        for sid, (packets, nbytes) in raw.get("session_packets", {}).items():
            out.setdefault("session_packets", {})[f"session {sid}"] = [int(packets), int(nbytes)]
        return out

    def node_stats(self) -> list[dict]:
        return self.net.node_stats()

    def node_peak_rss(self) -> dict[str, int | None]:
        """Empty: the nodes are threads of the demo's own process, whose RSS is not theirs alone."""
        return {}

    def stop(self) -> None:
        self.net.close()
