"""A whole model-in-network deployment on loopback, without a controller: the software switch of
a `StarPlan` (in its own process) and its optimizer node(s) (`OptimizerService`, in this process),
and a `JobNetwork` for every rank. For tests, examples and the demo's no-controller fallback.

    with LocalNetwork(workers=2, nodes=1, state_dir=tmp) as net:
        ... run worker r with ModelInNetwork(model, luwu.AdamW(...), net.network(r)) ...
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path
from typing import Any

from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.dataplane.optimizer.control import ControlAuth
from luwu.dataplane.optimizer.service import OptimizerService
from luwu.dataplane.optimizer.spec import NodeConfig

from .network import DEFAULT_JOB_ID, JobNetwork

DEFAULT_NODE_RAM = 256 << 20  # bytes of optimizer-node RAM for state and served copies


class LocalNetwork:
    def __init__(self, workers: int, nodes: int = 1, mode: str | int = "jumbo", drop: dict | None = None,
                 state_dir: str | Path | None = None, job_id: str = DEFAULT_JOB_ID, seed: int = 0,
                 node_ram: int = DEFAULT_NODE_RAM, switch_process: bool = True, **plan_kw: Any) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="luwu-mnn-")
            state_dir = self._tmp.name
        self.dir = Path(state_dir)
        self.plan = StarPlan(workers=workers, nodes=nodes, mode=mode, **plan_kw)
        self.switch = LoopbackSwitch(self.plan, process=switch_process, drop=drop, seed=seed)
        self.job_id = job_id
        self.node_ram = node_ram
        self.services: list[OptimizerService] = []
        self.control_token = secrets.token_urlsafe(32)  # the nodes' control channels take only this deployment

    def start(self) -> LocalNetwork:
        self.switch.start()
        try:
            for i in range(self.plan.nodes):
                cfg = NodeConfig(state_dir=self.dir / f"node{i}", ram_budget=self.node_ram)
                svc = OptimizerService(self.plan.node_plan(i), cfg)
                self.services.append(svc.start(control=f"unix:{self.dir}/node{i}.sock",
                                               auth=ControlAuth(token=self.control_token)))
        except BaseException:
            self.close()
            raise
        return self

    @property
    def controls(self) -> list[str]:
        out: list[str] = []
        for s in self.services:
            if s.control is None:  # start() gives every node one; None would be a bug here, not a user error
                raise RuntimeError("an optimizer node of this LocalNetwork has no control channel")
            out.append(s.control.address)
        return out

    def network(self, rank: int, placement: dict[int, int] | None = None) -> JobNetwork:
        return JobNetwork.from_star(self.plan, rank, self.controls, self.job_id, placement, self.control_token)

    def counters(self) -> dict:
        """The switch's counters (drops, events, rx_types, ...); RuntimeError once the switch is gone."""
        counters = self.switch.counters()
        if counters is None:  # the switch process is gone: say so rather than hand back no counters
            raise RuntimeError("the loopback switch is not running (stopped or exited): its counters cannot be read")
        return counters

    def node_stats(self) -> list[dict]:
        return [{"node": s.node.stats(), "engine": s.engine.session_stats()} for s in self.services]

    def close(self) -> None:
        for s in self.services:
            s.close()
        self.services.clear()
        self.switch.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalNetwork:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
