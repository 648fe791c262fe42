"""The disk's read+write bandwidth on an optimizer node's own access pattern, measured in place.

For each shard in backward order: read its record (header and fp32 state), write it back, and
write its served copy's region: the bytes an out-of-core step moves, with nothing else to do.
A reader and a writer thread overlap like the node's read and write steps. The bytes written are
the bytes just read, so running it on a live node's files (between steps) changes nothing.
O_DIRECT where the file system has it, so the page cache does not flatter the disk.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

from luwu.dataplane.optimizer.buffers import aligned_buffer
from luwu.dataplane.optimizer.shard_file import pread_full, pwrite_full

IN_FLIGHT = 3  # records between the reader and the writer (the node's queue depth is similar)


def _open(path: Path, direct: bool) -> int:
    flags = os.O_RDWR | (os.O_DIRECT if direct and hasattr(os, "O_DIRECT") else 0)
    return os.open(path, flags)


def measure(shards: list[tuple[Path, int, int, int]], direct: bool, repeat: int = 2) -> dict:
    """shards: (file, record bytes, served offset, served bytes) in access order. Returns the best
    of `repeat` (>= 1) passes: seconds, bytes read, bytes written, GB/s (read + write)."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    fds = {p: _open(p, direct) for p, *_ in shards}
    biggest = max(r for _, r, _, _ in shards)
    bufs = [aligned_buffer(biggest) for _ in range(IN_FLIGHT + 1)]
    served_copies = {}  # the served regions as they are: written back unchanged
    for path, _, served_off, served in shards:
        served_copies[path] = aligned_buffer(served)
        pread_full(fds[path], served_copies[path], served_off)
    best: dict[str, float] | None = None
    try:
        for _ in range(repeat):
            free: queue.Queue = queue.Queue()
            for b in bufs:
                free.put(b)
            full: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)
            errors: list[BaseException] = []

            def writer(full: queue.Queue = full, free: queue.Queue = free,
                       errors: list[BaseException] = errors) -> None:
                try:
                    while True:
                        item = full.get()
                        if item is None:
                            return
                        path, rec, served_off, buf = item
                        pwrite_full(fds[path], [buf[:rec]], 0)
                        pwrite_full(fds[path], [served_copies[path]], served_off)
                        free.put(buf)
                except BaseException as e:  # reported by the caller after join
                    errors.append(e)

            t = threading.Thread(target=writer, daemon=True)
            t0 = time.perf_counter()
            t.start()
            read = written = 0
            for path, rec, served_off, served in shards:
                buf = free.get()
                pread_full(fds[path], buf[:rec], 0)
                full.put((path, rec, served_off, buf))
                read += rec
                written += rec + served
            full.put(None)
            t.join()
            dt = time.perf_counter() - t0
            if errors:
                raise errors[0]
            if best is None or dt < best["seconds"]:
                best = {"seconds": dt, "read_bytes": read, "write_bytes": written,
                        "gbps": (read + written) / dt / 1e9}
    finally:
        for fd in fds.values():
            os.close(fd)
    assert best is not None  # repeat >= 1 passes ran (checked above)
    return best
