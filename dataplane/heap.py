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
"""

from __future__ import annotations

import ctypes
import ctypes.util

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

        >>> from luwu.dataplane.heap import retain_freed_memory
        >>> retain_freed_memory()   # first thing in a datapath daemon
        True
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
