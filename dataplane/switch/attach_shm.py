"""Shared-memory attachment: one switch port = a pair of packet rings in /dev/shm (endpoints on
the same host; the loopback default). `luwu.dataplane.net.shm_ring` has the ring layout, its
memory ordering and the doorbells.

The port's identity is the ring: only the process holding the endpoint side can put packets on
it, so there is no source address to check or learn (the classifier's source guard still checks
the worker id against the port). Packets keep UDP-attachment semantics: bare luwu datagrams,
`endpoints` not consulted, a full ring loses packets the way a full socket buffer does (the
protocol recovers). The event loop copies each turn's packets of all shm ports into one shared
buffer and runs them through the pipeline as one batch, like recvmmsg on UDP ports.
`ShmAttachment` is the "shm" kind of `luwu.dataplane.net.transport.SwitchPort` (and adds the
ring's own sends: `send_list`, `send_results`, `send_refs`).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from collections import deque

import numpy as np

from ..kernels import use_numba
from ..net.shm_ring import ShmPool, ShmRing, copy_rows, pool_path, process_start, row_bytes_for
from ..protocol import HEADER_LEN, aggregation_packet_len
from .batch import write_results
from .config import ConfigError, SwitchConfig

SHM_DIR = "/dev/shm"
RING_BYTES = 16 << 20  # per direction: room for every window a port's endpoint may have in flight


def default_slots(row_bytes: int) -> int:
    """Rows per direction: about RING_BYTES, 256..1024 (a stream's window is at most 256 packets of
    4 MiB in all, so a ring holds the windows of the data, meta and node sessions together)."""
    fit = 1 << max(0, (RING_BYTES // row_bytes).bit_length() - 1)
    return min(1024, max(256, fit))
_names = itertools.count()
_RING_NAME = re.compile(r"luwu-sw-(\d+)-(\d+-p\d+\.(up|down)(\.bell)?|mc\d+)")
_pool_ids = itertools.count()
_swept = False


def shm_row_bytes(lanes: int) -> int:
    """Ring row size for a switch of `lanes` lanes: the largest luwu packet, 64-byte aligned."""
    return row_bytes_for(aggregation_packet_len(lanes) + 64)  # + slack, as the engine's receive rows have


def sweep_stale() -> int:
    """Remove the ring files of switch processes that died without removing them (SIGKILL, a
    crash): only files named after a pid that no longer runs. Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        m = _RING_NAME.fullmatch(name)
        if m and int(m.group(1)) != os.getpid() and process_start(int(m.group(1))) is None:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass  # another switch swept it first, or it is not ours to remove
    return removed


def ring_prefix(port: int) -> str:
    return os.path.join(SHM_DIR, f"luwu-sw-{os.getpid()}-{next(_names)}-p{port}")


class ShmAttachment:
    """A switch port on a pair of rings (module docstring; the `SwitchPort` interface)."""

    kind = "shm"
    framed = False

    def __init__(self, port: int, config: SwitchConfig, prefix: str | None = None, slots: int | None = None):
        if not os.path.isdir(SHM_DIR):
            raise ConfigError(f"shm port {port}: {SHM_DIR} does not exist; attach the port over UDP instead")
        global _swept
        if not _swept:  # once per process: the leftovers of killed switches do not pile up in RAM
            _swept = True
            sweep_stale()
        self.port = port
        self.prefix = prefix or ring_prefix(port)
        row = shm_row_bytes(config.lanes)
        slots = slots or default_slots(row)
        try:
            self.rx = ShmRing(self.prefix + ".up", "consumer", slots, row, create=True)
        except (FileExistsError, ValueError) as e:
            raise ConfigError(f"shm port {port}: cannot create {self.prefix}.up: {e}") from None
        try:
            self.tx = ShmRing(self.prefix + ".down", "producer", slots, row, create=True)
        except (FileExistsError, ValueError) as e:
            self.rx.close()
            raise ConfigError(f"shm port {port}: cannot create {self.prefix}.down: {e}") from None
        self.row_bytes = row
        self.address = self.prefix
        self.peer = self.prefix  # always "connected": the ring is the endpoint
        self.stats = {"tx_ring_full": 0, "tx_too_long": 0}
        self._named_gone = False

    @property
    def fd(self) -> int:
        return self.rx.fd

    def arm(self, drain: bool = True) -> bool:
        """Before the event loop sleeps in poll(): False when packets arrived meanwhile (ShmRing.arm;
        `drain=False`: the doorbell cannot hold a byte, event loop)."""
        return self.rx.arm(drain)

    def recv_into(self, rx, batch: int) -> int:
        """Move up to `batch` packets into the next free rows of the event loop's shared buffer."""
        start = rx.filled
        k = self.rx.pop_into(rx.rows, rx.length, start, min(batch, rx.capacity - start))
        if k:
            rx.port[start:start + k] = self.port
            rx.filled = start + k
        return k

    def send_rows(self, rows: np.ndarray, idx: np.ndarray, lengths: np.ndarray, off: int = 0,
                  notify: bool = True) -> int:
        """Publish rows `idx` of `rows` (the luwu datagram at `off`); returns how many went on the
        ring. `notify=False`: the caller wakes the endpoint later with `notify()`."""
        n, too_long, _ = self.tx.push_rows(rows, idx, lengths, off, notify)
        full = len(idx) - too_long - n
        if too_long:
            self.stats["tx_too_long"] += too_long
        return self._published(n, n + full)

    def _published(self, n: int, wanted: int) -> int:
        """`n` of `wanted` packets went on the ring: the rest were lost to a full ring (counted, and
        the endpoint named if it is gone). Returns n."""
        if n < wanted:
            self.stats["tx_ring_full"] += wanted - n
            self._name_if_gone()
        return n

    def send_list(self, src: np.ndarray, rows: list[int], lengths: list[int]) -> int:
        """`send_rows` for a few packets given as Python ints (the datagram of packet i is
        `src[rows[i], :lengths[i]]`): one slice copy per packet instead of `push_rows`' array
        calls (fast/emit_shm.py's turns of one to a few copies). Not rung: `notify()`."""
        if max(lengths) > self.row_bytes:  # (never from the pipeline) counted as send_rows counts it
            return self.send_rows(src, np.array(rows, dtype=np.int64), np.array(lengths, dtype=np.int64), 0,
                                  notify=False)

        def write(j0: int, j1: int, dst: np.ndarray, lens: np.ndarray) -> None:
            for j in range(j0, j1):
                n = lengths[j]
                dst[j - j0, :n] = src[rows[j], :n]
            lens[:] = lengths[j0:j1]

        n = self.tx.fill_rows(len(rows), write)
        return self._published(n, len(rows))

    def send_results(self, heads: np.ndarray, lanes: np.ndarray, reg: np.ndarray, lengths: np.ndarray) -> int:
        """Publish packets whose header is a row of `heads` and whose lanes are lane registers
        `reg` of `lanes` (a sum the fold left in its register: Batch.results), written straight
        into the ring's rows (one write of the sum, no copy of a row it was first written to).
        Returns how many went on the ring (a full ring loses the rest, as `send_rows`). Every
        length must fit a row. Not rung: `notify()`."""
        n_lanes = lanes.shape[1]

        def write(j0: int, j1: int, rows: np.ndarray, lens: np.ndarray) -> None:
            rows[:, :HEADER_LEN] = heads[j0:j1, :HEADER_LEN]
            write_results(lanes, reg[j0:j1], rows[:, HEADER_LEN:HEADER_LEN + 4 * n_lanes].view(">i4"),
                          np.arange(j1 - j0))
            lens[:] = lengths[j0:j1]

        n = self.tx.fill_rows(len(reg), write)
        return self._published(n, len(reg))

    def send_refs(self, pool_id: int, pool_pos: np.ndarray | list[int], lengths: np.ndarray | list[int]) -> int:
        """Publish references to rows of multicast pool `pool_id` (MulticastPools); returns how
        many went on the ring (a full ring loses the rest, as `send_rows`). Not rung: `notify()`."""
        n = self.tx.push_refs(pool_id, pool_pos, lengths)
        return self._published(n, len(pool_pos))

    def notify(self) -> None:
        self.tx.notify()

    def _name_if_gone(self) -> None:
        """A full ring whose reader has exited: say so once (its packets are lost until it comes back)."""
        if not self._named_gone and self.tx.peer_alive() is False:
            self._named_gone = True
            print(f"luwu switch: port {self.port}: its endpoint (pid {self.tx.peer_pid()}) has exited; "
                  f"packets to it are dropped", file=sys.stderr)

    def endpoint_alive(self) -> bool | None:
        """Whether the endpoint process on this port lives (None: none attached yet)."""
        return self.tx.peer_alive()

    def close(self) -> None:
        self.rx.close()
        self.tx.close()


class _Pool:
    """One multicast pool and the switch's record of which rows its readers still hold."""

    def __init__(self, row_bytes: int, slots: int):
        self.id = next(_pool_ids)
        self.shm = ShmPool(pool_path(os.getpid(), self.id), slots, row_bytes, create=True)
        self.slots = slots
        self.head = 0  # rows ever written
        self.tail = 0  # rows every reader is done with
        # (pool head after a turn's rows, [(attachment, its down ring's head after their references)])
        self.claims: deque[tuple[int, list[tuple[ShmAttachment, int]]]] = deque()
        self._lanes: tuple[np.ndarray, tuple[np.ndarray, int] | None] | None = None  # lanes_view

    def lanes_view(self, lanes: int) -> tuple[np.ndarray, tuple[np.ndarray, int] | None]:
        """The `payload` and `flat` arguments of batch.write_results for this pool's rows (packets
        at offset 0), made once (`flat` None: kernels off when they were made)."""
        # (remade once kernels are on: a pool made while they loaded would otherwise stride anew per fill)
        if self._lanes is None or self._lanes[0].shape[1] != lanes or (self._lanes[1] is None and use_numba()):
            payload = self.shm.rows[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4")
            flat = None
            if use_numba():
                from ..kernels.switch_lanes import lane_rows

                flat = lane_rows(payload.view(np.uint32))
            self._lanes = payload, flat
        return self._lanes

    def reclaim(self, check_dead: bool) -> None:
        """Free the rows of turns every reader consumed past (or, with `check_dead`, whose
        remaining readers' processes have exited: a restarted endpoint skips what they left)."""
        while self.claims:
            end, holders = self.claims[0]
            for att, ring_end in holders:
                if att.tx.h is not None and att.tx.consumed() < ring_end and not (
                        check_dead and att.tx.peer_alive() is False):
                    return
            self.claims.popleft()
            self.tail = end

    def alloc(self, n: int) -> np.ndarray:
        """Positions for up to `n` new rows (fewer when readers still hold the pool's rows)."""
        free = self.slots - (self.head - self.tail)
        if free < n:
            self.reclaim(check_dead=False)
            free = self.slots - (self.head - self.tail)
            if free < n:
                self.reclaim(check_dead=True)
                free = self.slots - (self.head - self.tail)
        m = min(n, free)
        pos = (self.head + np.arange(m, dtype=np.int64)) & (self.slots - 1)
        self.head += m
        return pos


class MulticastPools:
    """Multicast without a copy per port: a packet the switch sends to several shared-memory
    ports is written once into the pool of that set of ports (a file each, mapped by their
    endpoints), and each port's down ring gets a reference to the row (ShmRing.push_refs). The
    switch frees a pool row once every down ring that references it was consumed past the
    reference. A reader that stops never blocks the others: when the pool has no free row, the
    packets go inline onto each ring as before (its own ring fills and it is named, as ever).

    Same semantics as per-port copies: the pipeline decided the replicas; only how a replica's
    bytes reach the endpoint changes (order on each ring is the emission's order).
    """

    MAX_POOLS = 64  # sets of ports with a pool; others' multicasts are copied per port

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes
        self.slots = default_slots(row_bytes)
        self._pools: dict[tuple[int, ...], _Pool] = {}

    def pool(self, ports: tuple[int, ...]) -> _Pool | None:
        p = self._pools.get(ports)
        if p is None and len(self._pools) < self.MAX_POOLS:
            try:
                p = self._pools[ports] = _Pool(self.row_bytes, self.slots)
            except OSError as e:  # /dev/shm full: copy per port, as without pools
                print(f"luwu switch: no multicast pool for ports {list(ports)}: {e}", file=sys.stderr)
                self.MAX_POOLS = len(self._pools)
        return p

    def place(self, rows: np.ndarray, off: int, pkt: np.ndarray, port: np.ndarray, lengths: np.ndarray,
              eligible: np.ndarray, prow: np.ndarray | None = None, results: np.ndarray | None = None,
              lanes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Write the rows of every packet that goes to 2+ `eligible` entries into their port set's
        pool (packet i is row i of `rows`, or row `prow[i]`). Returns (pool id, pool position) per
        entry, -1 where the entry is to be copied.

        `results`/`lanes`: a split batch's deferred results (Batch.results): such a packet's row
        holds its header only, its sum is lane register `results[i]` of `lanes`, written here
        straight into the pool row (the sum's one write: no copy of a finished row)."""
        ids = np.full(len(pkt), -1, dtype=np.int64)
        at = np.full(len(pkt), -1, dtype=np.int64)
        groups: dict[tuple[int, ...], list[int] | np.ndarray] = {}
        ent = self._uniform(pkt, port, eligible)
        if ent is not None:  # every entry eligible, each packet to the same ports (no sort needed)
            u = pkt[ent[:, 0]]
            multi = np.arange(len(ent))
            groups[tuple(sorted(port[ent[0]].tolist()))] = multi
        else:
            cand = np.flatnonzero(eligible)
            if len(cand) < 2:
                return ids, at
            order = cand[np.lexsort((port[cand], pkt[cand]))]
            u, first, count = np.unique(pkt[order], return_index=True, return_counts=True)
            multi = np.flatnonzero(count >= 2)
            if not len(multi):
                return ids, at
            # every multicast of the turn to one set of ports, without a Python step per packet;
            # `ent` row j: packet multi[j]'s entries
            c = int(count[multi[0]])
            ent = order[first[multi][:, None] + np.arange(c)] if bool((count[multi] == c).all()) else None
            if ent is not None and not bool((port[ent] == port[ent[0]]).all()):
                ent = None
            if ent is not None:
                groups[tuple(port[ent[0]].tolist())] = multi
            else:
                for i in multi.tolist():
                    a = int(first[i])
                    entries = order[a:a + int(count[i])]
                    groups.setdefault(tuple(port[entries].tolist()), []).append(i)  # type: ignore[union-attr]
        for ports, which in groups.items():
            pool = self.pool(ports)
            if pool is None:
                continue
            pkts = u[which]
            pos = self.fill(pool, pkts, rows, off, lengths, prow, results, lanes)
            if not len(pos):
                continue
            if ent is not None:
                ids[ent[:len(pos)]] = pool.id
                at[ent[:len(pos)]] = pos[:, None]
                continue
            for j, i in enumerate(which[:len(pos)]):
                a = int(first[i])
                entries = order[a:a + int(count[i])]
                ids[entries] = pool.id
                at[entries] = pos[j]
        return ids, at

    @staticmethod
    def fill(pool: _Pool, pkts: np.ndarray, rows: np.ndarray, off: int, lengths: np.ndarray,
             prow: np.ndarray | None = None, results: np.ndarray | None = None,
             lanes: np.ndarray | None = None) -> np.ndarray:
        """Write packets `pkts` (as `place` takes them) into new rows of `pool`; returns their pool
        positions, fewer than `pkts` (the first ones) when readers still hold the pool's rows."""
        pos = pool.alloc(len(pkts))
        used = min(rows.shape[1] - off, pool.shm.row_bytes)
        done = 0
        while done < len(pos):  # at most two pieces: up to the pool's end, then from its start
            k = min(len(pos) - done, pool.slots - int(pos[done]))
            sel = pkts[done:done + k]
            width = min(used, int(lengths[sel].max()))
            reg = None if results is None else results[sel]
            if reg is not None and bool((reg >= 0).all()):
                width = HEADER_LEN  # every packet a deferred result: its header, then the sums
            copy_rows(pool.shm.rows, int(pos[done]), rows, sel if prow is None else prow[sel], off, width)
            if reg is not None and lanes is not None and bool((reg >= 0).any()):
                got = np.flatnonzero(reg >= 0)
                payload, flat = pool.lanes_view(lanes.shape[1])
                write_results(lanes, reg[got], payload, int(pos[done]) + got, flat)
            done += k
        return pos

    @staticmethod
    def fill_list(pool: _Pool, pkts: list[int], rows: np.ndarray, prow: list[int], lengths: list[int],
                  results: list[int] | None = None, lanes: np.ndarray | None = None) -> list[int]:
        """`fill` for a few packets given as Python ints (packet i's datagram is
        `rows[prow[i], :lengths[i]]`, its deferred sum lane register `results[i]` >= 0 of `lanes`):
        one slice copy per packet instead of `fill`'s array calls. Returns the pool positions."""
        pos = pool.alloc(len(pkts)).tolist()
        dst = pool.shm.rows
        used = dst.shape[1]
        regs, at = [], []
        for i, where in zip(pkts, pos):
            if results is not None and results[i] >= 0:  # its header, then the sum from its register
                dst[where, :HEADER_LEN] = rows[prow[i], :HEADER_LEN]
                regs.append(results[i])
                at.append(where)
            else:
                n = min(used, lengths[i])
                dst[where, :n] = rows[prow[i], :n]
        if regs and lanes is not None:
            payload, flat = pool.lanes_view(lanes.shape[1])
            write_results(lanes, np.array(regs, dtype=np.int64), payload, np.array(at, dtype=np.int64), flat)
        return pos

    @staticmethod
    def _uniform(pkt: np.ndarray, port: np.ndarray, eligible: np.ndarray) -> np.ndarray | None:
        """The common turn (a RESULT multicast to every worker, the sender's order: each packet's
        replicas together, in group order), as `place`'s entry matrix: row j the entries of the
        j-th packet, every row to the same 2+ distinct ports. None when the turn is not so."""
        n = len(pkt)
        if n <= 32:  # a small turn (a packet or a few to every worker): the same test on Python ints
            if n < 2 or not bool(eligible.all()):
                return None
            pk, pt = pkt.tolist(), port.tolist()
            c = 1
            while c < n and pk[c] == pk[0]:
                c += 1
            first = pt[:c]
            if c < 2 or n % c or len(set(first)) != c:
                return None
            for r in range(c, n, c):
                if pk[r] <= pk[r - c] or pt[r:r + c] != first or pk[r:r + c] != [pk[r]] * c:
                    return None
            return np.arange(n).reshape(-1, c)
        c = int(np.searchsorted(pkt, pkt[0], side="right")) if n else 0
        if c < 2 or n % c or not bool(eligible.all()):
            return None
        ent = np.arange(n).reshape(-1, c)
        pk, pt = pkt[ent], port[ent]
        if not (bool((pk == pk[:, :1]).all()) and bool((pt == pt[0]).all()) and bool((pk[1:, 0] > pk[:-1, 0]).all())
                and len(set(pt[0].tolist())) == c):
            return None
        return ent

    def claim(self, holders: dict[int, list[tuple[ShmAttachment, int]]]) -> None:
        """After a turn's references went out: pool id -> [(attachment, its ring's head)]."""
        for pool in self._pools.values():
            h = holders.get(pool.id)
            if h:
                pool.claims.append((pool.head, h))

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shm.close()
        self._pools.clear()
