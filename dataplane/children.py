"""Child processes the project starts (engine daemons, the loopback switch, the demo's and the
Mininet runner's children): started so that they die with their parent, stopped for sure, and
their logs quoted in errors. One helper, so every launcher stops and reports children alike.

- `die_with_parent(argv)`: Linux SIGTERMs the child when the process that started it dies, even
  by SIGKILL (PR_SET_PDEATHSIG set by a tiny prelude that then exec's argv), so no daemon
  outlives its worker.
- `stop(proc)`: SIGTERM, a bounded grace period, SIGKILL; to the process group when the child
  leads one (its own children go too). Never by name.
- `tail(path)`: the end of a log, for error messages that say where to look.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

STOP_GRACE = 5.0  # s a child gets between SIGTERM and SIGKILL
KILL_WAIT = 10.0  # s to reap a child after SIGKILL

# argv[1] is the parent's pid (the parent may die before prctl: then exit), argv[2:] the command
_PRELUDE = ("import ctypes, os, signal, sys\n"
            "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
            "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
            "os.execvp(sys.argv[2], sys.argv[2:])\n")


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` wrapped so the child gets SIGTERM when this process dies.

    Args:
        argv: the command, e.g. ``[sys.executable, "-m", "luwu.daemons.engine", ...]``.

    Returns:
        The argv to pass to ``subprocess.Popen``.
    """
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
        return proc.wait(KILL_WAIT)
    except subprocess.TimeoutExpired:
        return None


def tail(path: str | os.PathLike, chars: int = 2000) -> str:
    """The last `chars` characters of a log file, or why it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace").strip() or "(empty)"
    except OSError as e:
        return f"(cannot read it: {e})"
