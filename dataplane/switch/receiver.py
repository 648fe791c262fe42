"""One receive buffer for many ports: recvmmsg from every ready socket into consecutive rows,
so a single pipeline run per event-loop turn handles the packets of all ports (the pipeline's
per-batch cost is paid once per turn, not once per port).

Uses the same `struct mmsghdr` layout as `luwu.dataplane.net.mmsg` (whose BatchSocket the
ports still use for sending); row i's iovec and sockaddr are fixed, and a port's recvmmsg call
starts at the first free row.

Rows can be narrower than the largest datagram accepted (`row_len` < `max_len`: the UDP ports'
rows are one aggregation packet wide while `max_datagram` is 64 KiB): datagram i then lands in
its row and, past `row_len`, in a spill row of its own (a second iovec), so nothing changes
about what is received or truncated. Compact rows are what make the turn's memory fit the
caches: rows 64 KiB apart map onto a few cache sets, and the lane kernel and the kernel's copies
ran at half speed over them (luwu bench switch). A turn with a spilled datagram is rebuilt as
wide rows before the pipeline sees it (`turn_rows`); the spill rows are never touched otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

from ..net.mmsg import IOVEC, MMSGHDR, MSG_DONTWAIT, SOCKADDR_LEN, _libc, addr_of, recv_vectors

MSG_TRUNC = 0x20  # msg_flags: the datagram was longer than the buffer
ROW_ALIGN = 64  # compact rows start on cache lines


class GroupReceiver:
    def __init__(self, capacity: int, max_len: int, want_addr: bool, row_len: int | None = None):
        self.capacity = capacity
        self.max_len = max_len
        width = max_len if row_len is None else min(max_len, -(-row_len // ROW_ALIGN) * ROW_ALIGN)
        self.rows = np.zeros((capacity, width), dtype=np.uint8)
        self.length = np.zeros(capacity, dtype=np.int64)
        self.port = np.zeros(capacity, dtype=np.int64)
        self.addr = np.zeros((capacity, SOCKADDR_LEN), dtype=np.uint8)
        # datagrams longer than a row: the kernel hands over only their prefix, which must never
        # pass for a packet (the switch drops them MALFORMED)
        self.truncated = np.zeros(capacity, dtype=bool)
        self._want_addr = want_addr
        self._iov, self._hdr = recv_vectors(self.rows, self.addr if want_addr else None)
        self.spill = None  # past `width`: one spill row per datagram (untouched pages cost nothing)
        if width < max_len:
            # empty, not zeros: only bytes a datagram wrote are ever read, and calloc could clear
            # (fault in) tens of MiB that a spill may never touch
            self.spill = np.empty((capacity, max_len - width), dtype=np.uint8)
            iov = np.zeros((capacity, 2), dtype=IOVEC)
            iov[:, 0] = self._iov
            iov["base"][:, 1] = addr_of(self.spill) + np.arange(capacity, dtype=np.uint64) * np.uint64(max_len - width)
            iov["len"][:, 1] = max_len - width
            self._iov = iov
            self._hdr["iov"] = addr_of(iov) + np.arange(capacity, dtype=np.uint64) * np.uint64(2 * IOVEC.itemsize)
            self._hdr["iovlen"] = 2
        self._hdr_base = addr_of(self._hdr)
        # field views made once: naming a field of a structured array costs a microsecond a time
        self._namelen, self._len, self._flags = self._hdr["namelen"], self._hdr["len"], self._hdr["flags"]
        self._spilled = False  # a row of this turn continues in its spill row
        self.filled = 0

    def reset(self) -> None:
        self.filled = 0
        self._spilled = False

    def turn_rows(self, n: int) -> np.ndarray:
        """The first n rows as the pipeline must see them: whole datagrams, one per row (rows
        `max_len` wide, rebuilt from the spill rows, when a datagram of the turn was wider)."""
        if not self._spilled:
            return self.rows[:n]
        if self.spill is None:
            raise RuntimeError("a datagram spilled in a receiver without spill rows")
        width = self.rows.shape[1]
        wide = np.zeros((n, self.max_len), dtype=np.uint8)
        wide[:, :width] = self.rows[:n]
        for i in np.flatnonzero(self.length[:n] > width).tolist():
            wide[i, width:self.length[i]] = self.spill[i, :self.length[i] - width]
        return wide

    def drain(self, fd: int, port: int, batch: int, limit: int) -> int:
        """Receive up to `limit` datagrams from fd, `batch` per recvmmsg, until the socket has no
        more (a short read) or the limit or the buffer is reached; returns how many. Draining
        makes the event-loop turns, and so the pipeline's batches, as large as the backlog:
        the pipeline's per-batch cost is paid once for all of them."""
        total = 0
        while total < limit:
            want = min(batch, limit - total)
            try:
                k = self.recv(fd, port, want)
            except OSError:
                if total:  # keep what arrived (the caller must see its rows); the error shows again next turn
                    break
                raise
            total += k
            if k < want:
                break
        return total

    def recv(self, fd: int, port: int, batch: int) -> int:
        """Receive up to `batch` datagrams from fd into the next free rows; returns how many."""
        start = self.filled
        n = min(batch, self.capacity - start)
        if n <= 0:
            return 0
        if self._want_addr:
            self._namelen[start:start + n] = SOCKADDR_LEN
        k = _libc.recvmmsg(fd, self._hdr_base + start * MMSGHDR.itemsize, n, MSG_DONTWAIT, None)
        if k < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return 0
            raise OSError(err, os.strerror(err))
        end = start + k
        self.length[start:end] = self._len[start:end]
        self.truncated[start:end] = (self._flags[start:end] & MSG_TRUNC) != 0
        if self.spill is not None and not self._spilled:
            self._spilled = bool((self.length[start:end] > self.rows.shape[1]).any())
        self.port[start:end] = port
        self.filled = end
        return k
