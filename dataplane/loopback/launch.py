"""Starting the software switch of a `StarPlan`: in a thread of this process, or in a child
process (daemon.py) driven over its stdin; and `local_star`, a switch with one engine per worker.

This is the embedded default: the torch backend with no controller configured, the benchmarks
and the tests.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import tempfile
import threading
from typing import TYPE_CHECKING

from ..process import children

if TYPE_CHECKING:
    from ..switch import SoftwareSwitch
    from .plan import StarPlan

# plan.py (the star's table entries) is imported where a switch starts, not here: `prestart`, the
# first thing the torch backend's rank 0 does in init_process_group, needs this module alone

_spare_lock = threading.Lock()
_spare: dict[str, subprocess.Popen] = {}  # log path -> a switch process `prestart` launched, not yet given a plan


def _launch(log_path: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            children.python_module("luwu.dataplane.loopback.daemon"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
        # a log named here is this object's to remove after a clean stop (a caller's path stays theirs)
        self._own_log = host is None and not log_path
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"luwu-switch-{os.getpid()}-{id(self)}.log")
        self._sw: SoftwareSwitch | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> LoopbackSwitch:
        from .plan import build_switch, plan_to_json

        self.plan.assign_endpoints()  # here, so the parent's plan holds them when the switch is a child
        if not self.process:
            self._sw = build_switch(self.plan, self.drop, self.seed, self.runtime)
            self._sw.start()
            return self
        if self._host is not None:
            return self._start_hosted(self._host)
        self._proc = self._take_spare(self.log_path) or _launch(self.log_path)
        request = {"plan": json.loads(plan_to_json(self.plan)), "drop": self.drop, "seed": self.seed,
                   "runtime": self.runtime}
        reply = self._ask(json.dumps(request), self.READY_TIMEOUT)
        if not reply or "switch_ports" not in reply:
            self._own_log = False  # kept: the error names it
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
        from .plan import plan_to_json

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
            clean = self._proc.poll() is None and self._ask("stop", 10.0) is not None
            _close_pipes(self._proc)
            children.stop(self._proc, grace=10.0)
            pid, self._proc = self._proc.pid, None
            self._remove_rings(pid)
            if clean and self._own_log:  # nothing to read after a clean stop: leave nothing in /tmp
                try:
                    os.unlink(self.log_path)
                except FileNotFoundError:
                    pass

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


def local_star(workers: int, nodes: int = 0, mode: str | int = "tofino", drop: dict | None = None, seed: int = 0,
               **plan_kw):
    """A context manager: a switch in this process and one started embedded engine per worker.

    Yields (plan, switch, engines). For tests, examples and quick experiments on one machine.
    """
    import contextlib

    from ..engine import Engine
    from .plan import StarPlan

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
