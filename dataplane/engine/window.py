"""Receive-side sequence bookkeeping: which packets of a stream arrived, and the acknowledgement.

A `RecvWindow` accepts each sequence number within `[ack, ack + size)` once, and advances `ack`
over the contiguous prefix of what has arrived (docs/protocol.md 7.2). Everything is vectorised
over the sequence numbers of a received batch; comparisons use 32-bit serial arithmetic.
"""

from __future__ import annotations

import numpy as np

MASK32 = 0xFFFFFFFF
# the ufuncs' reductions called directly: the ndarray methods' Python wrappers cost more than the
# work on a batch of a few dozen sequence numbers
_MAX, _ALL, _ANY, _COUNT = np.maximum.reduce, np.logical_and.reduce, np.logical_or.reduce, np.count_nonzero


class RecvWindow:
    def __init__(self, size: int, start: int = 0):
        if size <= 0 or size & (size - 1):
            raise ValueError(f"receive window must be a power of two, got {size}")
        self.size = size
        self.ack = start & MASK32
        self._bits = np.zeros(size, dtype=bool)
        self.bits = self._bits  # the same array (only ever changed in place), for the compiled RESULT pass
        self.duplicates = 0
        # has_gap's answer until the bits change (accept, advance, or `changed()` from a writer of
        # `bits`): heartbeat senders ask it on every loop turn, and most turns receive nothing
        self._gap: bool | None = False

    def credit(self, capacity: int | None = None) -> int:
        """Highest sequence number this receiver can take (inclusive)."""
        return (self.ack + (capacity or self.size) - 1) & MASK32

    def accept(self, seqs: np.ndarray) -> np.ndarray:
        """Mark `seqs` received; returns a mask of the ones seen for the first time."""
        self._gap = None
        s64 = np.asarray(seqs, dtype=np.uint32).astype(np.int64)
        dist = (s64 - self.ack) & MASK32
        idx = s64 & (self.size - 1)
        if len(dist) and _MAX(dist) < self.size and (len(dist) == 1 or _ALL(dist[1:] > dist[:-1])):
            # the common batch: all in the window, ascending (hence no seq twice): the first sight
            # of each is where its bit is clear, with no sort to find repeats
            new = ~self._bits[idx]
            self._bits[idx] = True
            self.duplicates += len(seqs) - int(_COUNT(new))
            return new
        inwin = dist < self.size
        new = inwin & ~self._bits[idx]
        if new.any():
            # a batch may hold the same seq twice: keep the first
            cand = np.flatnonzero(new)
            _, first = np.unique(idx[cand], return_index=True)
            new[:] = False
            new[cand[first]] = True
            self._bits[idx[new]] = True
        self.duplicates += int(len(s64) - new.sum())
        return new

    def advance(self) -> int:
        """Move `ack` over the received prefix; returns how far it moved."""
        pos = self.ack & (self.size - 1)
        if not self._bits[pos]:
            return 0
        self._gap = None
        end = int(self._bits[pos:].argmin())  # the first hole at or after pos, else 0 (all received to the end)
        if end:
            n = end  # stops before the ring's end (the common case): no rotated copy of the window
        else:
            ring = np.concatenate((self._bits[pos:], self._bits[:pos]))
            n = self.size if ring.all() else int(ring.argmin())
        if pos + n <= self.size:
            self._bits[pos:pos + n] = False
        else:
            self._bits[pos:] = False
            self._bits[: pos + n - self.size] = False
        self.ack = (self.ack + n) & MASK32
        return n

    def has_gap(self) -> bool:
        """Something past `ack` has arrived while `ack` itself has not: a packet was lost."""
        gap = self._gap
        if gap is None:
            gap = self._gap = bool(_ANY(self._bits))
        return gap

    def changed(self) -> None:
        """`bits` or `ack` were changed from outside (the compiled RESULT pass): forget has_gap's answer."""
        self._gap = None

    def received_mask(self, first: int, count: int) -> np.ndarray:
        """For seqs first..first+count-1: True where already received (or below ack)."""
        seqs = (first + np.arange(count, dtype=np.int64)) & MASK32
        d = (seqs - self.ack) & MASK32
        below = d >= 0x80000000
        inwin = d < self.size
        return below | (inwin & self._bits[seqs & (self.size - 1)])

    def received(self, seq: int) -> bool:
        d = (seq - self.ack) & MASK32
        if d >= 0x80000000:
            return True  # before ack
        return d < self.size and bool(self._bits[seq & (self.size - 1)])
