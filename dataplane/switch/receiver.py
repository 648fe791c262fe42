"""One receive buffer for many ports: recvmmsg from every ready socket into consecutive rows,
so a single pipeline run per event-loop turn handles the packets of all ports (the pipeline's
per-batch cost is paid once per turn, not once per port).

Uses the same `struct mmsghdr` layout as `luwu.dataplane.net.mmsg` (whose BatchSocket the
ports still use for sending); row i's iovec and sockaddr are fixed, and a port's recvmmsg call
starts at the first free row.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

import numpy as np

from ..net.mmsg import IOVEC, MMSGHDR, MSG_DONTWAIT, SOCKADDR_LEN, addr_of

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]


class GroupReceiver:
    def __init__(self, capacity: int, max_len: int, want_addr: bool):
        self.capacity = capacity
        self.rows = np.zeros((capacity, max_len), dtype=np.uint8)
        self.length = np.zeros(capacity, dtype=np.int64)
        self.port = np.zeros(capacity, dtype=np.int64)
        self.addr = np.zeros((capacity, SOCKADDR_LEN), dtype=np.uint8)
        self._iov = np.zeros(capacity, dtype=IOVEC)
        self._iov["base"] = addr_of(self.rows) + np.arange(capacity, dtype=np.uint64) * np.uint64(max_len)
        self._iov["len"] = max_len
        self._hdr = np.zeros(capacity, dtype=MMSGHDR)
        self._hdr["iov"] = addr_of(self._iov) + np.arange(capacity, dtype=np.uint64) * np.uint64(IOVEC.itemsize)
        self._hdr["iovlen"] = 1
        self._want_addr = want_addr
        if want_addr:
            self._hdr["name"] = addr_of(self.addr) + np.arange(capacity, dtype=np.uint64) * np.uint64(SOCKADDR_LEN)
        self._hdr_base = addr_of(self._hdr)
        self.filled = 0

    def reset(self) -> None:
        self.filled = 0

    def recv(self, fd: int, port: int, batch: int) -> int:
        """Receive up to `batch` datagrams from fd into the next free rows; returns how many."""
        start = self.filled
        n = min(batch, self.capacity - start)
        if n <= 0:
            return 0
        if self._want_addr:
            self._hdr["namelen"][start:start + n] = SOCKADDR_LEN
        k = _libc.recvmmsg(fd, self._hdr_base + start * MMSGHDR.itemsize, n, MSG_DONTWAIT, None)
        if k < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return 0
            raise OSError(err, os.strerror(err))
        end = start + k
        self.length[start:end] = self._hdr["len"][start:end]
        self.port[start:end] = port
        self.filled = end
        return k
