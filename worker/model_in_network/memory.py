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
        with self._lock:
            self.current[kind] += nbytes
            self.total += nbytes
            self.peak[kind] = max(self.peak[kind], self.current[kind])
            self.peak_total = max(self.peak_total, self.total)

    def sub(self, kind: str, nbytes: int) -> None:
        self.add(kind, -nbytes)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = dict(self.current)
            self.peak_total = self.total

    def snapshot(self) -> dict:
        with self._lock:
            return {"current_bytes": dict(self.current), "peak_bytes_by_kind": dict(self.peak),
                    "peak_bytes": self.peak_total, "peak_rss_bytes": peak_rss_bytes()}
