"""Keep freed heap memory in the process, for the datapath daemons (switch, engine).

The software switch and the engines make numpy temporaries of whole packet batches (megabytes
each) every event-loop turn. glibc serves an allocation that large with a fresh mmap() and gives
it back with munmap() when it is freed (or trims the heap's top), so every turn faulted its
temporaries in again page by page: measured in `luwu bench allreduce` (4 workers, 16 MiB, shm),
the switch took about 11,000 minor page faults per allreduce and half of its CPU time in the
kernel. Raising glibc's mmap and trim thresholds keeps those pages in the heap for the next
turn: the same run then takes 0.2% of the faults and about 45% less switch CPU.

Only daemon entry points call this (it changes the whole process's allocator: never from a
library call made in a user's training process). Elsewhere than glibc it does nothing.

`freeze_collector` is the same kind of setting for Python's cyclic garbage collector: a datapath
daemon holds a few hundred thousand long-lived objects (numba, protobuf, the tables) that every
full collection traversed again, while a turn's garbage is young: in `luwu bench switch` the
collector took about 7% of the switch process's CPU. Freezing what start-up made moves it out of
the collector's sight; the switch kernels' loaders (the event loop's, the loopback switch process's) freeze again once
they are in (`refreeze`), only in a process that froze.
"""

from __future__ import annotations

import ctypes
import gc

# mallopt() parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest temporary of a turn is one receive buffer of rows (2048 rows of 64 KiB: 128 MiB);
# allocations up to this size come from the heap. Fixed values also stop glibc's dynamic
# threshold from drifting back down.
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20


def retain_freed_memory() -> bool:
    """Make glibc keep freed blocks up to `MMAP_THRESHOLD` in the heap instead of unmapping them.

    Returns:
        True when the allocator took both settings (glibc), False otherwise (nothing changed).

    Examples::

        >>> from luwu.dataplane.process.heap import retain_freed_memory
        >>> retain_freed_memory()   # first thing in a datapath daemon
        True
    """
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them (no `ldconfig -p` child)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_collector() -> int:
    """Move every object alive now to the garbage collector's permanent generation (`gc.freeze`),
    so that collections stop traversing what start-up made. Daemon entry points only.

    Returns:
        How many objects are frozen.

    Examples::

        >>> from luwu.dataplane.process.heap import freeze_collector
        >>> freeze_collector() > 0   # after imports and setup, before serving
        True
    """
    gc.freeze()
    return gc.get_freeze_count()


def refreeze() -> None:
    """Freeze again (after a late start-up step such as loading compiled kernels), but only in a
    process whose entry point chose `freeze_collector`: a library call changes nothing else."""
    if gc.get_freeze_count():
        gc.freeze()
