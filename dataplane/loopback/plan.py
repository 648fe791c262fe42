"""The plan of a single-switch (star) deployment on loopback, made without a controller.

Port p of the software switch is a pair of shared-memory packet rings in /dev/shm
(`transport="shm"`, the default where supported) or a UDP socket on 127.0.0.1 (`transport="udp"`,
or `LUWU_TRANSPORT=udp`); worker r is wired to port r + 1 and optimizer node i to port
workers + 1 + i. The same plan yields the switch's runtime JSON (docs/protocol.md 6.1), every
endpoint's `EndpointPlan`, and the switch itself (`build_switch`), which launch.py runs in a
thread or daemon.py in a process of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from luwu.dataplane.p4runtime.entries import StarSession, star_program

from ..protocol import NODE, aggregation_packet_len, lanes_for_mode
from ..session import EndpointPlan, SessionSpec, Wiring

if TYPE_CHECKING:
    from ..switch import SoftwareSwitch

IN_FLIGHT_BYTES = 4 << 20  # per stream, default window sizing
# A shm port's data window may be twice that when the job has no optimizer nodes: no socket
# buffer to fit, and a ring of 16 MiB (attach_shm.RING_BYTES, 256 rows of 64 KiB) still holds it
# with the meta session's window (128 + 32 rows). Bigger windows make bigger switch turns (more of a slot's
# contributions in one pass, the per-turn cost spread over more rows): the switch's CPU per
# 16 MiB allreduce of 4 workers fell from about 21 to 17 ms (16 MiB windows: no better).
SHM_DATA_IN_FLIGHT_BYTES = 8 << 20
META_SESSION = 1
DATA_SESSION = 2
FIRST_NODE_SESSION = 3
TRANSPORTS = ("shm", "udp")
KERNELS_TIMEOUT = 120.0  # s the switch process waits for its background kernel load when asked
KERNELS_DEFER = 5.0  # s after its start a switch process loads its kernels unless told sooner


def default_transport() -> str:
    """`LUWU_TRANSPORT` if set, else shared memory where rings are safe (Linux x86-64), else UDP."""
    from ..net.shm_ring import supported

    env = os.environ.get("LUWU_TRANSPORT", "").strip().lower()
    if env:
        if env not in TRANSPORTS:
            raise ValueError(f"LUWU_TRANSPORT={env!r}: use one of {', '.join(TRANSPORTS)}")
        if env == "shm" and not supported():
            raise ValueError("LUWU_TRANSPORT=shm: shared-memory rings need Linux on x86-64 with /dev/shm; use udp")
        return env
    return "shm" if supported() else "udp"


@dataclass
class StarPlan:
    workers: int
    nodes: int = 0
    mode: str | int = "loopback"  # 64 KiB datagrams: the per-packet cost of loopback UDP falls 2-3x vs 8 KiB
    slots: int = 4096  # slots per set on the switch
    meta_pool: int = 32
    data_pool: int = 0  # 0 (or None): as many packets as fit in IN_FLIGHT_BYTES (shm: SHM_DATA_...), at most 256
    node_pool: int = 0  # 0 (or None): as data_pool
    param_window: int = 0  # 0 (or None): as data_pool
    epoch: int = field(default_factory=lambda: random.getrandbits(32))
    host: str = "127.0.0.1"
    switch_ports: dict[int, tuple[str, int]] = field(default_factory=dict)  # filled once the switch is bound
    # udp: the address each port's endpoint binds (port -> (host, udp port)), the only source its switch
    # port accepts (docs/protocol.md 6.8); chosen by `assign_endpoints` before the switch starts
    endpoints: dict[int, tuple[str, int]] = field(default_factory=dict)
    # "shm": ports are ring pairs in /dev/shm (switch_ports[p] = (prefix, 0)); "udp": sockets on `host`
    transport: str = field(default_factory=default_transport)

    def _window(self, in_flight: int) -> int:
        """Packets of `in_flight` bytes, a power of two in 16..256."""
        return 1 << max(4, min(8, (in_flight // aggregation_packet_len(self.lanes)).bit_length() - 1))

    def __post_init__(self):
        if not 1 <= self.workers <= 32:
            raise ValueError(f"a star holds 1..32 workers (one bitmap), got {self.workers}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r}: use one of {', '.join(TRANSPORTS)}")
        self.lanes = lanes_for_mode(self.mode)
        # a window's packets must fit in the receivers' socket buffers (rmem_max is 4 MiB without root)
        fit = self._window(IN_FLIGHT_BYTES)
        # the bigger shm window only without nodes: each node adds a session of node_pool rows to
        # every worker's ring, which then could not hold all windows at once (a full ring loses)
        big = self.transport == "shm" and not self.nodes
        self.data_pool = self.data_pool or (self._window(SHM_DATA_IN_FLIGHT_BYTES) if big else fit)
        self.node_pool = self.node_pool or fit
        self.param_window = self.param_window or fit
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
    def assign_endpoints(self) -> None:
        """Give every port's endpoint a free UDP address on `host` (UDP transport; idempotent).

        The switch binds each port to that address and the endpoint binds it, so a port is never
        claimed by whoever sends first. The ports are free when chosen; if another process takes
        one before the endpoint binds it, the endpoint's bind fails (EADDRINUSE) -- loudly.
        """
        if self.transport != "udp":
            return
        missing = [p for p in self.ports if p not in self.endpoints]
        socks = [_bound_udp(self.host) for _ in missing]  # held together: the ports differ
        for port, sock in zip(missing, socks):
            self.endpoints[port] = (self.host, sock.getsockname()[1])
            sock.close()

    def _local(self, port: int) -> tuple[str, int]:
        return self.endpoints.get(port, (self.host, 0))

    def _switch_addr(self, port: int) -> tuple[str, int]:
        if port not in self.switch_ports:
            raise RuntimeError(f"switch port {port} has no bound address yet: start the switch first")
        return self.switch_ports[port]

    def worker_plan(self, rank: int) -> EndpointPlan:
        port = self.worker_port(rank)
        wiring = Wiring(rank, self.transport, self._local(port), self._switch_addr(port), port)
        return EndpointPlan(wiring, self.sessions())

    def node_plan(self, index: int) -> EndpointPlan:
        port = self.node_port(index)
        wiring = Wiring(NODE, self.transport, self._local(port), self._switch_addr(port), port)
        return EndpointPlan(wiring, [s for s in self.sessions() if s.kind == "node" and s.node_rank == index])

    # -- the switch side ----------------------------------------------------------------------------
    def runtime(self) -> dict:
        """p4lang/tutorials-style runtime JSON for the switch (built as every switch program is:
        luwu.dataplane.p4runtime.entries)."""
        sessions = [StarSession(s.session, s.pool_base, s.pool_size, s.epoch,
                                up_port=self.node_port(s.node_rank) if s.node_rank is not None else 0)
                    for s in self.sessions()]
        # on loopback the switch port decides where a packet goes; dst_udp names the address the port's
        # endpoint binds (0: none assigned), which a UDP port without a configured peer accepts (peers.py)
        cfg = star_program(self.workers, sessions, worker_port=self.worker_port,
                           endpoint=lambda dst, port: (port, 0x7F000001, self._local(port)[1]))
        return {**cfg.to_dict(), "target": "luwu-software-switch"}


def _bound_udp(host: str):
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, 0))
    return s


def free_udp_port(host: str = "127.0.0.1") -> int:
    with _bound_udp(host) as s:
        return s.getsockname()[1]


def plan_to_json(plan: StarPlan) -> str:
    d = dataclasses.asdict(plan)
    d["switch_ports"] = {str(k): list(v) for k, v in plan.switch_ports.items()}
    d["endpoints"] = {str(k): list(v) for k, v in plan.endpoints.items()}
    return json.dumps(d)


def plan_from_json(text: str | dict) -> StarPlan:
    d = json.loads(text) if isinstance(text, str) else dict(text)
    names = {f.name for f in dataclasses.fields(StarPlan)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"not a StarPlan: unknown keys {sorted(unknown)} (expected {sorted(names)})")
    d["switch_ports"] = {int(k): (str(v[0]), int(v[1])) for k, v in d.get("switch_ports", {}).items()}
    d["endpoints"] = {int(k): (str(v[0]), int(v[1])) for k, v in d.get("endpoints", {}).items()}
    return StarPlan(**d)


def build_switch(plan: StarPlan, drop: dict, seed: int, runtime: dict | None = None) -> SoftwareSwitch:
    """The software switch `plan` describes, its ports attached (their addresses written into
    `plan.switch_ports`), its drop simulator set on every port and its tables loaded; not started."""
    from ..switch import SoftwareSwitch, SwitchConfig

    sw = SoftwareSwitch(SwitchConfig(lanes=plan.lanes, slots=plan.slots, seed=seed))
    for port in plan.ports:
        if plan.transport == "shm":
            addr = (sw.attach_shm(port), 0)
        else:
            addr = plan.switch_ports.get(port) or (plan.host, free_udp_port(plan.host))
            plan.assign_endpoints()
            sw.attach_udp(port, listen=addr, peer=plan.endpoints[port])  # never learned: 6.8
        plan.switch_ports[port] = addr
        if drop:
            sw.set_drop_sim(port, **drop)
    sw.load_runtime(runtime or plan.runtime())
    return sw


