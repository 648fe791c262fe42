"""Child processes of the demo: training workers (luwu.demo.worker) and daemons, started so that
they die with the demo.

Every child runs in its own session (process group), so whatever it starts (a worker's engine
daemon) is in that group too; `stop()` terminates the group, waits, then kills what is left. The
training workers (luwu's and the DDP baseline's) also get SIGTERM when the demo itself dies, even
by SIGKILL (`children.die_with_parent`): a killed demo leaves no rank behind.
Workers speak JSON lines on stdout; a reader thread per worker hands each message to a callback
and keeps the last `done` report. Plain subprocesses, not multiprocessing: nothing re-imports
the caller's `__main__`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from luwu.dataplane.process import children

STOP_GRACE = children.STOP_GRACE
POLL = 0.2  # s between checks while waiting for workers


def child_env(**extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", LUWU_NO_BACKEND="1", PYTHONUNBUFFERED="1", **extra)


def luwu_command() -> list[str]:
    """The installed `luwu` entry point beside this interpreter (not `python -m` from a checkout)."""
    script = Path(sys.executable).parent / "luwu"
    return [str(script)] if script.exists() else children.python_module("luwu.cli")


class Child(children.LineChild):
    """A subprocess in its own process group, its stderr in `log`, its stdout read as JSON lines."""

    def __init__(self, name: str, argv: list[str], log: Path | None = None,
                 on_message: Callable[[dict], None] | None = None):
        err = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=child_env(),
                                    start_new_session=True, text=True)
        finally:
            if not isinstance(err, int):  # the log we opened, not DEVNULL
                err.close()
        super().__init__(name, proc, log, on_message)

    def read_json_line(self, timeout: float) -> dict:
        """Its ready line (`{"ready": true, ...}`, as every luwu daemon prints), within `timeout` s."""
        return self.expect("ready", time.monotonic() + timeout)


class WorkerGroup:
    """N training workers on one spec file; `on_message(msg)` gets every JSON line they print."""

    def __init__(self, spec: dict, workdir: Path, name: str, on_message: Callable[[dict], None] | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.spec_path = self.workdir / f"{name}-spec.json"
        self.spec_path.write_text(json.dumps(spec))
        self.name = name
        self.on_message = on_message or (lambda msg: None)
        self.reports: dict[int, dict] = {}
        self.errors: dict[int, str] = {}
        self.warnings: list[dict] = []
        self.children: list[Child] = []
        self.workers = int(spec["workers"])

    def start(self) -> WorkerGroup:
        for rank in range(self.workers):
            log = self.workdir / f"{self.name}-worker{rank}.log"
            child = Child(f"{self.name} worker {rank}",
                          children.die_with_parent(children.python_module("luwu.demo.worker", str(self.spec_path),
                                                                          str(rank))), log=log,
                          on_message=functools.partial(self._message, rank, log))
            self.children.append(child)
        return self

    def _message(self, rank: int, log: Path, msg: dict) -> None:
        if msg.get("event") == "done":
            self.reports[rank] = msg["report"]
        elif msg.get("event") == "error":  # one line for the user (it names what died); the traceback to the log
            self.errors[rank] = msg.get("error", "failed")
            if msg.get("traceback"):
                with open(log, "a") as f:
                    f.write(msg["traceback"])
                self.errors[rank] += f" (traceback in {log})"
        elif msg.get("event") == "warning":  # e.g. the controller died: training goes on, the user is told
            self.warnings.append(msg)
        self.on_message(msg)

    def wait(self, timeout: float) -> dict[int, dict]:
        """Every rank's report; raises if a worker fails, exits without a report, or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.errors:
                rank, err = sorted(self.errors.items())[0]
                raise RuntimeError(f"{self.name} worker {rank} failed: {err}")
            exited = [c for c in self.children if not c.alive()]
            if len(exited) == len(self.children):
                for c in self.children:
                    c.join_reader(10)
                if self.errors:
                    continue
                missing = [r for r in range(self.workers) if r not in self.reports]
                if missing:
                    hint = self.children[missing[0]].log_hint()
                    raise RuntimeError(f"{self.name} worker(s) {missing} exited without a report{hint}")
                return self.reports
            for c in exited:
                if c.proc.returncode not in (0, None):
                    rank = self.children.index(c)
                    for ch in self.children:
                        ch.join_reader(1)
                    if rank not in self.errors:
                        raise RuntimeError(f"{self.name} worker {rank} exited with code {c.proc.returncode}"
                                           f"{c.log_hint()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} workers did not finish within {timeout} s")
            time.sleep(POLL)

    def stop(self) -> None:
        for c in self.children:
            c.stop()
