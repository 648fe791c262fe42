"""The runner's child processes: started in a namespace, read line by line, stopped for sure.

Each `Child` has its stdout read by a thread into a queue of JSON events (other lines are kept
for the log), its stderr in a log file, and its stdin open for the runner's `go` / `stop`.
`ChildGroup.close()` ends every child it started: SIGTERM, a bounded grace period, SIGKILL,
by process id (never by name). Every wait takes a deadline.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path

from luwu.dataplane import children

from .nsexec import popen_in

STOP_GRACE = children.STOP_GRACE


class ChildError(RuntimeError):
    """A child failed, said so, or did not answer in time; the message names it and its log."""


class Child:
    def __init__(self, name: str, argv: list[str], ns_path: str | None, log_dir: Path, env: dict | None = None):
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._log_file = open(self.log, "w")
        try:
            self.proc = popen_in(ns_path, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self._log_file, text=True, env=env, start_new_session=True)
        except OSError as e:
            self._log_file.close()
            raise ChildError(f"{name}: cannot start {argv[0]}: {e}") from None
        self.events: queue.Queue = queue.Queue()
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict):
                self.events.put(msg)
        self.events.put(None)  # EOF

    def expect(self, event: str, deadline: float) -> dict:
        """The child's next `event` line (an `error` line, EOF or the deadline raise ChildError)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"{self.name}: no {event!r} within the time limit; see {self.log}")
            try:
                msg = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                try:
                    code = self.proc.wait(timeout=STOP_GRACE)
                except subprocess.TimeoutExpired:
                    code = "still running, stdout closed"
                raise ChildError(f"{self.name} exited ({code}) before {event!r}: {self.tail()}; see {self.log}")
            if msg.get("event") == "error":
                raise ChildError(f"{self.name}: {msg.get('error')}; see {self.log}")
            if msg.get("event", "ready" if msg.get("ready") else None) == event:
                return msg

    def tell(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # it already ended; expect() reports how

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log.read_text().strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        children.stop(self.proc, grace, group=True)  # its own session: children of it go too
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except (OSError, ValueError):
                pass
        self._log_file.close()
        return self.proc.returncode


class ChildGroup:
    def __init__(self, log_dir: Path, env: dict | None = None):
        self.log_dir = log_dir
        self.env = env
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], ns_path: str | None = None) -> Child:
        child = Child(name, argv, ns_path, self.log_dir, self.env)
        self.children.append(child)
        return child

    def close(self, which=None) -> dict[str, int | None]:
        """Stop every child (or those `which(child)` picks), newest first; returns their exit codes."""
        codes = {}
        for child in reversed(self.children):
            if which is None or which(child):
                codes[child.name] = child.stop()
        self.children = [c for c in self.children if c.name not in codes]
        return codes
