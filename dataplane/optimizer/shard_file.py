"""Positional file I/O for shard records, counted, with the page cache kept out of the way.

With O_DIRECT (the default where the file system has it) reads and writes go between the
node's page-aligned buffers and the device, so "out of core" means the disk, not the kernel's
page cache, and the node's RAM use is what its budget says. Without it (tmpfs) the I/O is
buffered and written ranges are dropped with posix_fadvise(DONTNEED). No fsync: state files are
scratch; durability is the checkpoints' job.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np


class IoCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self.reads = self.writes = self.read_bytes = self.write_bytes = 0

    def add(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            if read:
                self.reads += 1
                self.read_bytes += read
            if written:
                self.writes += 1
                self.write_bytes += written

    def snapshot(self) -> dict:
        with self._lock:
            return {"reads": self.reads, "writes": self.writes, "read_bytes": self.read_bytes,
                    "write_bytes": self.write_bytes}


def _buffers_of(arrays) -> list[memoryview]:
    # `.data` is memoryview(array); numpy's stubs type arrays as buffers only for Python 3.12+
    return [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data for a in arrays]


def pread_full(fd: int, buf: np.ndarray, offset: int) -> int:
    """Read exactly buf.nbytes at `offset` into `buf` (looping over short reads)."""
    mv = buf.reshape(-1).view(np.uint8).data  # memoryview(...): see _buffers_of
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ends {len(mv) - done} bytes short at offset {offset + done}")
        done += n
    return done


def pwrite_full(fd: int, arrays, offset: int) -> int:
    """Write the arrays back to back at `offset` (looping over short writes)."""
    views = _buffers_of(arrays)
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        skip, rest = done, []
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        done += os.pwritev(fd, rest, offset + done)
    return total


class FileSet:
    """Open shard files (one descriptor each) and the I/O mode they share."""

    def __init__(self, direct: bool | None):
        self.want_direct = direct
        self.direct: bool | None = None  # decided by the first open
        self.counters = IoCounters()
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _open(self, path: Path, flags: int) -> int:
        use_direct = self.want_direct is not False and self.direct is not False and hasattr(os, "O_DIRECT")
        if use_direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
                return fd
            except OSError as e:
                if e.errno != errno.EINVAL or self.want_direct:
                    raise
                self.direct = False  # file system without O_DIRECT (tmpfs): buffered + DONTNEED
        else:
            self.direct = False
        return os.open(path, flags, 0o644)

    def create(self, path: Path, nbytes: int) -> int:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.ftruncate(fd, nbytes)
        with self._lock:
            self._fds[path] = fd
        return fd

    def read(self, fd: int, buf: np.ndarray, offset: int) -> None:
        n = pread_full(fd, buf, offset)
        self.counters.add(read=n)
        if not self.direct:
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)

    def write(self, fd: int, arrays, offset: int) -> None:
        n = pwrite_full(fd, arrays, offset)
        self.counters.add(written=n)
        if not self.direct:
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)

    def close_under(self, directory: Path) -> None:
        """Close and delete the files under `directory` (a job that failed to register)."""
        with self._lock:
            mine = [p for p in self._fds if directory in p.parents]
            fds = [(p, self._fds.pop(p)) for p in mine]
        for path, fd in fds:
            os.close(fd)
            path.unlink(missing_ok=True)

    def close_all(self, remove: bool) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for path, fd in fds.items():
            os.close(fd)
            if remove:
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
