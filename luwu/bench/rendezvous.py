"""Where a benchmark's spawned ranks meet: a c10d TCPStore hosted by the parent, as torchrun's
agent hosts one for its ranks.

Each rank used to pass `tcp://127.0.0.1:PORT` with a port found free beforehand, so rank 0 bound
it later: every other process on the host raced it for that port, and under a loaded test run one
sweep's ranks failed with EADDRINUSE. The parent's store binds port 0 (the kernel picks a free
one, no race) before any rank starts; every rank is a client of it, Gloo's and luwu's alike, so
their `init_process_group` is still timed the same way.

Example:
    >>> with host_store() as address:
    ...     address.startswith("127.0.0.1:")
    True
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HOST = "127.0.0.1"


@contextmanager
def host_store(timeout_s: float = 300.0) -> Iterator[str]:
    """A TCPStore served by this process on a port the kernel picked: yields its "host:port"."""
    from torch.distributed import TCPStore

    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield f"{HOST}:{store.port}"
    finally:
        del store


def init_group(backend: str, address: str, rank: int, world_size: int, timeout_s: float = 300.0) -> None:
    """`init_process_group(backend)` for `rank` through the parent's store at `address` (host_store)."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def spawn_ranks(target: Callable[..., None], workers: int, args: tuple, label: str, timeout_s: float) -> dict[int, object]:
    """Spawn `workers` ranks `target(rank, workers, address, *args, out_q)` on a parent-hosted store
    (host_store) and collect what each puts on `out_q` as `(rank, "ok", value)`, else
    `(rank, status, traceback text)`.

    Returns:
        dict: rank -> value.

    Raises:
        RuntimeError: a rank failed (its traceback in the message), or ranks did not report within
            `timeout_s` (named); the ranks are joined, or killed, either way.
    """
    import multiprocessing as mp
    import queue

    from luwu.dataplane.process.children import join_or_kill

    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with host_store() as address:
        procs = [ctx.Process(target=target, args=(r, workers, address, *args, out_q), daemon=True)
                 for r in range(workers)]
        for p in procs:
            p.start()
        got: dict[int, object] = {}
        try:
            for _ in procs:
                try:
                    rank, status, value = out_q.get(timeout=timeout_s)
                except queue.Empty:
                    raise RuntimeError(f"{label}: ranks {sorted(set(range(workers)) - set(got))} did not finish "
                                       f"within {timeout_s:.0f} s") from None
                if status != "ok":
                    raise RuntimeError(f"{label}: rank {rank} failed:\n{value}")
                got[rank] = value
        finally:
            join_or_kill(procs)
    return got
