"""Buffers shared between a worker process and its engine daemon: files in /dev/shm, mmapped
by both sides, so a layer crosses the process boundary without a copy through a socket.

The worker (client) creates and unlinks them; the daemon only maps them by path. Plain files
avoid multiprocessing.shared_memory's resource tracker, which unlinks segments that another
process created.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import tempfile

import numpy as np

from ..net.shm_ring import unmap

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_counter = itertools.count()
# pids are reused, and a process killed before it unlinked its buffers leaves their names behind: a
# random token per process keeps a new process's names clear of them (O_EXCL would refuse the clash)
_TOKEN = secrets.token_hex(4)


class ShmBuffer:
    """A named, mmapped byte buffer with numpy views."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path = path
        self.nbytes = nbytes
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(nbytes, 1))
            self._map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)

    @classmethod
    def create(cls, nbytes: int, prefix: str = "luwu") -> ShmBuffer:
        path = os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-{_TOKEN}-{next(_counter)}")
        return cls(path, nbytes, create=True)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> ShmBuffer:
        if not os.path.abspath(path).startswith(SHM_DIR + os.sep):
            raise ValueError(f"refusing to map {path!r}: shared buffers live in {SHM_DIR}")
        return cls(path, nbytes, create=False)

    def view(self, dtype, count: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        unmap(self._map, (self.path,) if self.owner else ())


class ShmCache:
    """Daemon side: maps each client buffer once."""

    def __init__(self):
        self._maps: dict[str, ShmBuffer] = {}

    def get(self, path: str, nbytes: int) -> ShmBuffer:
        buf = self._maps.get(path)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.close()
            buf = self._maps[path] = ShmBuffer.attach(path, nbytes)
        return buf

    def unlink_all(self) -> None:
        """Remove the files of every buffer mapped here: their worker died without closing them
        (SIGKILL, a crash), so nobody else will (the daemon's connection ended without `close`)."""
        for path in self._maps:
            try:
                os.unlink(path)
            except OSError:
                pass

    def forget(self, path: str) -> None:
        buf = self._maps.pop(path, None)
        if buf is not None:
            buf.close()

    def close(self) -> None:
        for buf in self._maps.values():
            buf.close()
        self._maps.clear()
