"""Shared-memory turns without a receive copy: the up rings of every shared-memory port mapped
side by side as one array, so the pipeline runs on packets where they lie.

Each up ring's rows (a page-aligned region of its file: `ShmRing.rows_span`) are mapped a second
time, MAP_SHARED and MAP_FIXED, into one reserved stretch of address space, one ring after the
other (`RingArena`). All rings of a switch have rows of the same width, so the stretch is one
(total slots, row bytes) uint8 array: packet t of a port's up ring is arena row
`base + (t & (slots - 1))`. The second mapping is the same physical pages (coherent on x86), so
the ring's memory-ordering argument (net/shm_ring.py) holds as it is: the switch reads a row after
it saw the ring's `head`, and gives it back (`release`) after its last access, at the end of the
turn.

A turn (`ShmTurn`) copies only each packet's 32-byte header into a compact buffer (what the parser
and the controls read and rewrite, in cache) and records its payload's arena row (`prow`); the
lane controls read contributions and write results in the arena rows (the switch is the ring's
consumer until it releases them, so it may), and emission writes the rewritten headers back into
their rows and sends the packets from there. Where a row must leave whole some other way (a UDP or
Ethernet port, link impairments), `Batch.whole()` gathers the rows first.

Where the arena cannot be made (no address space, a ring file gone), the event loop copies rows
into a receive buffer as before (`ShmRing.pop_into`): the same packets, the same results.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import numpy as np

from ..net.shm_ring import H_HEAD, H_TAIL, ShmRing
from ..protocol import DATA_HEADER, HEADER_LEN, HEARTBEAT_HEADER

MAP_FIXED = 0x10  # Linux's value (shared-memory ports exist on Linux x86-64 only: shm_ring.supported)
MAP_NORESERVE = 0x4000
PROT_NONE = 0
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)  # its own prototypes; dlopen(NULL), no `ldconfig -p` child (net/mmsg.py)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
HEADER_ROW = 64  # bytes per packet of a turn's header buffer: one cache line, the header at its start


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
    got = _libc.mmap(addr, size, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED or (addr is not None and got != addr):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    return got


class RingArena:
    """The rows of `rings` (up rings, all of one row width) as one array, `rows`; `base[i]` is
    the arena row of ring i's row 0. Unmapped by `close()`, which must come after the last use of
    any view of `rows` (the event loop makes and closes arenas between turns)."""

    def __init__(self, rings: list[ShmRing]):
        if not rings or len({r.row_bytes for r in rings}) != 1:
            raise ValueError("an arena needs rings of one row width")
        self.row_bytes = rings[0].row_bytes
        # each ring's piece starts page-aligned (mmap) on a row boundary of the arena
        step = math.lcm(mmap.PAGESIZE, self.row_bytes)
        starts, at = [], 0
        for ring in rings:
            starts.append(at)
            at += -(-ring.rows_span()[1] // step) * step
        self._size = at
        # reserve the stretch (no memory behind it), then put each ring's rows over its piece
        self._addr = _mmap(None, self._size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
                           -1, 0)
        self.base: list[int] = []
        try:
            for ring, at in zip(rings, starts):
                offset, nbytes = ring.rows_span()
                fd = os.open(ring.path, os.O_RDWR)
                try:
                    if os.fstat(fd).st_size < offset + nbytes:
                        raise OSError(f"{ring.path} is shorter than its rows")
                    _mmap(self._addr + at, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED,
                          fd, offset)
                finally:
                    os.close(fd)
                self.base.append(at // self.row_bytes)
        except BaseException:
            _libc.munmap(self._addr, self._size)
            raise
        buf = (ctypes.c_uint8 * self._size).from_address(self._addr)
        self.rows: np.ndarray | None = np.frombuffer(memoryview(buf), dtype=np.uint8).reshape(-1, self.row_bytes)

    def close(self) -> None:
        if self.rows is not None:
            self.rows = None
            _libc.munmap(self._addr, self._size)


class ShmTurn:
    """One event-loop turn's packets of the shared-memory ports, shaped like `GroupReceiver` for
    the loop and `SoftwareSwitch.handle_turn`: `rows` holds the headers (HEADER_ROW bytes per
    packet), `length`/`port` per packet, and `prow` the arena row of each packet's bytes. The
    rows stay borrowed from their rings until `release()`."""

    def __init__(self, capacity: int, arena: RingArena, rings: list[ShmRing]):
        self.capacity = capacity
        self.arena = arena
        self._base = {id(r): b for r, b in zip(rings, arena.base)}
        # each ring's header words as Python ints: an empty ring (most looks) costs two reads, not
        # numpy scalars (the view keeps the header mapped while this turn lives, even past a close)
        self._words = {id(r): r.h.data.cast("B").cast("Q") for r in rings}
        self.rows = np.zeros((capacity, HEADER_ROW), dtype=np.uint8)
        self.length = np.zeros(capacity, dtype=np.int64)
        self.port = np.zeros(capacity, dtype=np.int64)
        self.prow = np.zeros(capacity, dtype=np.int64)
        # a length past the row (only a broken endpoint writes one): dropped MALFORMED, as a
        # truncated datagram is, and never read past its row
        self.truncated = np.zeros(capacity, dtype=bool)
        self.cut = False  # whether this turn's `truncated` has a True (handle_turn skips the look)
        self._held: list[tuple[ShmRing, int]] = []
        self.filled = 0
        # the parser's header views of the buffer, made once (a structured view costs microseconds)
        view = self.rows[:, :HEADER_LEN]
        self._hdr, self._hb = view.view(DATA_HEADER)[:, 0], view.view(HEARTBEAT_HEADER)[:, 0]

    def reset(self) -> None:
        self.filled = 0
        self.cut = False

    def turn_rows(self, n: int) -> np.ndarray:
        return self.rows[:n]

    def headers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `n` rows as the parser's (data header, heartbeat header) views (`Batch.hdr`, `Batch.hb`)."""
        return self._hdr[:n], self._hb[:n]

    def take(self, ring: ShmRing, port: int, batch: int) -> int:
        """Borrow up to `batch` packets of `ring` (switch port `port`) into the turn; returns how many."""
        words = self._words[id(ring)]
        if words[H_HEAD] == words[H_TAIL]:
            return 0
        start = self.filled
        first, k = ring.borrow(min(batch, self.capacity - start))
        if not k:
            return 0
        self._held.append((ring, k))
        base, mask = self._base[id(ring)], ring.slots - 1
        if k == 1:  # (most turns: one packet a ring) scalar writes instead of eight array calls
            pos = first & mask
            n = int(ring.lengths[pos])
            self.rows[start, :HEADER_LEN] = ring.rows[pos, :HEADER_LEN]
            self.truncated[start] = cut = n > ring.row_bytes
            self.cut |= cut
            self.length[start] = ring.row_bytes if cut else n
            self.prow[start] = base + pos
            self.port[start] = port
            self.filled = start + 1
            return 1
        done = 0
        while done < k:  # at most two pieces: up to the ring's end, then from its start
            pos = (first + done) & mask
            m = min(k - done, ring.slots - pos)
            a = start + done
            self.rows[a:a + m, :HEADER_LEN] = ring.rows[pos:pos + m, :HEADER_LEN]
            self.length[a:a + m] = ring.lengths[pos:pos + m]
            self.prow[a:a + m] = np.arange(base + pos, base + pos + m)
            done += m
        over = self.length[start:start + k] > ring.row_bytes
        self.truncated[start:start + k] = over
        if over.any():
            self.cut = True
            self.length[start:start + k][over] = ring.row_bytes
        self.port[start:start + k] = port
        self.filled = start + k
        return k

    def release(self) -> None:
        """Give every borrowed row back to its ring (after the turn's last access to them)."""
        for ring, k in self._held:
            if ring.h is not None:  # a ring closed meanwhile (the switch stopping) has no counters left
                ring.release(k)
        self._held.clear()
