"""Shared-memory packet rings: the datapath between the software switch and endpoints on the
same host (the loopback default), with no system call per packet.

A switch port over shared memory is a pair of rings, each a file in /dev/shm holding `slots`
fixed-size rows (one luwu datagram per row) and their lengths: `<prefix>.up` carries the
endpoint's packets to the switch, `<prefix>.down` the switch's packets to the endpoint. Each
ring has exactly one producer and one consumer (single producer, single consumer), so the only
shared state is two counters in the ring's header:

* `head`: packets ever published (written by the producer only);
* `tail`: packets ever consumed (written by the consumer only).

Row `i` of the ring holds packet number `i mod slots`; the ring is empty when head == tail and
full when head - tail == slots. The counters are 64-bit and never wrap in practice.

Memory ordering. x86-64 is TSO: stores become visible to other cores in program order, loads
are not reordered with other loads, and stores are not reordered with earlier loads. The
producer copies rows and lengths first and then stores `head`; a consumer that loads the new
`head` therefore sees the rows (store-store order on the producer, load-load order on the
consumer). The consumer copies rows out and then stores `tail`; a producer that sees the new
`tail` may overwrite those rows (load-store order). The counters are aligned 8-byte words
written and read through numpy scalar assignment/indexing, which is one aligned `mov` (atomic
on x86-64), and every access is a separate call through the interpreter, which no compiler can
reorder. Weakly ordered CPUs (ARM, POWER) would need fences that Python cannot issue, so
`supported()` says no there and the loopback plan falls back to UDP.

Wake-ups. Each ring has a doorbell: a named FIFO `<ring>.bell` that both sides open read-write
and non-blocking (so neither open nor write ever blocks or fails for want of the other side),
and a `waiting` word in the header that only the consumer writes. A consumer about to sleep
calls `arm()`: it sets `waiting`, issues a full fence, drains the doorbell and looks again; only
if the ring is still empty does it sleep in poll() on the doorbell's fd (it clears `waiting`
when it next finds packets; a consumer that merely found the ring empty between two pieces of
work does not arm it, so a busy peer is not rung). The producer publishes `head`, issues a
full fence, and writes one byte to the doorbell only if `waiting` is set (and not again until
the consumer's `tail` has passed what that byte announced: `notify`). This is Dekker's
pattern: with a fence on both sides, either the consumer's second look sees the new `head` or
the producer sees `waiting` and rings -- no lost wake-up, no busy polling, and no system call
at all while the consumer is busy (a doorbell write costs the producer a wake-up in the kernel:
13-15% of the switch's CPU when rung for every batch). x86 may run a load before an earlier
store (the store buffer), so the fence is needed: `full_fence()` acquires and releases a lock,
a locked read-modify-write (`lock cmpxchg`), which orders every earlier store before every
later load.

Multicast pools. A packet the switch sends to several ports is written once into a pool file
(`ShmPool`, one per set of ports) and each port's down ring gets a reference entry: its length
carries the REF bit and its row the pool position and pool id. `ShmEndpoint.recv` (shm_endpoint.py) lends a run of
pool rows exactly as it lends ring rows; releasing the references (moving `tail` past them) is
what tells the switch the endpoint is done with the pool rows (the same load-before-store order
as a ring row: the switch, the pool's only writer, rewrites a row only after it saw every
referencing ring's `tail` pass it).

Liveness. The header records the pid (and kernel start time, against pid reuse) of the process
on each side; `peer_alive()` checks the other side's entry in /proc, so a crashed switch or
endpoint is named within a check interval instead of looking like silence.
"""

from __future__ import annotations

import itertools
import mmap
import os
import platform
import stat
import sys
import threading
from collections.abc import Callable

import numpy as np

MAGIC = 0x4C55575552494E47  # "LUWURING"
LAYOUT = 1
HEADER_BYTES = 4096
ROW_ALIGN = 64
# header words (uint64): identity and geometry, then one side's pid per word pair; head and tail
# sit on their own cache lines so the producer and consumer do not write the same line
H_MAGIC, H_LAYOUT, H_SLOTS, H_ROW = 0, 1, 2, 3
H_PRODUCER_PID, H_PRODUCER_START, H_CONSUMER_PID, H_CONSUMER_START = 4, 5, 6, 7
H_HEAD = 8  # byte 64
H_TAIL = 16  # byte 128
H_WAITING = 24  # byte 192: the consumer may be asleep in poll() (written by the consumer only)
_FENCE = threading.Lock()
_DRAIN = 65536  # bytes a doorbell read takes at most
# A down-ring entry whose length has this bit is a reference, not a packet: its row holds (uint64
# pool position, uint64 pool id) and the packet is that row of the switch's multicast pool
# `pool_path(producer pid, id)` (ShmPool), written once for every port of the multicast group
REF = np.uint32(1 << 31)
LEN_MASK = np.uint32(REF - 1)
POOL_MAGIC = 0x4C5557554D43504C  # "LUWUMCPL"


def full_fence() -> None:
    """A full memory barrier: a locked read-modify-write on x86-64 (see the module docstring)."""
    _FENCE.acquire()
    _FENCE.release()


def supported() -> bool:
    """Whether shared-memory rings are safe here (Linux on x86-64: see the module docstring)."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def process_start(pid: int) -> int | None:
    """The kernel's start time of process `pid` (clock ticks since boot), None if it is gone
    or a zombie (a crashed process whose parent has not reaped it yet is dead for us)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2:].split()  # the name may contain spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _alive(pid: int, start: int) -> bool:
    now = process_start(pid)
    return now is not None and (start == 0 or now == start)


class RingBusy(ValueError):
    """The ring side this process asked for is held by another live process."""


def row_bytes_for(max_packet: int) -> int:
    return -(-max_packet // ROW_ALIGN) * ROW_ALIGN


def copy_rows(dst: np.ndarray, start: int, src: np.ndarray, idx: np.ndarray, off: int, used: int) -> None:
    """dst[start + i, :used] = src[idx[i], off:off + used] for every i, one slice copy per run of
    consecutive rows: a plain memcpy per run, where `np.take` or a fancy-index copy of 64 KiB
    rows runs 2-3x slower (measured; they were the largest item of the switch's profile)."""
    n = len(idx)
    if n == 0:
        return
    cuts = () if n == 1 else np.flatnonzero(np.diff(idx) != 1) + 1  # (one row: no numpy call to find runs)
    if len(cuts) == 0:
        i0 = int(idx[0])
        dst[start:start + n, :used] = src[i0:i0 + n, off:off + used]
        return
    bounds = [0, *cuts.tolist(), n]
    for a, b in itertools.pairwise(bounds):
        i0 = int(idx[a])
        dst[start + a:start + b, :used] = src[i0:i0 + b - a, off:off + used]


def pool_path(switch_pid: int, pool_id: int) -> str:
    """Where the multicast pool `pool_id` of the switch process `switch_pid` lives."""
    return f"/dev/shm/luwu-sw-{switch_pid}-mc{pool_id}"


def _map_file(path: str, create_size: int, what: str) -> mmap.mmap:
    """Map `path` whole: made new (mode 0600, never over an existing file) at `create_size` bytes,
    or (create_size 0) an existing one, which must at least hold the header."""
    if create_size:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, create_size)
        size = create_size
    else:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
    try:
        if size < HEADER_BYTES:
            raise ValueError(f"{path} is not a {what} (only {size} bytes)")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unmap(mapping: mmap.mmap, paths: tuple[str, ...]) -> None:
    """Close a mapping (a live view keeps it until it goes) and remove the files of its owner."""
    try:
        mapping.close()
    except BufferError:
        pass  # a view is still alive; the mapping goes with it
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ShmPool:
    """The rows of a multicast pool: `slots` rows of `row_bytes`, written once by the switch for
    every port of a multicast group and read in place by each of their endpoints.

    The file is rows only (plus a header with its geometry): which rows are in use is the
    switch's private bookkeeping (attach_shm.MulticastPools), since the switch is the only writer
    and learns that every reader is done from the tails of the readers' own down rings (a row is
    reused only after every down ring that references it has been consumed past the reference:
    the same ordering argument as a ring's rows, module docstring). `create` makes the file
    (the switch; it unlinks it on close), otherwise it is mapped (an endpoint).
    """

    def __init__(self, path: str, slots: int = 0, row_bytes: int = 0, create: bool = False):
        self.path = path
        self.owner = create
        if create and (slots <= 0 or slots & (slots - 1) or row_bytes <= 0 or row_bytes % ROW_ALIGN):
            raise ValueError(f"pool geometry {slots} x {row_bytes}: slots a power of two, rows of "
                             f"{ROW_ALIGN}-byte multiples")
        self._map = _map_file(path, HEADER_BYTES + slots * row_bytes if create else 0, "luwu multicast pool")
        size = len(self._map)
        self.h = np.frombuffer(self._map, dtype=np.uint64, count=HEADER_BYTES // 8)
        if create:
            self.h[H_SLOTS], self.h[H_ROW], self.h[H_LAYOUT] = slots, row_bytes, LAYOUT
            self.h[H_MAGIC] = POOL_MAGIC
        elif int(self.h[H_MAGIC]) != POOL_MAGIC or int(self.h[H_LAYOUT]) != LAYOUT:
            raise ValueError(f"{path} is not a luwu multicast pool of layout {LAYOUT}")
        self.slots = int(self.h[H_SLOTS])
        self.row_bytes = int(self.h[H_ROW])
        if size < HEADER_BYTES + self.slots * self.row_bytes:
            raise ValueError(f"{path} is truncated")
        self.rows = np.frombuffer(self._map, dtype=np.uint8, count=self.slots * self.row_bytes,
                                  offset=HEADER_BYTES).reshape(self.slots, self.row_bytes)

    def close(self) -> None:
        self.h = self.rows = None
        unmap(self._map, (self.path,) if self.owner else ())


class ShmRing:
    """One direction of a shared-memory port: `slots` rows of `row_bytes`, head/tail counters.

    `create` makes the file and its doorbell (the switch does, and unlinks them on close);
    `attach` maps an existing one (the endpoint). `role` is "producer" or "consumer": it decides
    which counter this side writes and which pid word it fills in.
    """

    def __init__(self, path: str, role: str, slots: int = 0, row_bytes: int = 0, create: bool = False):
        if role not in ("producer", "consumer"):
            raise ValueError(f"ring role must be producer or consumer, got {role!r}")
        self.path = path
        self.bell_path = path + ".bell"
        self.role = role
        self.owner = create
        if create:
            if slots <= 0 or slots & (slots - 1):
                raise ValueError(f"ring slots must be a power of two, got {slots}")
            if row_bytes <= 0 or row_bytes % ROW_ALIGN:
                raise ValueError(f"ring rows must be a positive multiple of {ROW_ALIGN} bytes, got {row_bytes}")
            os.mkfifo(self.bell_path, 0o600)
        self._map = _map_file(path, self._size(slots, row_bytes) if create else 0, "luwu packet ring")
        size = len(self._map)
        self.h = np.frombuffer(self._map, dtype=np.uint64, count=HEADER_BYTES // 8)
        if create:
            self.h[H_SLOTS], self.h[H_ROW], self.h[H_LAYOUT] = slots, row_bytes, LAYOUT
            self.h[H_MAGIC] = MAGIC  # last: a half-made ring never looks valid
        elif int(self.h[H_MAGIC]) != MAGIC or int(self.h[H_LAYOUT]) != LAYOUT:
            raise ValueError(f"{path} is not a luwu packet ring of layout {LAYOUT}")
        self.slots = int(self.h[H_SLOTS])
        self.row_bytes = int(self.h[H_ROW])
        if size < self._size(self.slots, self.row_bytes) or not stat.S_ISFIFO(os.stat(self.bell_path).st_mode):
            raise ValueError(f"{path} is truncated or has no doorbell")
        self._mask = self.slots - 1
        self._rung_head = 0  # `head` when this producer last rang: notify() rings once per wake-up
        len_off = HEADER_BYTES
        rows_off = HEADER_BYTES + self._len_bytes(self.slots)
        self.lengths = np.frombuffer(self._map, dtype=np.uint32, count=self.slots, offset=len_off)
        self.rows = np.frombuffer(self._map, dtype=np.uint8, count=self.slots * self.row_bytes,
                                  offset=rows_off).reshape(self.slots, self.row_bytes)
        self.bell = os.open(self.bell_path, os.O_RDWR | os.O_NONBLOCK)
        mine = (H_PRODUCER_PID, H_PRODUCER_START) if role == "producer" else (H_CONSUMER_PID, H_CONSUMER_START)
        other = int(self.h[mine[0]])
        if not create and other not in (0, os.getpid()) and _alive(other, int(self.h[mine[1]])):
            os.close(self.bell)  # single producer, single consumer: a second one would corrupt the ring
            raise RingBusy(f"{path} already has a {role}: process {other}, which is alive; "
                           "one endpoint per switch port")
        self.h[mine[1]] = process_start(os.getpid()) or 0
        self.h[mine[0]] = os.getpid()
        if role == "consumer" and not create:
            self.h[H_TAIL] = self.h[H_HEAD]  # a new consumer skips what an earlier one left behind
        self._peer_words = (H_CONSUMER_PID, H_CONSUMER_START) if role == "producer" else (H_PRODUCER_PID,
                                                                                             H_PRODUCER_START)

    @staticmethod
    def _len_bytes(slots: int) -> int:
        return -(-4 * slots // HEADER_BYTES) * HEADER_BYTES

    @classmethod
    def _size(cls, slots: int, row_bytes: int) -> int:
        return HEADER_BYTES + cls._len_bytes(slots) + slots * row_bytes

    @property
    def fd(self) -> int:
        """The doorbell's fd: readable when the producer published since the last drain."""
        return self.bell

    def pending(self) -> int:
        return int(self.h[H_HEAD]) - int(self.h[H_TAIL])

    def published(self) -> int:
        """Packets ever published (`head`)."""
        return int(self.h[H_HEAD])

    def consumed(self) -> int:
        """Packets ever consumed (`tail`): the consumer is done with every row before it."""
        return int(self.h[H_TAIL])

    # -- producer --------------------------------------------------------------------------------
    def push_rows(self, buf: np.ndarray, idx: np.ndarray, lengths: np.ndarray, off: int = 0,
                  notify: bool = True) -> tuple[int, int, int]:
        """Copy rows `idx` of the 2-D uint8 `buf` (packet i is `buf[idx[i], off:off + lengths[i]]`)
        into the ring and publish them. Returns (published, too long, bytes published): packets longer than a
        row are left out; when the ring is full the rest are left out too (the caller counts
        them lost, like datagrams a full socket buffer drops). `notify=False` leaves the doorbell
        to a later `notify()` (a switch publishes to every port of a turn first, then wakes them)."""
        idx = np.asarray(idx, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        fits = lengths <= self.row_bytes
        too_long = int(len(idx) - fits.sum())
        if too_long:
            idx, lengths = idx[fits], lengths[fits]
        if not len(idx):
            return 0, too_long, 0
        width = min(buf.shape[1] - off, self.row_bytes)

        def write(j0: int, j1: int, rows: np.ndarray, lens: np.ndarray) -> None:
            # copy what the packets use: a piece of header-only rows (ZERO contributions,
            # docs/protocol.md 3.2) costs its headers, not its rows
            copy_rows(rows, 0, buf, idx[j0:j1], off, min(width, int(lengths[j0:j1].max())))
            lens[:] = lengths[j0:j1]

        n = self.fill_rows(len(idx), write)
        if notify and n:
            self.notify()
        return n, too_long, int(lengths[:n].sum())

    def push_packet(self, data: bytes) -> int:
        """Publish one packet given as bytes (a heartbeat, a PULL: built with struct, not as a numpy
        row) without `push_rows`' batch machinery; returns 1, or 0 when the ring is full or the
        packet is longer than a row (the caller counts it lost, as `push_rows` does). Not rung:
        call `notify()`."""
        n = len(data)
        head = int(self.h[H_HEAD])
        if n > self.row_bytes or head - int(self.h[H_TAIL]) >= self.slots:
            return 0
        pos = head & self._mask
        self.rows[pos, :n] = np.frombuffer(data, dtype=np.uint8)
        self.lengths[pos] = n
        self.h[H_HEAD] = head + 1  # publish: after the row (x86 keeps stores in order)
        return 1

    def push_refs(self, pool_id: int, pool_pos: np.ndarray | list[int], lengths: np.ndarray | list[int]) -> int:
        """Publish references to rows `pool_pos` of multicast pool `pool_id` (packets of
        `lengths` bytes, written there by the caller) instead of the packets; returns how many fit
        (a full ring leaves the rest out, as `push_rows` does). Not rung: call `notify()`."""
        def write(j0: int, j1: int, rows: np.ndarray, lens: np.ndarray) -> None:
            words = rows[:, :16].view(np.uint64)
            words[:, 0] = pool_pos[j0:j1]
            words[:, 1] = pool_id
            lens[:] = np.asarray(lengths[j0:j1], dtype=np.uint32) | REF

        return self.fill_rows(len(pool_pos), write)  # published after the references (fill_rows)

    def fill_rows(self, n: int, write: Callable[[int, int, np.ndarray, np.ndarray], None]) -> int:
        """Have `write(j0, j1, rows, lengths)` write packets j0..j1-1 of a batch of `n` straight
        into free rows of the ring (`rows`: a C-contiguous view of them, `lengths`: theirs), then
        publish them: no staging copy. Returns how many were published: fewer than `n` when the
        ring is full (the caller keeps the rest for later). Writes only rows past `tail`, which
        the consumer no longer reads, and publishes after them (the module docstring's order),
        so a consumer never sees a row half written. Not rung: call `notify()`."""
        head = int(self.h[H_HEAD])
        n = min(n, self.slots - (head - int(self.h[H_TAIL])))
        done = 0
        while done < n:  # at most two pieces: up to the end of the ring, then from its start
            pos = (head + done) & self._mask
            k = min(n - done, self.slots - pos)
            write(done, done + k, self.rows[pos:pos + k], self.lengths[pos:pos + k])
            done += k
        if n > 0:
            self.h[H_HEAD] = head + n  # publish: after the rows (x86 keeps stores in order)
        return max(n, 0)

    def notify(self) -> None:
        """Ring the doorbell if the consumer is armed (after publishing: see the module docstring).

        Not again while the consumer has not consumed up to what the last ring announced: it
        cannot sleep before it has (it sleeps only on an empty ring), and once it has, its next
        arm() sees this publication or this side sees its `tail` move and rings (the same Dekker
        pair of fences). A producer that publishes twice in a turn (a worker's gradients, then
        its heartbeat) then writes the doorbell once, and the consumer finds one byte, not two."""
        full_fence()  # the store of head before the load of waiting (Dekker)
        h = self.h
        if h[H_WAITING] and int(h[H_TAIL]) >= self._rung_head:
            self._rung_head = int(h[H_HEAD])
            self.ring()

    def ring(self) -> None:
        try:
            os.write(self.bell, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full: the consumer has wake-ups pending already

    # -- consumer --------------------------------------------------------------------------------
    def arm(self, drain: bool = True) -> bool:
        """Before sleeping in poll() on `fd`: ask the producer to ring, and look once more.
        Returns True when the ring is still empty (sleep), False when packets came meanwhile.
        `drain=False` leaves the doorbell as it is: for a caller that knows it holds no byte (a
        byte left there only wakes poll() at once, it never loses a wake-up)."""
        self.h[H_WAITING] = 1
        full_fence()  # the store of waiting before the load of head (Dekker)
        if drain:
            self.drain()
        return self.pending() == 0

    def pop_into(self, rows: np.ndarray, lengths: np.ndarray, start: int, n: int) -> int:
        """Move up to `n` packets into `rows[start:]` / `lengths[start:]`; returns how many."""
        tail = int(self.h[H_TAIL])
        k = min(n, int(self.h[H_HEAD]) - tail)
        if k <= 0:
            return 0
        width = min(rows.shape[1], self.row_bytes)
        done = 0
        while done < k:
            pos = (tail + done) & self._mask
            m = min(k - done, self.slots - pos)
            used = min(width, int(self.lengths[pos:pos + m].max()))  # bytes past a packet's length are not its
            rows[start + done:start + done + m, :used] = self.rows[pos:pos + m, :used]
            lengths[start + done:start + done + m] = self.lengths[pos:pos + m]
            done += m
        self.h[H_TAIL] = tail + k  # release the rows: after copying them out
        if self.h[H_WAITING]:
            self.h[H_WAITING] = 0  # awake and busy: the producer need not ring
        return k

    def lend(self, n: int) -> tuple[int, int]:
        """Up to `n` packets in place, without copying: (row position, count), the rows being
        `rows[pos:pos + count]` (contiguous: a lend stops at the ring's end). They stay the
        consumer's until `release(count)`, which must come before the next `lend`, `pop_into`
        or `arm`."""
        first, k = self.borrow(n)
        pos = first & self._mask
        return pos, min(k, self.slots - pos)

    def borrow(self, n: int) -> tuple[int, int]:
        """Up to `n` packets in place, across the ring's end: (number of the first packet,
        count); packet t is `rows[t & (slots - 1)]`. The consumer may read and rewrite those
        rows until `release(count)` (the switch runs its pipeline on them), which must come
        before the next `borrow`, `lend`, `pop_into` or `arm`."""
        tail = int(self.h[H_TAIL])
        k = min(n, int(self.h[H_HEAD]) - tail)
        if k <= 0:
            return tail, 0
        if self.h[H_WAITING]:
            self.h[H_WAITING] = 0  # awake and busy: the producer need not ring
        return tail, k

    def rows_span(self) -> tuple[int, int]:
        """(file offset, bytes) of the rows: page-aligned, so the region can be mapped again
        elsewhere (the switch maps every up ring's rows side by side: switch/shm_arena.py)."""
        return HEADER_BYTES + self._len_bytes(self.slots), self.slots * self.row_bytes

    def release(self, k: int) -> None:
        """Give `k` lent rows back to the producer (after reading them: x86 keeps the loads first)."""
        if k:
            self.h[H_TAIL] = int(self.h[H_TAIL]) + k

    def drain(self) -> None:
        """Empty the doorbell: one read, or more only while reads come back full (a byte rung
        after a short read is a later wake-up, which poll() reports: never lost)."""
        try:
            while len(os.read(self.bell, _DRAIN)) == _DRAIN:
                pass
        except BlockingIOError:
            pass

    # -- liveness ----------------------------------------------------------------------------------
    def peer_pid(self) -> int:
        return int(self.h[self._peer_words[0]])

    def peer_alive(self) -> bool | None:
        """Whether the process on the other side lives (None: no process attached yet)."""
        pid, start = int(self.h[self._peer_words[0]]), int(self.h[self._peer_words[1]])
        if pid == 0:
            return None
        return _alive(pid, start)

    def close(self) -> None:
        try:
            os.close(self.bell)
        except OSError:
            pass
        self.h = self.lengths = self.rows = None
        unmap(self._map, (self.path, self.bell_path) if self.owner else ())
