"""What a rank made on disk goes when it exits: its work directories (logs, sockets, plan files of
its engine and switch processes) and its shared buffers in /dev/shm.

A work directory the backend made in the temp dir (no LUWU_WORKDIR: `plan_source.default_workdir`)
is removed once no luwu process group of this process is open any more (the engine and switch
processes, shared by the groups, live in the first one's), and at interpreter exit. Under
LUWU_WORKDIR the directories stay: that is where the user asked for the logs.

SIGTERM ends a Python process without atexit, so the first group installs a handler that removes
the work directories and this process's shared buffers (`/dev/shm/luwu-<pid>-<token>-*`, shm.py)
and then does what the previous handler would have done: Python's default (the process dies of
SIGTERM, as before), or the user's own handler, called as it was (if it raises or exits, the
interpreter exits and the atexit clean-up runs; if it returns, the process goes on with its
files). A handler set after the group's creation is the user's to chain. The engine and switch
processes get SIGTERM when their rank dies (children.die_with_parent) and clean up their own.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import signal
import threading

_lock = threading.Lock()
_dirs: set[str] = set()  # temp work directories this process made
_open_groups = 0
_installed = False
_previous_sigterm = None


def track(workdir: str, temporary: bool) -> None:
    """A process group opened with `workdir` (`temporary`: made in the temp dir, to remove)."""
    global _open_groups
    with _lock:
        _open_groups += 1
        if temporary:
            _dirs.add(workdir)
    _install()


def untrack(workdir: str) -> None:
    """A process group closed: once none is open, its processes are stopped and the directories go."""
    global _open_groups
    with _lock:
        _open_groups = max(0, _open_groups - 1)
        last = _open_groups == 0
    if last:
        remove_dirs()


def forget_unopened(workdir: str) -> None:
    """A group whose creation failed before `track`: its directory goes (its processes were stopped)."""
    with _lock:
        if _open_groups:
            return
    _rmtree(workdir)


def remove_dirs() -> None:
    with _lock:
        dirs = list(_dirs)
        _dirs.clear()
    for d in dirs:
        _rmtree(d)


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _remove_shm_buffers() -> None:
    from luwu.dataplane.engine import shm

    for path in glob.glob(os.path.join(shm.SHM_DIR, f"luwu-{os.getpid()}-{shm._TOKEN}-*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def _on_sigterm(signum, frame) -> None:
    previous = _previous_sigterm
    if callable(previous):  # the user's handler decides; the atexit clean-up runs if the process exits
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    remove_dirs()
    _remove_shm_buffers()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # die of SIGTERM, as without this handler
    os.kill(os.getpid(), signal.SIGTERM)


def _install() -> None:
    global _installed, _previous_sigterm
    with _lock:
        if _installed:
            return
        _installed = True
    atexit.register(remove_dirs)  # registered before any group's shutdown: runs after them (LIFO)
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; the atexit clean-up still runs
    try:
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or signals unavailable
        pass
