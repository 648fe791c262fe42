"""The endpoint's side of a shared-memory switch port (`ShmEndpoint`): what an engine attaches
to instead of a UDP socket when its switch runs on the same host. The rings, pools and their
memory ordering are `shm_ring`'s (its module docstring); this module only maps them from the
endpoint's side: it produces on the port's up ring and consumes its down ring (and the
multicast pools its references point into). `ShmEndpoint` is the "shm" kind of the endpoint
`Transport` (transport.py, which opens it: `shm_transport`), and a `RowFill`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import numpy as np

from .shm_ring import LEN_MASK, REF, ShmPool, ShmRing, pool_path

# the ufuncs' reductions, without the ndarray methods' Python wrappers (several per recv, one per send)
_ANY, _ALL, _MIN, _SUM = np.logical_or.reduce, np.logical_and.reduce, np.minimum.reduce, np.add.reduce
_REF = int(REF)


def check_prefix(prefix: str) -> None:
    """Endpoints map rings only from /dev/shm (a plan naming another path is refused)."""
    if not os.path.abspath(prefix).startswith("/dev/shm/"):
        raise ValueError(f"refusing to map {prefix!r}: shared-memory ports live in /dev/shm")


class ShmEndpoint:
    """The endpoint's side of a shared-memory switch port, a `transport.Transport` like
    `BatchSocket`: `recv()` lends `rx[:k]`/`rx_len[:k]` (the ring's rows, until the next `recv()`
    or `arm()`), `send_rows()` publishes rows, `fd` is what poll() waits on once `arm()`ed (the
    down ring's doorbell), `stats` counts packets and bytes.

    Args:
        prefix: the port's ring pair (`<prefix>.up`, `<prefix>.down`), made by the switch.
        batch: packets taken per `recv()`.
    """

    PEER_CHECK = 0.5  # s between checks of the switch's pid (each reads /proc)
    kind = "shm"
    doorbell = True  # the switch rings only an armed ring: arm() before every sleep

    def __init__(self, prefix: str, batch: int = 64):
        check_prefix(prefix)
        try:
            self.down = ShmRing(prefix + ".down", "consumer")
        except FileNotFoundError:
            raise ConnectionRefusedError(errno.ECONNREFUSED,
                                         f"no switch port at {prefix} (its rings are gone)") from None
        try:
            self.up = ShmRing(prefix + ".up", "producer")
        except BaseException:
            self.down.close()
            raise
        self.prefix = prefix
        self.address = prefix
        self.batch = batch
        # rx is a view of the down ring's rows, lent until the next recv() or arm() (no copy: the
        # engine decodes results straight from shared memory); rx_len their lengths
        self._empty = self.rx = self.down.rows[:0]  # the one empty view, not a new slice per give-back
        self.rx_len = np.zeros(batch, dtype=np.int64)
        self._lent = 0
        self._pools: dict[int, ShmPool] = {}  # the switch's multicast pools this port was sent rows of
        self.stats = {"rx_packets": 0, "rx_bytes": 0, "tx_packets": 0, "tx_bytes": 0, "tx_errors": 0,
                      "rx_lost": 0}
        self._checked = -1e9
        self._gone = False
        # set when `send_filled` found the up ring full (the rest is sent later): the engine then
        # takes another turn at once if that turn published something (no doorbell tells a
        # producer that the switch made room); the engine clears it before each turn's sends
        self.tx_full = False

    @property
    def fd(self) -> int:
        return self.down.fd

    def arm(self, drain: bool = True) -> bool:
        """Call before sleeping in poll() on `fd`; False: packets arrived, do not sleep (ShmRing.arm).
        Gives back the rows the last `recv()` lent. `drain=False` skips the doorbell's read for a
        caller whose last poll() did not report `fd` (no byte to take: a late one only wakes poll)."""
        self._give_back()
        return self.down.arm(drain)

    def _give_back(self) -> None:
        self.down.release(self._lent)
        self._lent = 0
        self.rx = self._empty

    def recv(self, block: bool = False) -> int:
        """Lend up to `batch` received packets as `rx[:k]` / `rx_len[:k]` (rows of the ring
        itself or of a multicast pool it references, valid until the next `recv()`, `arm()` or
        `close()`; the rows before are given back to the switch now). Returns k."""
        if self._lent:
            self._give_back()
        if self.down.pending() <= 0:
            return 0  # the common empty look at the end of a turn: no numpy views made
        while True:
            pos, k = self.down.lend(self.batch)
            if not k:
                return 0
            lengths = self.down.lengths[pos:pos + k]
            lens = lengths.tolist()
            if min(lens) >= _REF:  # every entry a reference (REF is the top bit): the usual batch
                # read as Python ints: a batch is a few entries, and a dozen numpy calls on them
                # cost more than the entries (the general code below is the reference)
                refs_at = np.ascontiguousarray(self.down.rows[pos:pos + k, :16]).view(np.uint64).tolist()
                first, pool_id = refs_at[0]
                pool = self._pool(pool_id)
                # one pool, consecutive rows inside it: the whole batch is one run, lent as is
                if pool is not None and first + k <= pool.slots \
                        and all(refs_at[i] == [first + i, pool_id] for i in range(1, k)):
                    self.rx = pool.rows[first:first + k]
                    self._lent = k
                    self.rx_len[:k] = lengths & LEN_MASK
                    self.stats["rx_packets"] += k
                    self.stats["rx_bytes"] += sum(lens) - k * _REF  # every length carries the REF bit
                    return k
            refs = (lengths & REF) != 0
            if not refs[0]:  # packets in the ring itself, up to the first reference
                k = int(np.argmax(refs)) if _ANY(refs) else k
                self.rx = self.down.rows[pos:pos + k]
                break
            # references to a multicast pool: the run of them that is contiguous in one pool
            # gathered in one pass: the entries sit a ring row apart (a cache and TLB miss each)
            words = np.ascontiguousarray(self.down.rows[pos:pos + k, :16]).view(np.uint64)
            at, ids = words[:, 0].astype(np.int64), words[:, 1]
            same = refs & (ids == ids[0])
            pool = self._pool(int(ids[0]))
            run = same & (at - at[0] == np.arange(k)) & (at < (pool.slots if pool else 0))
            n = k if _ALL(run) else int(np.argmin(run))
            if n and pool is not None:  # n > 0 only when the pool is mapped (its slots bound `run`)
                k = n
                self.rx = pool.rows[at[0]:at[0] + k]
                break
            # the pool is gone (the switch stopped) or the reference is out of it: those packets
            # are lost, as on a dropped link (never read from a row that is not the packet's)
            lost = int(np.argmin(same)) if not same.all() else k
            self.down.release(max(lost, 1))
            self.stats["rx_lost"] += max(lost, 1)
        self._lent = k
        self.rx_len[:k] = lengths[:k] & LEN_MASK
        self.stats["rx_packets"] += k
        self.stats["rx_bytes"] += int(np.add.reduce(self.rx_len[:k]))
        return k

    def _pool(self, pool_id: int) -> ShmPool | None:
        """Multicast pool `pool_id` of this port's switch, mapped once (None: it is gone)."""
        pool = self._pools.get(pool_id)
        if pool is None:
            try:
                pool = self._pools[pool_id] = ShmPool(pool_path(self.down.peer_pid(), pool_id))
            except (OSError, ValueError):
                return None
        return pool

    def send_rows(self, buf: np.ndarray, idx, lengths, dests=None) -> int:
        """Publish rows `idx` of `buf`; returns how many were offered (a full ring loses the
        rest, counted in tx_errors, as a full socket buffer would)."""
        idx = np.asarray(idx, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        n, _, nbytes = self.up.push_rows(buf, idx, lengths)
        self.stats["tx_packets"] += n
        self.stats["tx_bytes"] += nbytes
        self.stats["tx_errors"] += len(idx) - n
        return len(idx)

    def send_packet(self, data: bytes) -> int:
        """Publish one packet given as bytes (ShmRing.push_packet: a heartbeat or a PULL, with no
        numpy row built for it); returns 1 (a full ring loses it, counted in tx_errors)."""
        if self.up.push_packet(data):
            self.up.notify()
            self.stats["tx_packets"] += 1
            self.stats["tx_bytes"] += len(data)
        else:
            self.stats["tx_errors"] += 1
        return 1

    @property
    def tx_row_bytes(self) -> int:
        """The largest packet `send_filled` can write (the up ring's row)."""
        return self.up.row_bytes

    def send_filled(self, n: int, write: Callable[[int, int, np.ndarray, np.ndarray], None]) -> int:
        """Publish up to `n` packets that `write(j0, j1, rows, lengths)` writes straight into the
        up ring (ShmRing.fill_rows: the engine's packet fill, with no send-ring copy); returns how
        many were published (a full ring takes fewer: send the rest later, nothing is lost)."""
        nbytes = 0

        def counted(j0: int, j1: int, rows: np.ndarray, lengths: np.ndarray) -> None:
            nonlocal nbytes
            write(j0, j1, rows, lengths)
            nbytes += int(_SUM(lengths))

        k = self.up.fill_rows(n, counted)
        if k < n:
            self.tx_full = True
        if k:
            self.up.notify()
            self.stats["tx_packets"] += k
            self.stats["tx_bytes"] += nbytes
        return k

    def drain_errors(self) -> int:
        """No kernel error queue on a ring: 0 (its peer's death shows in `peer_gone`)."""
        return 0

    def peer_gone(self, now: float) -> str | None:
        """A line naming the switch when its process is gone (checked every PEER_CHECK s)."""
        if not self._gone and now - self._checked >= self.PEER_CHECK:
            self._checked = now
            self._gone = self.down.peer_alive() is False
        if not self._gone:
            return None
        return f"the switch process (pid {self.down.peer_pid()}) that owns {self.prefix} has exited"

    def close(self) -> None:
        self._empty = self.rx = np.empty((0, self.rx.shape[1]), dtype=np.uint8)  # no view left: the mapping can go
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self.down.close()
        self.up.close()
