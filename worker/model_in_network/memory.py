"""What a worker holds: bytes of parameters, gradients and staging buffers resident, with peaks,
and the process's peak RSS. The figure compared with DDP is `peak_bytes` (model state a worker
keeps: parameters + gradients + optimizer state + buffers); RSS includes torch itself and the
activations, which are the same for both."""

from __future__ import annotations

import resource
import sys
import threading


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


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
                    "peak_bytes": self.peak_total, "peak_rss_bytes": peak_rss_bytes()}
