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
from collections.abc import Iterator
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
