"""The state store: every shard's record in a file, staged through a RAM budget.

Entries move ABSENT -> LOADING -> RESIDENT (-> WRITING -> RESIDENT/ABSENT). A resident entry
is pinned while the pipeline steps it and held while a checkpoint copies it; neither is evicted.
Eviction writes dirty entries back (write-back cache) and picks the entry whose next use is
farthest in the predicted order (order.py). When every record fits, nothing is ever evicted, so
after start-up no file is read or written. File I/O runs with the lock released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .buffers import BufferPool, aligned_buffer
from .errors import NodeFailed
from .layout import ShardPlan
from .order import OrderTracker
from .shard_file import FileSet

ABSENT, LOADING, RESIDENT, WRITING = range(4)
WAIT_SLICE = 1.0  # seconds between re-checks of a condition wait (waits are also woken by notify)


class Entry:
    __slots__ = ("arrays", "buf", "dirty", "fd", "holds", "path", "pins",
                 "plan", "prefetched", "state", "step", "views", "wanted")

    def __init__(self, plan: ShardPlan, path: Path, fd: int):
        self.plan, self.path, self.fd = plan, path, fd
        self.buf: np.ndarray | None = None
        self.views: list[torch.Tensor] | None = None
        self.arrays: list[np.ndarray] | None = None  # the same state as numpy arrays (the compiled kernel's)
        self.state = ABSENT
        self.dirty = False
        self.pins = self.holds = self.wanted = 0
        self.step = 0
        self.prefetched = False

    def attach(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.arrays = self.plan.state_views(buf)
        self.views = [torch.from_numpy(v) for v in self.arrays]

    @property
    def nbytes(self) -> int:
        return self.plan.entry_bytes

    def evictable(self) -> bool:
        return self.state == RESIDENT and not (self.pins or self.holds or self.wanted)


class StateStore:
    def __init__(self, files: FileSet, order: OrderTracker, budget: int, prefetch: int):
        self.files = files
        self.order = order
        self.budget = budget
        self.prefetch_depth = prefetch
        self.keep_hint: Callable[[tuple], bool] = lambda key: False  # the checkpoint's pending copies
        self.pool = BufferPool()
        self.entries: dict[tuple, Entry] = {}
        self.cv = threading.Condition()
        self.used = 0
        self._scratch: np.ndarray | None = None
        self.closed = False
        self.counts = {"hits": 0, "misses": 0, "prefetch_loads": 0, "prefetch_hits": 0, "evictions": 0,
                       "writebacks": 0, "waits_for_room": 0, "over_budget_loads": 0, "peak_bytes": 0}

    # -- registration ------------------------------------------------------------------------------
    def register(self, plan: ShardPlan, path: Path, fill: Callable[[np.ndarray], int]) -> None:
        """Create the shard's file. `fill(buf)` writes the initial record (header and states) into
        an entry buffer and returns its step. If it fits (evicting only shards needed later), the
        entry stays resident and dirty (its file is still empty); otherwise the record goes to the
        file now, from a scratch buffer."""
        fd = self.files.create(path, plan.file_bytes)
        e = Entry(plan, path, fd)
        with self.cv:
            self.entries[plan.key] = e
            buf = self._room_for(e.nbytes, farther_than=self.order.distance(plan.key))
            if buf is not None:
                e.state = LOADING  # not evictable while we fill it
                self._account(e.nbytes)
        if buf is None:
            # a scratch buffer outside the budget (and the pool), kept across one job's registration
            if self._scratch is None or self._scratch.nbytes < e.nbytes:
                self._scratch = aligned_buffer(e.nbytes)
            scratch = self._scratch[:e.nbytes]
            e.step = fill(scratch)
            self.files.write(fd, [scratch], 0)
            return
        e.step = fill(buf)
        with self.cv:
            e.attach(buf)
            e.state, e.dirty = RESIDENT, True
            self.cv.notify_all()

    def end_registration(self) -> None:
        self._scratch = None

    def remove_job(self, job_id: str) -> None:
        with self.cv:
            for key in [k for k in self.entries if k[0] == job_id]:
                e = self.entries.pop(key)
                if e.buf is not None:
                    self.used -= e.nbytes
                    self.pool.give(e.buf)
                    e.buf = e.views = e.arrays = None

    def set_budget(self, budget: int) -> None:
        with self.cv:
            self.budget = budget
            self.cv.notify_all()

    def fd(self, key: tuple) -> int:
        return self.entries[key].fd

    # -- the pipeline's side ----------------------------------------------------------------------
    def acquire(self, key: tuple) -> Entry:
        """The entry, resident and pinned (loaded from its file if needed; waits for room)."""
        with self.cv:
            e = self.entries[key]
            loaded = False
            while True:
                self._check_open()
                if e.state == RESIDENT:
                    e.pins += 1
                    if not loaded:
                        self.counts["prefetch_hits" if e.prefetched else "hits"] += 1
                    e.prefetched = False
                    self.order.touch(key)
                    return e
                if e.state in (LOADING, WRITING):
                    e.wanted += 1
                    self.cv.wait(WAIT_SLICE)
                    e.wanted -= 1
                    continue
                buf = self._room_for(e.nbytes)
                if buf is None:
                    self.counts["waits_for_room"] += 1
                    e.wanted += 1
                    self.cv.wait(WAIT_SLICE)
                    e.wanted -= 1
                    continue
                if e.state != ABSENT:  # someone else loaded it while we made room
                    self.pool.give(buf)
                    continue
                self.counts["misses"] += 1
                loaded = True
                self._load(e, buf)

    def try_acquire(self, key: tuple) -> Entry | None:
        """`acquire` when it has nothing to wait for or read: the entry is resident and the shards
        predicted after it are too (so the read step's prefetch would load nothing). Else None,
        and the caller goes through the read step. The pipeline's fast lane for state in RAM."""
        with self.cv:
            e = self.entries[key]
            if self.closed or e.state != RESIDENT:
                return None
            for k in self.order.upcoming(key, self.prefetch_depth):
                nxt = self.entries.get(k)
                if nxt is not None and nxt.state == ABSENT:
                    return None
            e.pins += 1
            self.counts["prefetch_hits" if e.prefetched else "hits"] += 1
            e.prefetched = False
            self.order.touch(key)
            return e

    def release_if_room(self, e: Entry, dirty: bool) -> bool:
        """`release` followed by a `trim` that has nothing to do: True, done; False (nothing done)
        when the trim would write back or evict, which the caller leaves to the write step."""
        with self.cv:
            if self.used + sum(self.entries[k].nbytes for k in self._upcoming_absent()) > self.budget:
                return False
            e.pins -= 1
            e.dirty |= dirty
            self.cv.notify_all()
            return True

    def release(self, e: Entry, dirty: bool) -> None:
        with self.cv:
            e.pins -= 1
            e.dirty |= dirty
            self.cv.notify_all()

    def trim(self) -> None:
        """Write back and evict the farthest entries until the next `prefetch` shards fit: run by
        the pipeline's write step, so that eviction I/O stays off the read step. (Evicted buffers
        stay pooled for those loads.)"""
        with self.cv:
            while True:
                reserve = sum(self.entries[k].nbytes for k in self._upcoming_absent())
                if self.used + reserve <= self.budget:
                    return
                victim = self._victim(None)
                if victim is None:
                    return
                self._evict(victim)

    def prefetch_after(self, key: tuple) -> int:
        """Load the shards predicted after `key` if room can be made without evicting anything
        needed sooner. Returns how many were loaded."""
        loaded = 0
        for k in self.order.upcoming(key, self.prefetch_depth):
            with self.cv:
                e = self.entries.get(k)
                if e is None or e.state != ABSENT or self.closed:
                    continue
                buf = self._room_for(e.nbytes, farther_than=self.order.distance(k))
                if buf is None:
                    return loaded
                if e.state != ABSENT:
                    self.pool.give(buf)
                    continue
                self._load(e, buf)
                e.prefetched = True
                self.counts["prefetch_loads"] += 1
                loaded += 1
        return loaded

    # -- the checkpoint writer's side -------------------------------------------------------------
    def hold(self, key: tuple) -> Entry | None:
        """Keep a resident entry's buffer from being evicted or recycled while a checkpoint copies
        it (not from being stepped: the checkpoint's copy-on-write handles that). None if it is
        not in RAM (then its file is current: dirty entries are written back before eviction)."""
        with self.cv:
            e = self.entries[key]
            if e.state in (RESIDENT, WRITING):
                e.holds += 1
                return e
            return None

    def unhold(self, e: Entry) -> None:
        with self.cv:
            e.holds -= 1
            self.cv.notify_all()

    def read_record(self, key: tuple, buf: np.ndarray) -> None:
        """Read a shard's record from its file into a caller's buffer (outside the budget)."""
        e = self.entries[key]
        self.files.read(e.fd, buf[:e.nbytes], 0)

    # -- internals (lock held) --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise NodeFailed("the state store is closed")

    def _account(self, delta: int) -> None:
        self.used += delta
        self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self.used + self.pool.free_bytes)

    def _upcoming_absent(self) -> list[tuple]:
        keys = []
        for job in self.order.jobs():
            keys += [k for k in self.order.next_keys(job, self.prefetch_depth)
                     if k in self.entries and self.entries[k].state == ABSENT]
        return keys

    def _victim(self, farther_than: float | None) -> Entry | None:
        """The evictable entry used farthest in the future; one that a checkpoint has still to
        copy only if there is no other (the copy would then come from its file)."""
        best, best_d = None, (False, -1.0)
        for e in self.entries.values():
            if not e.evictable():
                continue
            d = self.order.distance(e.plan.key)
            if farther_than is not None and d <= farther_than:
                continue
            rank = (not self.keep_hint(e.plan.key), d)
            if rank > best_d:
                best, best_d = e, rank
        return best

    def _room_for(self, nbytes: int, farther_than: float | None = None) -> np.ndarray | None:
        while True:
            self._check_open()
            if self.pool.has(nbytes):
                return self.pool.take(nbytes)
            over = self.used + self.pool.free_bytes + nbytes - self.budget
            if over <= 0:
                return self.pool.take(nbytes)
            if self.pool.free_bytes:
                self.pool.drop(over, keep_size=nbytes)
                continue
            victim = self._victim(farther_than)
            if victim is None:
                if self.used == 0 and farther_than is None:  # one shard larger than the whole budget
                    self.counts["over_budget_loads"] += 1
                    return self.pool.take(nbytes)
                return None
            self._evict(victim)

    def _evict(self, e: Entry) -> None:
        if e.buf is None:  # victims are evictable, i.e. resident
            raise AssertionError(f"evicting shard {e.plan.name()} while it is not in memory")
        if e.dirty:
            e.state = WRITING
            step = e.step
            self.cv.release()
            try:
                e.plan.write_header(e.buf, step)
                self.files.write(e.fd, [e.buf], 0)
            finally:
                self.cv.acquire()
                e.state = RESIDENT
                self.cv.notify_all()
            e.dirty = False
            self.counts["writebacks"] += 1
        if not e.evictable():
            return  # wanted again, pinned or held while it was being written: keep it
        e.state = ABSENT
        self.pool.give(e.buf)
        e.buf = e.views = e.arrays = None
        self.used -= e.nbytes
        self.counts["evictions"] += 1
        self.cv.notify_all()

    def _load(self, e: Entry, buf: np.ndarray) -> None:
        e.state = LOADING
        self._account(e.nbytes)
        self.cv.release()
        try:
            self.files.read(e.fd, buf, 0)
            step = e.plan.read_header(buf, str(e.path))
        except BaseException:
            self.cv.acquire()
            e.state = ABSENT
            self.used -= e.nbytes
            self.pool.give(buf)
            self.cv.notify_all()
            raise
        self.cv.acquire()
        e.attach(buf)
        e.step = step
        e.state = RESIDENT
        self.cv.notify_all()

    # -- teardown and stats -----------------------------------------------------------------------
    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def stats(self) -> dict:
        with self.cv:
            resident = sum(1 for e in self.entries.values() if e.state == RESIDENT)
            return {**self.counts, "shards": len(self.entries), "resident_shards": resident,
                    "resident_bytes": self.used, "pooled_bytes": self.pool.free_bytes, "budget": self.budget,
                    "buffers_allocated": self.pool.allocated}
