"""A single-switch (star) deployment on loopback, planned without a controller.

This is the embedded default: the torch backend with no controller configured, the benchmarks
and the tests. Port p of the software switch is a UDP socket on 127.0.0.1; worker r is wired
to port r + 1 and optimizer node i to port workers + 1 + i. The same plan yields the switch's
runtime JSON (docs/protocol.md 6.1) and every endpoint's `EndpointPlan`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .protocol import NODE, NextStep, lanes_for_mode
from .session import EndpointPlan, SessionSpec, Wiring

META_SESSION = 1
DATA_SESSION = 2
FIRST_NODE_SESSION = 3


@dataclass
class StarPlan:
    workers: int
    nodes: int = 0
    mode: str | int = "jumbo"
    slots: int = 4096  # slots per set on the switch
    meta_pool: int = 32
    data_pool: int = 256
    node_pool: int = 256
    param_window: int = 256
    epoch: int = field(default_factory=lambda: random.getrandbits(32))
    host: str = "127.0.0.1"
    switch_ports: dict[int, tuple[str, int]] = field(default_factory=dict)  # filled once the switch is bound

    def __post_init__(self):
        if not 1 <= self.workers <= 32:
            raise ValueError(f"a star holds 1..32 workers (one bitmap), got {self.workers}")
        self.lanes = lanes_for_mode(self.mode)
        need = self.meta_pool + self.data_pool + self.nodes * self.node_pool
        if need > self.slots:
            raise ValueError(f"pools need {need} slots but the switch has {self.slots}: lower the pool sizes")

    # -- layout ------------------------------------------------------------------------------------
    def worker_port(self, rank: int) -> int:
        return rank + 1

    def node_port(self, index: int) -> int:
        return self.workers + 1 + index

    @property
    def ports(self) -> list[int]:
        return list(range(1, self.workers + self.nodes + 1))

    def sessions(self) -> list[SessionSpec]:
        n, lanes, e = self.workers, self.lanes, self.epoch
        specs = [
            SessionSpec(META_SESSION, "collective", e, 0, self.meta_pool, n, lanes, purpose="meta"),
            SessionSpec(DATA_SESSION, "collective", e, self.meta_pool, self.data_pool, n, lanes, purpose="data"),
        ]
        base = self.meta_pool + self.data_pool
        for i in range(self.nodes):
            specs.append(SessionSpec(FIRST_NODE_SESSION + i, "node", e, base + i * self.node_pool, self.node_pool, n,
                                     lanes, param_window=self.param_window, node_rank=i))
        return specs

    def node_session(self, index: int) -> int:
        return FIRST_NODE_SESSION + index

    # -- endpoint plans -----------------------------------------------------------------------------
    def _switch_addr(self, port: int) -> tuple[str, int]:
        if port not in self.switch_ports:
            raise RuntimeError(f"switch port {port} has no bound address yet: start the switch first")
        return self.switch_ports[port]

    def worker_plan(self, rank: int) -> EndpointPlan:
        port = self.worker_port(rank)
        wiring = Wiring(rank, "udp", (self.host, 0), self._switch_addr(port), port)
        return EndpointPlan(wiring, self.sessions())

    def node_plan(self, index: int) -> EndpointPlan:
        port = self.node_port(index)
        wiring = Wiring(NODE, "udp", (self.host, 0), self._switch_addr(port), port)
        return EndpointPlan(wiring, [s for s in self.sessions() if s.kind == "node" and s.node_rank == index])

    # -- the switch side ----------------------------------------------------------------------------
    def runtime(self) -> dict:
        """p4lang/tutorials-style runtime JSON for the switch."""
        entries = []
        for s in self.sessions():
            node = s.node_rank is not None
            entries.append({
                "table": "sessions", "match": {"session": s.session}, "action_name": "set_session",
                "action_params": {
                    "pool_base": s.pool_base, "pool_size": s.pool_size, "num_workers": self.workers,
                    "worker_mask": (1 << self.workers) - 1, "epoch": s.epoch, "mcast_grp": s.session,
                    "next_step": int(NextStep.ROOT), "up_port": self.node_port(s.node_rank) if node else 0,
                    "up_worker": 0,
                },
            })
            for rank in range(self.workers):
                entries.append({"table": "workers", "match": {"session": s.session, "worker": rank},
                                "action_name": "set_worker",
                                "action_params": {"worker_bit": 1 << rank, "port": self.worker_port(rank)}})
                entries.append(self._endpoint(s.session, rank, self.worker_port(rank)))
            if node:
                entries.append(self._endpoint(s.session, NODE, self.node_port(s.node_rank)))
        groups = [{"multicast_group_id": s.session,
                   "replicas": [{"egress_port": self.worker_port(r), "instance": r} for r in range(self.workers)]}
                  for s in self.sessions()]
        return {"target": "luwu-software-switch", "table_entries": entries, "multicast_group_entries": groups}

    def _endpoint(self, session: int, dst: int, port: int) -> dict:
        # on loopback the switch port decides the destination; addresses matter on Ethernet only
        return {"table": "endpoints", "match": {"session": session, "dst": dst}, "action_name": "set_endpoint",
                "action_params": {"dst_mac": port, "dst_ip": 0x7F000001, "dst_udp": 0}}


def free_udp_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _serve_switch(plan: StarPlan, drop: dict, seed: int, runtime: dict | None, conn) -> None:
    """Child-process body of LoopbackSwitch(process=True): run the switch until told to stop."""
    sw = _build_switch(plan, drop, seed, runtime)
    sw.start()
    conn.send(("ready", plan.switch_ports))
    while True:
        msg = conn.recv()
        if msg == "counters":
            conn.send(sw.counters())
        elif msg == "stop":
            sw.stop()
            conn.send("stopped")
            return


def _build_switch(plan: StarPlan, drop: dict, seed: int, runtime: dict | None = None):
    from .switch import SoftwareSwitch, SwitchConfig

    sw = SoftwareSwitch(SwitchConfig(lanes=plan.lanes, slots=plan.slots, seed=seed))
    for port in plan.ports:
        addr = plan.switch_ports.get(port) or (plan.host, free_udp_port(plan.host))
        sw.attach_udp(port, listen=addr)
        plan.switch_ports[port] = addr
        if drop:
            sw.set_drop_sim(port, **drop)
    sw.load_runtime(runtime or plan.runtime())
    return sw


class LoopbackSwitch:
    """The software switch of a `StarPlan`, in a thread of this process or in a child process.

    `drop` takes the drop simulator's per-port probabilities (ingress, egress, duplicate, reorder),
    applied to every port; `runtime` replaces the plan's table entries (tests of misconfiguration).
    """

    def __init__(self, plan: StarPlan, process: bool = False, drop: dict | None = None, seed: int = 0,
                 runtime: dict | None = None):
        self.runtime = runtime
        self.plan = plan
        self.process = process
        self.drop = drop or {}
        self.seed = seed
        self._sw = None
        self._proc = None
        self._conn = None

    def start(self) -> "LoopbackSwitch":
        if not self.process:
            self._sw = _build_switch(self.plan, self.drop, self.seed, self.runtime)
            self._sw.start()
            return self
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_switch, args=(self.plan, self.drop, self.seed, self.runtime, child), daemon=True)
        self._proc.start()
        if not parent.poll(60):
            self._proc.kill()
            raise RuntimeError("the software switch process did not come up within 60 s")
        _, ports = parent.recv()
        self.plan.switch_ports.update(ports)
        self._conn = parent
        return self

    def counters(self) -> dict:
        if self._sw is not None:
            return self._sw.counters()
        self._conn.send("counters")
        return self._conn.recv()

    def stop(self) -> None:
        if self._sw is not None:
            self._sw.stop()
            self._sw = None
        if self._proc is not None:
            try:
                self._conn.send("stop")
                self._conn.poll(10) and self._conn.recv()
            except (OSError, EOFError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc = None

    def __enter__(self) -> "LoopbackSwitch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def local_star(workers: int, nodes: int = 0, mode: str | int = "tofino", drop: dict | None = None, seed: int = 0,
               **plan_kw):
    """A context manager: a switch in this process and one started embedded engine per worker.

    Yields (plan, switch, engines). For tests, examples and quick experiments on one machine.
    """
    import contextlib

    from .engine import Engine

    @contextlib.contextmanager
    def _cm():
        plan = StarPlan(workers=workers, nodes=nodes, mode=mode, **plan_kw)
        with LoopbackSwitch(plan, drop=drop, seed=seed) as sw:
            engines = [Engine(plan.worker_plan(r)).start() for r in range(workers)]
            try:
                yield plan, sw, engines
            finally:
                for e in engines:
                    e.close()

    return _cm()
