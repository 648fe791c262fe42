"""Served copies: each layer's latest parameters in the dtype the workers pull (bf16 as raw
uint16 bits, fp16, fp32), flat, read-only.

Every published version is a new array that is never written again, so a caller may keep what
`get` returned. Buffers are recycled (page faults cost more than the step here) only when no
caller holds the old array any more: a copy still held when it is replaced (the engine's
parameter stream keeps the array a pull is sent from until the workers acknowledge it, which is
usually after the layer's next version is published) is checked again before the next buffer is
handed out, and recycled once let go. Copies live in RAM within their budget; past it the least
recently used are written to the served region of their shards' files and read back on demand.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np

from .buffers import BufferPool, aligned_buffer, extra_references
from .errors import NodeFailed
from .layout import LayerPlan
from .shard_file import FileSet

WAIT_SLICE = 1.0
MAX_HELD = 64  # replaced copies a caller still held, re-checked for recycling; older ones are left to the caller


class _Held:
    """A replaced copy (its buffer and typed array) that a caller still held when it was dropped."""

    __slots__ = ("arr", "buf")

    def __init__(self, buf: np.ndarray, arr: np.ndarray):
        self.buf, self.arr = buf, arr


class ServedRecord:
    __slots__ = ("arr", "buf", "busy", "dirty", "plan", "version")

    def __init__(self, plan: LayerPlan, version: int, buf: np.ndarray | None):
        self.plan, self.version = plan, version
        self.buf = buf
        self.arr = None if buf is None else _typed(plan, buf)
        self.dirty = buf is not None  # not yet in the files
        self.busy = False  # being written or read


def _typed(plan: LayerPlan, buf: np.ndarray) -> np.ndarray:
    arr = buf[: plan.numel * plan.served_dtype.itemsize].view(plan.served_dtype)
    arr.flags.writeable = False
    return arr


class ServedCache:
    def __init__(self, files: FileSet, fd_of: Callable[[tuple], int], budget: int):
        self.files = files
        self.fd_of = fd_of  # shard key -> file descriptor
        self.budget = budget
        self.pool = BufferPool()
        self.records: dict[tuple, ServedRecord] = {}
        self.lru: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # resident records
        self.cv = threading.Condition()
        self._local = threading.local()
        self.used = 0  # resident records + buffers handed to in-flight steps
        self.held: collections.deque[_Held] = collections.deque()  # dropped while a caller held them
        self.closed = False
        self.counts = {"evictions": 0, "writes": 0, "loads": 0, "recycled": 0, "kept_by_caller": 0,
                       "recycled_late": 0}

    def set_budget(self, budget: int) -> None:
        with self.cv:
            self.budget = budget

    def new_buffer(self, plan: LayerPlan) -> np.ndarray:
        """A buffer for the next version of a layer (called by the pipeline before its step)."""
        n = plan.served_buffer_bytes
        with self.cv:
            self._reclaim()
            # a pooled buffer is taken before the trim, which would otherwise count it as free
            # memory over budget, drop it, and leave this call to fault in a fresh one (at full
            # budget, i.e. every step of a model that fits: the previous version's buffer)
            buf = self.pool.take(n) if self.pool.has(n) else None
            self.used += n
            self._trim(keep=None)
        return buf if buf is not None else self.pool.take(n)

    def discard(self, plan: LayerPlan, buf: np.ndarray) -> None:
        with self.cv:
            self.used -= plan.served_buffer_bytes
            self.pool.give(buf)

    def publish(self, plan: LayerPlan, version: int, buf: np.ndarray) -> np.ndarray | None:
        """Make `buf` (from `new_buffer`) the layer's current copy; returns its read-only array, or
        None when another thread's trim (run while `_evict` writes unlocked) already evicted it."""
        key = (plan.job_id, plan.layer_id)
        rec = ServedRecord(plan, version, buf)
        with self.cv:
            old = self.records.get(key)
            while old is not None and old.busy:
                self.cv.wait(WAIT_SLICE)
                old = self.records.get(key)
            self.records[key] = rec
            self.lru[key] = None
            self.lru.move_to_end(key)
            if old is not None and old.buf is not None:
                self._drop_buffer(old)
            self._trim(keep=key)
            self.cv.notify_all()
            return rec.arr

    def get(self, key: tuple) -> tuple[np.ndarray, int]:
        """(array, version) of a layer's current copy, read back from its files if evicted."""
        with self.cv:
            while True:
                if self.closed:
                    raise NodeFailed("the node is closed")
                rec = self.records[key]
                if rec.busy:
                    self.cv.wait(WAIT_SLICE)
                    continue
                if rec.buf is not None and rec.arr is not None:  # set and cleared together
                    self.lru.move_to_end(key)
                    return rec.arr, rec.version
                self._load(rec)

    def resident(self, key: tuple) -> bool:
        with self.cv:
            rec = self.records.get(key)
            return rec is not None and rec.buf is not None

    def remove_job(self, job_id: str) -> None:
        with self.cv:
            for key in [k for k in self.records if k[0] == job_id]:
                rec = self.records.pop(key)
                self.lru.pop(key, None)
                if rec.buf is not None:
                    self._drop_buffer(rec)

    # -- internals (lock held) --------------------------------------------------------------------
    def _bounce(self, nbytes: int) -> np.ndarray:
        """A page-aligned staging buffer for served-region I/O (shards need not start on a page
        of the served copy); one per thread, grown as needed."""
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.bounce = aligned_buffer(nbytes)
        return buf

    def _drop_buffer(self, rec: ServedRecord) -> None:
        if rec.buf is None:  # callers drop resident copies only; no local names: they would count below
            raise AssertionError(f"served copy of layer {rec.plan.layer_id} dropped while not in memory")
        self.used -= rec.buf.nbytes
        # ours: rec.buf and rec.arr's base reference the buffer; rec.arr is referenced by rec
        if extra_references(rec.arr, 1) == 0 and extra_references(rec.buf, 2) == 0:
            self.pool.give(rec.buf)
            self.counts["recycled"] += 1
        else:
            self.counts["kept_by_caller"] += 1  # recycled by _reclaim once the caller lets go
            if rec.arr is None:  # set and cleared with rec.buf
                raise AssertionError(f"served copy of layer {rec.plan.layer_id} has a buffer but no array")
            self.held.append(_Held(rec.buf, rec.arr))
            if len(self.held) > MAX_HELD:
                self.held.popleft()  # freed when its caller drops it
        rec.buf = rec.arr = None

    def _reclaim(self) -> None:
        """Recycle the replaced copies whose callers have let go since. Without this, every
        step's copy of a layer that workers were still being sent when its next version came out
        was a fresh mapping, faulted in a page at a time (in the demo: all but 5% of them)."""
        for _ in range(len(self.held)):
            h = self.held.popleft()
            # ours: h.arr; h.buf and h.arr's base (as in _drop_buffer)
            if extra_references(h.arr, 1) == 0 and extra_references(h.buf, 2) == 0:
                self.pool.give(h.buf)
                self.counts["recycled_late"] += 1
            else:
                self.held.append(h)

    def _trim(self, keep: tuple | None) -> None:
        while self.used + self.pool.free_bytes > self.budget:
            if self.pool.free_bytes:
                self.pool.drop(self.used + self.pool.free_bytes - self.budget)
                continue
            victim = next((k for k in self.lru if k != keep and not self.records[k].busy), None)
            if victim is None:
                return
            self._evict(self.records[victim])

    def _evict(self, rec: ServedRecord) -> None:
        key = (rec.plan.job_id, rec.plan.layer_id)
        if rec.dirty:
            if rec.buf is None:  # dirty means "in memory, not yet in the files"
                raise AssertionError(f"dirty served copy of layer {rec.plan.layer_id} is not in memory")
            rec.busy = True
            self.cv.release()
            try:
                for shard in rec.plan.shards:
                    bounce = self._bounce(shard.served_bytes)
                    lo, n = shard.elem_lo * rec.plan.served_dtype.itemsize, shard.numel * rec.plan.served_dtype.itemsize
                    bounce[:n] = rec.buf[lo: lo + n]
                    self.files.write(self.fd_of(shard.key), [bounce[:shard.served_bytes]], shard.served_offset)
            finally:
                self.cv.acquire()
                rec.busy = False
                self.cv.notify_all()
            rec.dirty = False
            self.counts["writes"] += 1
        self.lru.pop(key, None)
        self._drop_buffer(rec)
        self.counts["evictions"] += 1

    def _load(self, rec: ServedRecord) -> None:
        n = rec.plan.served_buffer_bytes
        rec.busy = True
        self.used += n
        self._trim(keep=None)
        buf = self.pool.take(n)
        self.cv.release()
        try:
            for shard in rec.plan.shards:
                bounce = self._bounce(shard.served_bytes)
                self.files.read(self.fd_of(shard.key), bounce[:shard.served_bytes], shard.served_offset)
                lo, n = shard.elem_lo * rec.plan.served_dtype.itemsize, shard.numel * rec.plan.served_dtype.itemsize
                buf[lo: lo + n] = bounce[:n]
        except BaseException:
            self.cv.acquire()
            rec.busy = False
            self.used -= n
            self.pool.give(buf)
            self.cv.notify_all()
            raise
        self.cv.acquire()
        rec.buf, rec.arr, rec.dirty, rec.busy = buf, _typed(rec.plan, buf), False, False
        key = (rec.plan.job_id, rec.plan.layer_id)
        self.lru[key] = None
        self.counts["loads"] += 1
        self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def stats(self) -> dict:
        with self.cv:
            return {**self.counts, "resident_bytes": self.used, "budget": self.budget,
                    "buffers_allocated": self.pool.allocated}
