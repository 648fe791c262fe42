"""The runner's child processes: started in a namespace, read line by line, stopped for sure.

Each `Child` (a `dataplane.process.children.LineChild`) has its stdout read by a thread into a queue of
JSON events (other lines are kept for the log), its stderr in a log file, and its stdin open for
the runner's `go` / `stop`.
`ChildGroup.close()` ends every child it started: SIGTERM, a bounded grace period, SIGKILL,
by process id (never by name). Every wait takes a deadline.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from luwu.dataplane.process import children

from .nsexec import popen_in

STOP_GRACE = children.STOP_GRACE


class ChildError(RuntimeError):
    """A child failed, said so, or did not answer in time; the message names it and its log."""


class Child(children.LineChild):
    """A runner's child, started in a namespace (or on the host) in its own session."""

    Error = ChildError

    def __init__(self, name: str, argv: list[str], ns_path: str | None, log_dir: Path, env: dict | None = None):
        log = log_dir / f"{name}.log"
        with open(log, "w") as log_file:
            try:
                proc = popen_in(ns_path, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                text=True, env=env, start_new_session=True)
            except OSError as e:
                raise ChildError(f"{name}: cannot start {argv[0]}: {e}") from None
        super().__init__(name, proc, log)


class ChildGroup:
    def __init__(self, log_dir: Path, env: dict | None = None):
        self.log_dir = log_dir
        self.env = env
        self.children: list[Child] = []
        self.started: dict[int, str] = {}  # pid -> name of every child ever started (the trace's labels)

    def start(self, name: str, argv: list[str], ns_path: str | None = None) -> Child:
        child = Child(name, argv, ns_path, self.log_dir, self.env)
        self.children.append(child)
        self.started[child.proc.pid] = name
        return child

    def close(self, which: Callable[[Child], bool] | None = None) -> dict[str, int | None]:
        """Stop every child (or those `which(child)` picks), newest first; returns their exit codes."""
        codes = {}
        for child in reversed(self.children):
            if which is None or which(child):
                codes[child.name] = child.stop()
        self.children = [c for c in self.children if c.name not in codes]
        return codes
