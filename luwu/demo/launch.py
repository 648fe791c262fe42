"""Child processes of the demo: training workers (luwu.demo.worker) and daemons, started so that
they die with the demo.

Every child runs in its own session (process group), so whatever it starts (a worker's engine
daemon) is in that group too; `stop()` terminates the group, waits, then kills what is left.
Workers speak JSON lines on stdout; a reader thread per worker hands each message to a callback
and keeps the last `done` report. Plain subprocesses, not multiprocessing: nothing re-imports
the caller's `__main__`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from luwu.dataplane import children

STOP_GRACE = children.STOP_GRACE
POLL = 0.2  # s between checks while waiting for workers


def child_env(**extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", LUWU_NO_BACKEND="1", PYTHONUNBUFFERED="1", **extra)


def luwu_command() -> list[str]:
    """The installed `luwu` entry point beside this interpreter (not `python -m` from a checkout)."""
    script = Path(sys.executable).parent / "luwu"
    return [str(script)] if script.exists() else [sys.executable, "-m", "luwu.cli"]


class Child:
    """A subprocess in its own process group."""

    def __init__(self, name: str, argv: list[str], log: Path | None = None, stdout=subprocess.PIPE):
        self.name = name
        self.log_path = log
        err = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(argv, stdout=stdout, stderr=err, env=child_env(), start_new_session=True,
                                         text=True)
        finally:
            if log is not None:
                err.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def read_json_line(self, timeout: float) -> dict:
        """The first JSON line on stdout (a daemon's `ready` line), within `timeout` seconds."""
        result: dict = {}

        def read():
            for line in self.proc.stdout:
                line = line.strip()
                if line.startswith("{"):
                    result.update(json.loads(line))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not result:
            self.stop()
            raise RuntimeError(f"{self.name} did not come up within {timeout} s{self._log_hint()}")
        return result

    def _log_hint(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-8:]
        return f"; its log {self.log_path} ends with:\n  " + "\n  ".join(tail) if tail else ""

    def stop(self, grace: float = STOP_GRACE) -> None:
        children.stop(self.proc, grace, group=True)  # the group may outlive its leader (an engine daemon)


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
        self._threads: list[threading.Thread] = []
        self.workers = int(spec["workers"])

    def start(self) -> WorkerGroup:
        for rank in range(self.workers):
            child = Child(f"{self.name} worker {rank}",
                          [sys.executable, "-m", "luwu.demo.worker", str(self.spec_path), str(rank)],
                          log=self.workdir / f"{self.name}-worker{rank}.log")
            self.children.append(child)
            t = threading.Thread(target=self._read, args=(rank, child), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _read(self, rank: int, child: Child) -> None:
        for line in child.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "done":
                self.reports[rank] = msg["report"]
            elif msg.get("event") == "error":  # one line for the user (it names what died); the traceback to the log
                self.errors[rank] = msg.get("error", "failed")
                if msg.get("traceback") and child.log_path is not None:
                    with open(child.log_path, "a") as log:
                        log.write(msg["traceback"])
                    self.errors[rank] += f" (traceback in {child.log_path})"
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
                for t in self._threads:
                    t.join(10)
                if self.errors:
                    continue
                missing = [r for r in range(self.workers) if r not in self.reports]
                if missing:
                    hint = self.children[missing[0]]._log_hint()
                    raise RuntimeError(f"{self.name} worker(s) {missing} exited without a report{hint}")
                return self.reports
            for c in exited:
                if c.proc.returncode not in (0, None):
                    rank = self.children.index(c)
                    for t in self._threads:
                        t.join(1)
                    if rank not in self.errors:
                        raise RuntimeError(f"{self.name} worker {rank} exited with code {c.proc.returncode}"
                                           f"{c._log_hint()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} workers did not finish within {timeout} s")
            time.sleep(POLL)

    def stop(self) -> None:
        for c in self.children:
            c.stop()
