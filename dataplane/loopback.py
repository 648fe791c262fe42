"""A single-switch (star) deployment on loopback, planned without a controller.

This is the embedded default: the torch backend with no controller configured, the benchmarks
and the tests. Port p of the software switch is a pair of shared-memory packet rings in
/dev/shm (`transport="shm"`, the default where supported) or a UDP socket on 127.0.0.1
(`transport="udp"`, or `LUWU_TRANSPORT=udp`); worker r is wired to port r + 1 and optimizer node
i to port workers + 1 + i. The same plan yields the switch's
runtime JSON (docs/protocol.md 6.1) and every endpoint's `EndpointPlan`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from luwu.dataplane.p4runtime.entries import StarSession, star_program

from . import children
from .heap import freeze_collector, retain_freed_memory
from .protocol import NODE, aggregation_packet_len, lanes_for_mode
from .session import EndpointPlan, SessionSpec, Wiring

if TYPE_CHECKING:
    from .switch import SoftwareSwitch

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
    from .net.shm_ring import supported

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


def _build_switch(plan: StarPlan, drop: dict, seed: int, runtime: dict | None = None) -> SoftwareSwitch:
    from .switch import SoftwareSwitch, SwitchConfig

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


_spare_lock = threading.Lock()
_spare: dict[str, subprocess.Popen] = {}  # log path -> a switch process `prestart` launched, not yet given a plan


def _launch(log_path: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            children.python_module("luwu.dataplane.loopback"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", LUWU_NO_BACKEND="1"))


def _close_pipes(proc: subprocess.Popen) -> None:
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass


class LoopbackSwitch:
    """The software switch of a `StarPlan`, in a thread of this process or in a child process.

    `drop` takes the drop simulator's per-port probabilities (ingress, egress, duplicate, reorder),
    applied to every port; `runtime` replaces the plan's table entries (tests of misconfiguration).
    The child process (`process=True`) is a plain subprocess driven through its stdin, not
    multiprocessing's spawn (which would re-import the caller's `__main__`); it exits when its
    stdin closes, so it never outlives its parent, and it logs to `log_path`. `host`: a started
    process=True switch whose child process also runs this one (a thread there, no new process:
    the torch backend's new_group); stopping the host's own switch stops the process, and with it
    every switch it hosts. `LoopbackSwitch.prestart(log_path)` launches the child before the plan
    is known (its interpreter and imports load meanwhile; its compiled kernels load once it has
    answered its plan); the next process=True start with that log path takes it.
    """

    READY_TIMEOUT = 60.0
    log_path: str  # declared here: a hosted switch reads its host's in __init__

    def __init__(self, plan: StarPlan, process: bool = False, drop: dict | None = None, seed: int = 0,
                 runtime: dict | None = None, log_path: str | None = None, host: LoopbackSwitch | None = None):
        self._host, self._id = host, 0  # hosted: the host's child runs this switch as number _id
        if host is not None:
            process, log_path = True, host.log_path
        self.plan = plan
        self.process = process
        self.drop = drop or {}
        self.seed = seed
        self.runtime = runtime
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"luwu-switch-{os.getpid()}-{id(self)}.log")
        self._sw: SoftwareSwitch | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> LoopbackSwitch:
        self.plan.assign_endpoints()  # here, so the parent's plan holds them when the switch is a child
        if not self.process:
            self._sw = _build_switch(self.plan, self.drop, self.seed, self.runtime)
            self._sw.start()
            return self
        if self._host is not None:
            return self._start_hosted(self._host)
        self._proc = self._take_spare(self.log_path) or _launch(self.log_path)
        request = {"plan": json.loads(plan_to_json(self.plan)), "drop": self.drop, "seed": self.seed,
                   "runtime": self.runtime}
        reply = self._ask(json.dumps(request), self.READY_TIMEOUT)
        if not reply or "switch_ports" not in reply:
            self.stop()
            raise RuntimeError(f"the luwu software switch did not start (exit code {self._exit_code()}); "
                               f"its log {self.log_path} says:\n{children.tail(self.log_path)}")
        self.plan.switch_ports.update({int(k): (v[0], int(v[1])) for k, v in reply["switch_ports"].items()})
        return self

    @staticmethod
    def prestart(log_path: str) -> None:
        """Launch a switch process now, without a plan and without waiting for it: it imports the
        switch while the caller works out the plan (the torch backend's rank 0 does this first
        thing in init_process_group; its compiled kernels load later, `load_kernels`). The next
        `start()` of a process=True switch logging to `log_path` takes it; `discard_prestarted`
        stops one nobody took. Idempotent per log path while the process lives."""
        with _spare_lock:
            proc = _spare.get(log_path)
            if proc is None or proc.poll() is not None:
                _spare[log_path] = _launch(log_path)

    @staticmethod
    def discard_prestarted(log_path: str) -> None:
        """Stop the process `prestart(log_path)` launched if no switch took it (the caller's set-up
        failed before it started its switch)."""
        with _spare_lock:
            proc = _spare.pop(log_path, None)
        if proc is not None:
            _close_pipes(proc)  # EOF on its stdin: it exits by itself
            children.stop(proc, grace=children.STOP_GRACE)

    @staticmethod
    def _take_spare(log_path: str) -> subprocess.Popen | None:
        with _spare_lock:
            proc = _spare.pop(log_path, None)
        if proc is not None and proc.poll() is not None:  # it died waiting: its log says why; start afresh
            _close_pipes(proc)
            return None
        return proc

    def _start_hosted(self, host: LoopbackSwitch) -> LoopbackSwitch:
        request = {"op": "add", "plan": json.loads(plan_to_json(self.plan)), "drop": self.drop, "seed": self.seed,
                   "runtime": self.runtime}
        reply = host._ask(json.dumps(request), self.READY_TIMEOUT) if host.alive() else None
        if not reply or "switch_ports" not in reply:
            raise RuntimeError(f"the luwu switch process (pid {host.pid}) could not start another switch: "
                               f"{(reply or {}).get('error', 'no answer')}; its log {self.log_path} says:\n"
                               f"{children.tail(self.log_path)}")
        self._id = int(reply["id"])
        self.plan.switch_ports.update({int(k): (v[0], int(v[1])) for k, v in reply["switch_ports"].items()})
        return self

    def _exit_code(self):
        if self._host is not None:
            return self._host._exit_code()
        return None if self._proc is None else self._proc.poll()

    def _ask(self, line: str, timeout: float) -> dict | None:
        if self._host is not None:
            return self._host._ask(line, timeout)
        result: list = []
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            return None  # no child (not started, or stopped): nobody to answer
        stdin, stdout = proc.stdin, proc.stdout

        def talk() -> None:
            try:
                stdin.write(line + "\n")
                stdin.flush()
                answer = stdout.readline()
                if answer:
                    result.append(json.loads(answer))
            except (OSError, ValueError):
                pass

        with self._lock:
            t = threading.Thread(target=talk, daemon=True)
            t.start()
            t.join(timeout)
        return result[0] if result else None

    def kill(self) -> None:
        """Kill the switch process abruptly (tests of failure handling)."""
        if self._host is not None:
            self._host.kill()
        if self._proc is not None:
            children.stop(self._proc, grace=0)
            self._remove_rings(self._proc.pid)

    @property
    def pid(self) -> int:
        if self._host is not None:
            return self._host.pid
        return os.getpid() if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        if self._sw is not None:
            return True
        if self._host is not None:
            return self._id > 0 and self._host.alive()
        return self._proc is not None and self._proc.poll() is None

    def counters(self, timeout: float = 10.0) -> dict | None:
        if self._sw is not None:
            return self._sw.counters()
        if self._host is not None:
            return self._ask(json.dumps({"op": "counters", "id": self._id}), timeout) if self.alive() else None
        return self._ask("counters", timeout) if self.alive() else None

    def load_kernels(self) -> None:
        """Tell the switch process to load its compiled kernels now rather than `KERNELS_DEFER` s
        after its start: its job's start-up is over (the torch backend calls this after the start
        barrier). Nothing for a switch in this process or hosted by another one."""
        if self._proc is not None and self._host is None and self.alive():
            self._ask("load-kernels", 10.0)

    def wait_kernels(self, timeout: float = 120.0) -> bool | None:
        """Wait until the switch process has loaded its compiled lane kernels (it starts with the
        numpy reference, the same bits, while they load in the background). Returns whether
        compiled kernels run, None for a switch in this process or hosted by another one."""
        if self._proc is None or self._host is not None or not self.alive():
            return None
        answer = self._ask("kernels", timeout + 5.0)
        return None if answer is None else bool(answer.get("compiled"))

    def stop(self) -> None:
        if self._host is not None:
            if self.alive():
                self._ask(json.dumps({"op": "stop", "id": self._id}), 10.0)
            self._id = 0
            return
        if self._sw is not None:
            self._sw.stop()
            self._sw = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._ask("stop", 10.0)
            _close_pipes(self._proc)
            children.stop(self._proc, grace=10.0)
            pid, self._proc = self._proc.pid, None
            self._remove_rings(pid)

    def _remove_rings(self, pid: int) -> None:
        """A child switch that was killed could not unlink its shared-memory rings (nor its
        multicast pools, named after its pid): do it for it."""
        if self.plan.transport != "shm":
            return
        for path in glob.glob(f"/dev/shm/luwu-sw-{pid}-mc*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for prefix, _ in self.plan.switch_ports.values():
            for suffix in (".up", ".up.bell", ".down", ".down.bell"):
                path = prefix + suffix
                if os.path.dirname(path) == "/dev/shm" and os.path.basename(path).startswith("luwu-sw-"):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass

    def __enter__(self) -> LoopbackSwitch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve_stdin() -> int:
    """Body of LoopbackSwitch(process=True): a request line, then `counters` / `stop` until EOF."""
    # before the request: a prestarted process imports the switch while its parent works out the plan
    from . import switch  # noqa: F401

    go = threading.Event()  # the kernels load once set (`load-kernels`, `kernels`) or after KERNELS_DEFER s
    _load_kernels(after=go)  # registered now (the datapath runs the reference until then), loaded after
    first = sys.stdin.readline()
    if not first:
        return 1
    req = json.loads(first)
    plan = plan_from_json(req["plan"])
    from luwu.dataplane import trace

    trace.start("switch (loopback)")  # with LUWU_TRACE_DIR, like `luwu switch` (docs/observability.md)
    retain_freed_memory()  # a process of its own: keep the turns' temporaries mapped (heap.py)
    freeze_collector()  # and keep start-up objects out of the collector's traversals (heap.py)
    sw = _build_switch(plan, req.get("drop") or {}, int(req.get("seed", 0)), req.get("runtime"))
    sw.start()
    print(json.dumps({"switch_ports": {str(k): list(v) for k, v in plan.switch_ports.items()}}), flush=True)
    hosted: dict[int, SoftwareSwitch] = {}  # id -> switch started by {"op": "add"} (LoopbackSwitch(host=...))
    try:
        for line in sys.stdin:  # EOF: the parent is gone
            cmd = line.strip()
            if cmd == "counters":
                print(json.dumps(sw.counters(), default=str), flush=True)
            elif cmd == "load-kernels":  # the job's start-up is over: load them now
                go.set()
                print(json.dumps({"loading": True}), flush=True)
            elif cmd == "kernels":  # block until the compiled kernels are in (benchmarks' steady state)
                from .kernels import use_numba, wait_loaded

                go.set()
                wait_loaded(KERNELS_TIMEOUT)
                print(json.dumps({"compiled": use_numba()}), flush=True)
            elif cmd == "stop":
                trace.flush()  # before answering: the parent may SIGTERM this process as soon as it reads it
                print(json.dumps({"stopped": True}), flush=True)
                break
            elif cmd.startswith("{"):
                print(json.dumps(_hosted_request(json.loads(cmd), hosted), default=str), flush=True)
    finally:
        for other in hosted.values():
            other.stop()
        sw.stop()
    return 0


def _load_kernels(after: threading.Event) -> None:
    """Load the switch's compiled lane kernels (numba: ~0.5 s of CPU) in the background
    (dataplane/kernels `load_in_background`) once `after` is set (or `KERNELS_DEFER` s have
    passed); until they are in, the aggregations run the numpy reference (same bits), and
    `use_numba()` says so without importing numba. The loading waits for the job's start-up
    (`LoopbackSwitch.load_kernels`, after the torch backend's start barrier): its thread holds the
    GIL for most of numba's import and, at low priority on a busy host, would stall the switch's
    start-up and first aggregations, which every rank's init_process_group waits for."""
    from .kernels import load_in_background

    def load() -> None:
        after.wait(KERNELS_DEFER)  # before the imports: switch_lanes imports numba
        from .heap import refreeze
        from .kernels.switch_lanes import warm_up

        warm_up()
        refreeze()  # the switch process froze its start-up objects: numba's are long-lived too (heap.py)

    load_in_background(load, "luwu-switch-kernels-load")


def _hosted_request(req: dict, hosted: dict[int, SoftwareSwitch]) -> dict:
    """add / counters / stop of a switch this process hosts besides its own."""
    op = req.get("op")
    try:
        if op == "add":
            plan = plan_from_json(req["plan"])
            other = _build_switch(plan, req.get("drop") or {}, int(req.get("seed", 0)), req.get("runtime"))
            other.start()
            key = max(hosted, default=0) + 1
            hosted[key] = other
            return {"id": key, "switch_ports": {str(k): list(v) for k, v in plan.switch_ports.items()}}
        found = hosted.get(int(req.get("id", 0)))
        if found is None:
            return {"error": f"no hosted switch {req.get('id')!r}"}
        if op == "counters":
            return found.counters()
        if op == "stop":
            hosted.pop(int(req["id"])).stop()
            return {"stopped": True}
        return {"error": f"unknown request {op!r}: add, counters or stop"}
    except Exception as e:  # noqa: BLE001 - a bad request fails alone; the other switches keep running
        return {"error": f"{type(e).__name__}: {e}"}


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


if __name__ == "__main__":
    sys.exit(_serve_stdin())
