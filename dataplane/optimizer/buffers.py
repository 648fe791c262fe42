"""Page-aligned buffers, reused instead of reallocated.

Fresh anonymous memory costs a page fault per 4 KiB on first touch, which on this class of VM is
slower than the optimizer step itself (about 1 GB/s, against tens of GB/s for the step), so the
node allocates shard and served-copy buffers once and recycles them by size. Buffers are mmap'd,
so they are page-aligned, as O_DIRECT needs.
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

HUGE_PAGE = 2 << 20


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zero-filled, page-aligned uint8 array of `nbytes` (> 0). Buffers of a huge page or more
    ask for transparent huge pages (as numpy does for its large arrays): the optimizer kernels
    stream five arrays at once, and with 4 KiB pages the TLB misses cost them 7-10% (measured on
    the compiled AdamW pass, docs/optimizer.md). The mapping is private: `mmap.mmap(-1, n)` alone
    is MAP_SHARED, i.e. shmem, which the kernel gives huge pages only when
    /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (it is `never` by default), so
    MADV_HUGEPAGE on it did nothing. Nothing shares these buffers with another process."""
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)  # the root array: every view's .base


def extra_references(obj, ours: int) -> int:
    """References to `obj` beyond our own `ours` (CPython's exact counts). Every numpy view of a
    buffer made by `aligned_buffer` points at the buffer itself (numpy collapses `.base`), and a
    tensor or memoryview of an array holds the array, so a caller still using a handed-out array
    shows up here, and its buffer is not recycled under it."""
    return sys.getrefcount(obj) - 2 - ours  # minus the call's own argument reference


class BufferPool:
    """Free buffers by size. Thread-safe. `free_bytes` is memory held but unused."""

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.free_bytes = 0
        self.allocated = 0  # buffers created (for stats: reuse keeps this flat)

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.free_bytes -= nbytes
                return free.pop()
            self.allocated += 1
        return aligned_buffer(nbytes)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(buf.nbytes, []).append(buf)
            self.free_bytes += buf.nbytes

    def has(self, nbytes: int) -> bool:
        with self._lock:
            return bool(self._free.get(nbytes))

    def drop(self, need: int, keep_size: int | None = None) -> int:
        """Release free buffers (other sizes than `keep_size` first) until `need` bytes are gone."""
        dropped = 0
        with self._lock:
            sizes = sorted(self._free, key=lambda s: s == keep_size)
            for size in sizes:
                lst = self._free[size]
                while lst and dropped < need:
                    lst.pop()
                    dropped += size
                if not lst:
                    del self._free[size]
            self.free_bytes -= dropped
        return dropped
