"""One receive buffer for many ports: recvmmsg from every ready socket into consecutive rows,
so a single pipeline run per event-loop turn handles the packets of all ports (the pipeline's
per-batch cost is paid once per turn, not once per port).

Uses the same `struct mmsghdr` layout as `luwu.dataplane.net.mmsg` (whose BatchSocket the
ports still use for sending); row i's iovec and sockaddr are fixed, and a port's recvmmsg call
starts at the first free row.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

from ..net.mmsg import MMSGHDR, MSG_DONTWAIT, SOCKADDR_LEN, _libc, addr_of, recv_vectors

MSG_TRUNC = 0x20  # msg_flags: the datagram was longer than the buffer


class GroupReceiver:
    def __init__(self, capacity: int, max_len: int, want_addr: bool):
        self.capacity = capacity
        self.rows = np.zeros((capacity, max_len), dtype=np.uint8)
        self.length = np.zeros(capacity, dtype=np.int64)
        self.port = np.zeros(capacity, dtype=np.int64)
        self.addr = np.zeros((capacity, SOCKADDR_LEN), dtype=np.uint8)
        # datagrams longer than a row: the kernel hands over only their prefix, which must never
        # pass for a packet (the switch drops them MALFORMED)
        self.truncated = np.zeros(capacity, dtype=bool)
        self._want_addr = want_addr
        self._iov, self._hdr = recv_vectors(self.rows, self.addr if want_addr else None)
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
        self.truncated[start:end] = (self._hdr["flags"][start:end] & MSG_TRUNC) != 0
        self.port[start:end] = port
        self.filled = end
        return k
