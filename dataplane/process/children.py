"""Child processes the project starts (engine daemons, the loopback switch, the demo's and the
Mininet runner's children): started so that they die with their parent, stopped for sure, and
their logs quoted in errors. One helper, so every launcher stops and reports children alike.

- `python_module(module, *args)`: the argv that runs `python -m module` with this interpreter, safe
  from a folder that shadows the package: every launch of a luwu module goes through it, so
  tests/test_layering.py reads the name it starts as an import of that module.
- `die_with_parent(argv)`: Linux SIGTERMs the child when the process that started it dies, even
  by SIGKILL (PR_SET_PDEATHSIG set by a tiny prelude that then exec's argv, or runs a
  `python_module` itself: one interpreter per child), so no daemon outlives its worker.
- `stop(proc)`: SIGTERM, a bounded grace period, SIGKILL; to the process group when the child
  leads one (its own children go too). Never by name.
- `tail(path)`: the end of a log, for error messages that say where to look.
- `cpu_seconds(pid)`, `descendants(pid)`: what a process and the ones it started have used (the
  benchmarks' and the demo's CPU accounting).
- `LineChild`: a started child that speaks JSON lines on stdout (a daemon's `{"ready": true, ...}`,
  a worker's events), read by a thread; `expect(event, deadline)` waits for one and names the
  child, its exit code and its log when it fails instead. The demo and the Mininet runner start
  their children their own way (a namespace, a session) and wrap them in it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

STOP_GRACE = 5.0  # s a child gets between SIGTERM and SIGKILL
KILL_WAIT = 10.0  # s to reap a child after SIGKILL

# argv[1] is the parent's pid (the parent may die before prctl: then exit), argv[2:] the command
_PRELUDE = ("import ctypes, os, signal, sys\n"
            "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
            "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
            "os.execvp(sys.argv[2], sys.argv[2:])\n")
# the same for a python_module argv in one interpreter (no exec of a second one, ~20 ms of CPU per child):
# argv[2:] is the module and its arguments, run as `python -m` runs it (sys.argv[0] its file)
_MODULE_PRELUDE = ("import ctypes, os, runpy, signal, sys\n"
                   "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
                   "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
                   "sys.argv = sys.argv[2:]\n"
                   "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


# Python < 3.11 has no -P: run the module through runpy after dropping the current directory
_SAFE_PATH_PRELUDE = ("import runpy, sys\n"
                      "del sys.path[0]  # the current directory: a luwu/ folder there would shadow the package\n"
                      "sys.argv = sys.argv[1:]\n"
                      "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def python_module(module: str, *args: str) -> list[str]:
    """The argv that runs `module` as ``python -m module *args`` with this interpreter.

    The current directory is not put on the child's ``sys.path`` (``-P``; on Python 3.10 a small
    runpy prelude does the same): started from a repository root, ``python -m luwu...`` would
    otherwise import the root's ``luwu/`` folder instead of the installed package ("No module
    named 'luwu.dataplane'"). Launch every luwu module through this helper with the module name as
    a string literal: tests/test_layering.py counts the call as an import of that module.

    Args:
        module: the module to run, e.g. ``"luwu.dataplane.engine.daemon"``.
        *args: its command-line arguments.

    Returns:
        The argv, for ``subprocess.Popen`` or `die_with_parent`.

    Examples:
        >>> subprocess.run(python_module("luwu.cli", "--version"), check=True)  # doctest: +SKIP
    """
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", _SAFE_PATH_PRELUDE, module, *args]


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` wrapped so the child gets SIGTERM when this process dies.

    Args:
        argv: the command, e.g. ``python_module("luwu.dataplane.engine.daemon", ...)``.

    Returns:
        The argv to pass to ``subprocess.Popen``. A `python_module` argv runs in the interpreter
        that sets the signal (as ``-P -c`` with a runpy prelude, the module's name and arguments
        after this pid); any other command is exec'd by a small prelude interpreter.
    """
    if len(argv) > 3 and argv[:3] == [sys.executable, "-P", "-m"]:
        return [sys.executable, "-P", "-c", _MODULE_PRELUDE, str(os.getpid()), *argv[3:]]
    return [sys.executable, "-c", _PRELUDE, str(os.getpid()), *argv]


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE, group: bool = False) -> int | None:
    """End `proc` for sure: SIGTERM, up to `grace` seconds, then SIGKILL.

    Args:
        proc: the child.
        grace: seconds between SIGTERM and SIGKILL.
        group: signal the child's process group (it was started with ``start_new_session=True``);
            whatever is left of the group gets SIGKILL even when the leader ended in time.

    Returns:
        The child's exit code (None only if it was not reaped within KILL_WAIT s of SIGKILL).
    """
    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    if proc.poll() is None:
        send(signal.SIGTERM)
        if grace > 0:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
    if group or proc.poll() is None:  # a group may outlive its leader (e.g. an engine daemon)
        send(signal.SIGKILL)
    try:
        code = proc.wait(KILL_WAIT)
    except subprocess.TimeoutExpired:
        return None
    if group:  # SIGKILL is delivered, not yet done: wait (bounded) until the group's last member is gone
        deadline = time.monotonic() + KILL_WAIT
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.01)
    return code


def join_or_kill(procs: Sequence[Any], timeout: float = 30.0) -> None:
    """Wait up to `timeout` s for each multiprocessing process of `procs`, then kill what is left
    (and wait 10 s more for it): spawned ranks never outlive the run that started them."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(10)


def close_pipes(proc: subprocess.Popen) -> None:
    """Close our ends of a child's stdin/stdout pipes (after it ended; a reader thread then sees EOF)."""
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except (OSError, ValueError):
            pass


def tail(path: str | os.PathLike, chars: int = 2000) -> str:
    """The last `chars` characters of a log file, or why it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace").strip() or "(empty)"
    except OSError as e:
        return f"(cannot read it: {e})"


def cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` (all its threads, exited ones too) has used so far; 0.0 if it is
    gone. Read from the process's CPU-time clock (Linux: clock_getcpuclockid's clock id, computed
    as glibc does, nanoseconds), else user + system time from /proc/PID/stat in 10 ms ticks."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except (OSError, AttributeError):
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def descendants(pid: int) -> dict[int, str]:
    """Every live process started (directly or not) by `pid`: {pid: its command line} (Linux /proc;
    {} elsewhere)."""
    parent: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parent[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    kids: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        kids.setdefault(ppid, []).append(child)
    out: dict[int, str] = {}
    todo = list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                out[p] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        todo += kids.get(p, [])
    return out


class LineChild:
    """A started child whose stdout carries JSON lines (its stderr goes to `log`).

    A reader thread hands every JSON object line to `on_message` if one is given, else to a queue
    that `expect` reads; every line is kept in `lines`. `stop()` ends the child's process group
    (start it with ``start_new_session=True``, text-mode stdout and, for `tell`, stdin pipes).

    Args:
        name: how errors name it ("the software switch", "worker 2").
        proc: the started child.
        log: the file its stderr goes to, quoted in errors.
        on_message: called on the reader thread with each JSON object the child prints.
    """

    Error: type[Exception] = RuntimeError  # what expect raises (a launcher may pick its own)

    def __init__(self, name: str, proc: subprocess.Popen, log: str | os.PathLike | None = None,
                 on_message: Callable[[dict], None] | None = None):
        self.name = name
        self.proc = proc
        self.log = Path(log) if log is not None else None
        self.lines: list[str] = []
        self.events: queue.Queue = queue.Queue()
        self._on_message = on_message
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            self._read_lines()
        except (OSError, ValueError):  # stdout closed by stop()
            pass
        self.events.put(None)  # EOF

    def _read_lines(self) -> None:
        if self.proc.stdout is not None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if not line.lstrip().startswith("{"):
                    continue
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(msg, dict):
                    (self._on_message or self.events.put)(msg)

    def expect(self, event: str, deadline: float) -> dict:
        """The child's next `event` line (`{"event": event, ...}`, or `{"ready": true, ...}` for
        "ready"); an `error` line, its exit or the deadline (time.monotonic()) raise `Error`
        naming the child and its log."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise self.Error(f"{self.name}: no {event!r} within the time limit{self.log_hint()}")
            try:
                msg = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                try:
                    code: int | str = self.proc.wait(timeout=STOP_GRACE)
                except subprocess.TimeoutExpired:
                    code = "still running, stdout closed"
                raise self.Error(f"{self.name} exited ({code}) before {event!r}{self.log_hint()}")
            if msg.get("event") == "error":
                raise self.Error(f"{self.name}: {msg.get('error')}{self.log_hint()}")
            if msg.get("event", "ready" if msg.get("ready") else None) == event:
                return msg

    def tell(self, line: str) -> None:
        """Write a line to its stdin (ignored if it already ended: `expect` reports how)."""
        if self.proc.stdin is None:  # started without a stdin pipe
            return
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def tail(self, lines: int = 5) -> str:
        """The last lines of its log, joined with " | " (empty if none)."""
        if self.log is None:
            return ""
        text = tail(self.log)
        return "" if text.startswith("(") else " | ".join(text.splitlines()[-lines:])

    def log_hint(self) -> str:
        """"; its last output: ...; its log PATH ends with: ..." for error messages."""
        out = f"; its last output: {' | '.join(line[:200] for line in self.lines[-3:])}" if self.lines else ""
        if self.log is None or not self.log.exists():
            return out
        end = tail(self.log).splitlines()[-8:]
        return out + f"; its log {self.log} ends with:\n  " + "\n  ".join(end)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def join_reader(self, timeout: float) -> None:
        self._reader.join(timeout)

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """End it and whatever it started (its process group); returns its exit code."""
        code = stop(self.proc, grace, group=True)
        close_pipes(self.proc)
        return code
