"""What a worker holds: bytes of parameters, gradients and staging buffers resident, with peaks,
and the process's peak RSS. The figure compared with DDP is `peak_bytes` (model state a worker
keeps: parameters + gradients + optimizer state + buffers); RSS includes torch itself and the
activations, which are the same for both.

`return_freed_memory()` (called by every ModelInNetwork): a worker allocates and frees a unit's
parameters, its gradients and the activations around them on every use, and glibc's malloc serves
blocks of a few hundred KB from its heap once a large block has been freed (its mmap threshold
rises to the largest block freed, up to 32 MiB). Those blocks interleave with long-lived ones (a
checkpointed block's saved input), so the heap fragments: its free bytes, which the process keeps
resident, grew with the number of layers (measured, LLaMA-shaped, hidden 256, 2 workers: 600-840
MiB of free heap at 256 layers, peak RSS 1.41 GiB, against 0.74 GiB with the threshold fixed at
128 KiB; 8 layers: 0.78 against 0.63 GiB). A fixed threshold sends every block from 128 KiB up to
mmap, which unmaps it when freed: the worker's RSS is what it holds, not what it once held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys
import threading

HEAP_MMAP_THRESHOLD = 128 * 1024  # bytes: blocks from this size up are mmap'ed (glibc's initial default, held fixed)
_M_MMAP_THRESHOLD = -3  # glibc mallopt() parameter
_applied: int | None = None  # the threshold this process set (once)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def return_freed_memory(threshold: int = HEAP_MMAP_THRESHOLD) -> int | None:
    """Fix glibc malloc's mmap threshold at `threshold` bytes for this process (`mallopt`), so that
    freed blocks from that size up go back to the system at once instead of staying in a
    fragmented heap (the module's docstring has the figures). Once per process; a threshold the
    user set (the MALLOC_MMAP_THRESHOLD_ environment variable) is left as it is.

    Returns:
        The threshold in force that this process set, or None: not glibc (another allocator, or
        another C library), or the user's own setting.
    """
    global _applied
    if _applied is not None:
        return _applied
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl's mallopt does nothing
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
        return None
    _applied = int(threshold)
    return _applied


def heap_bytes() -> dict[str, int]:
    """glibc malloc's heap: `in_use` bytes allocated and `free` bytes it keeps (resident once
    touched) across its arenas, and `mmapped` bytes of blocks it mapped; {} elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return {}

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    fn.restype = _Mallinfo2
    info = fn()
    return {"in_use": int(info.uordblks), "free": int(info.fordblks), "mmapped": int(info.hblkhd)}


class MemoryTracker:
    KINDS = ("params", "grads", "staging")

    def __init__(self):
        self._lock = threading.Lock()
        self.current = dict.fromkeys(self.KINDS, 0)
        self.peak = dict.fromkeys(self.KINDS, 0)
        self.total = 0
        self.peak_total = 0

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:  # comparisons, not max(): a hundred calls per training step
            cur = self.current[kind] = self.current[kind] + nbytes
            total = self.total = self.total + nbytes
            if cur > self.peak[kind]:
                self.peak[kind] = cur
            if total > self.peak_total:
                self.peak_total = total

    def sub(self, kind: str, nbytes: int) -> None:
        self.add(kind, -nbytes)

    def transient(self, kind: str, nbytes: int) -> None:
        """`nbytes` held for a moment and released (a gradient between autograd and its staging
        buffer): the peaks as `add` then `sub` would leave them, in one call."""
        with self._lock:
            cur, total = self.current[kind] + nbytes, self.total + nbytes
            if cur > self.peak[kind]:
                self.peak[kind] = cur
            if total > self.peak_total:
                self.peak_total = total

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = dict(self.current)
            self.peak_total = self.total

    def snapshot(self) -> dict:
        with self._lock:
            return {"current_bytes": dict(self.current), "peak_bytes_by_kind": dict(self.peak),
                    "peak_bytes": self.peak_total, "peak_rss_bytes": peak_rss_bytes(),
                    "heap_bytes": heap_bytes(), "malloc_mmap_threshold": _applied}
