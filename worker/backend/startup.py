"""What `init_process_group("luwu")` launches before anything else: rank 0's switch process (embedded
plan).

Rank 0's switch process start is the critical path of a group's start-up (docs/backend.md
"Start-up"), so it is launched before the process group's own modules are imported (~15 ms of CPU
in the rank, which would otherwise come first). `LuwuProcessGroup` takes it (its own prestart call
is idempotent for the same workdir) and launches the rank's engine process; its start-up is
deferred to a thread (`chain` orders the groups of a process, `own_client` gives it a store
connection of its own) unless LUWU_EAGER_START=1.
"""

from __future__ import annotations

import threading

from .config import BackendConfig
from .plan_source import default_workdir, discard_prestarted_switch, prestart_switch


def prestart_children(rank: int, cfg: BackendConfig) -> str:
    """Launch rank 0's switch process without waiting for it (its start-up is what every rank's
    first collective waits for); this rank's engine process is launched by `LuwuProcessGroup` once
    the process group's modules are imported (~15 ms of CPU), so that the rank's own part of
    `init_process_group` does not compete with four more interpreters starting on a small host
    (the engine processes are needed only after the switch has answered its plan).

    Args:
        rank (int): this rank in the group being created.
        cfg (BackendConfig): the backend's configuration (`BackendConfig.from_env()`).

    Returns:
        str: the rank's new work directory (logs, sockets), to hand to `LuwuProcessGroup`.

    Example:
        >>> workdir = prestart_children(0, BackendConfig.from_env())   # then LuwuProcessGroup(..., workdir=workdir)
    """
    workdir = default_workdir(cfg, rank)
    prestart_switch(rank, cfg, workdir)  # first: its start-up is what every rank waits for
    return workdir


def discard_children(workdir: str) -> None:
    """Stop what `prestart_children` launched when the group's creation failed before taking it."""
    from luwu.worker.engine_link import EngineHost

    EngineHost.stop_if_unused()
    discard_prestarted_switch(workdir)


_chain_lock = threading.Lock()
_last_start: threading.Event | None = None  # set when this process's latest group has finished its start-up


def chain(started: threading.Event) -> threading.Event | None:
    """Queue a group's start-up behind the previous group's of this process: returns the event to
    wait for first (None: no earlier group). Later groups' switches run in the first group's switch
    process and their engines in the same engine process, which a deferred start-up makes later."""
    global _last_start
    with _chain_lock:
        before, _last_start = _last_start, started
    return before


def own_client(store):
    """A store client of the deferred start-up's own (`Store.clone`: a TCPStore's is a new
    connection), so that its blocking waits (rank 0's plan) never hold the lock of the client the
    rank's own thread uses; the store itself where it cannot be cloned."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store
