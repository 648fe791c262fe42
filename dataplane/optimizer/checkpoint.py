"""Lazy asynchronous checkpoints (after DataStates-LLM): a checkpoint of version V copies each
shard right after the step that brings it to V, in the background, without stopping the pipeline.

A shard's state only changes when its next step runs, which for a layer is an iteration later.
So a capture is just a note; a writer thread later copies the shard from wherever it is then (its
RAM buffer, held only for that copy, or its state file if it was evicted meanwhile, which the
store avoids while other victims exist) to the checkpoint directory. If the shard's next step
comes first, that step copies the shard into a staging buffer (copy-on-write, bounded by
`checkpoint_staging`) or, past that bound or while the writer is copying it, waits. Captures
never pin RAM budget, so a slow checkpoint cannot stall an out-of-core pipeline for room. The
manifest is written last (checkpoint_files.py).
"""

from __future__ import annotations

import collections
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .buffers import BufferPool
from .checkpoint_files import (
    MANIFEST,
    MANIFEST_FORMAT,
    RecordWriter,
    checkpoint_dirs,
    lower_priority,
    shard_file_name,
    write_manifest,
)
from .errors import CheckpointError
from .layout import LayerPlan, ShardPlan
from .store import Entry, StateStore

log = logging.getLogger("luwu.optimizer")
QUEUED, WRITING, DONE = range(3)
WAIT_SLICE = 1.0


@dataclass(eq=False)
class Capture:
    ck: PendingCheckpoint
    plan: ShardPlan
    version: int
    entry: Entry | None = None  # the live buffer, held while the writer copies it
    staging: np.ndarray | None = None  # a snapshot: copy-on-write, or the record read from its file
    state: int = QUEUED
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the writer per chunk it copies


@dataclass(eq=False)
class PendingCheckpoint:
    seq: int
    path: Path
    targets: dict[tuple[str, int], int]  # (job, layer) -> version
    layer_plans: dict[tuple[str, int], LayerPlan]
    captured: dict[tuple[str, int], set[int]] = field(default_factory=dict)  # shard indices captured
    files: dict[tuple[str, int, int], dict] = field(default_factory=dict)  # shard key -> manifest entry
    remaining: int = 0  # shard files not yet written
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)


class CheckpointHandle:
    """A requested checkpoint: `wait()` returns its directory once the manifest is committed."""

    def __init__(self, ck: PendingCheckpoint):
        self._ck = ck
        self.path = ck.path

    def done(self) -> bool:
        return self._ck.done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        if not self._ck.done.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} not committed within {timeout} s")
        if self._ck.error is not None:
            raise CheckpointError(f"checkpoint {self.path} failed: {self._ck.error}") from self._ck.error
        return self.path


class CheckpointManager:
    def __init__(self, root: Path, store: StateStore, keep: int, staging_bytes: int, chunk: int,
                 rate: float | None, job_json: Callable[[str], dict], emit: Callable[[str, dict], None],
                 nice: int = 0):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.keep = keep
        self.staging_bytes = staging_bytes
        self.job_json = job_json
        self.emit = emit
        self.cv = threading.Condition()
        self.pending: list[PendingCheckpoint] = []
        self.queue: collections.deque[Capture] = collections.deque()
        self.by_shard: dict[tuple, list[Capture]] = {}
        self.pool = BufferPool()
        self.staging_used = 0
        self.committing = 0
        self.stop = False
        dirs = checkpoint_dirs(self.root)
        self.next_seq = dirs[-1][0] + 1 if dirs else 1
        self.counts = {"requested": 0, "committed": 0, "failed": 0, "files": 0, "bytes": 0, "cow_copies": 0,
                       "cow_waits": 0, "file_sources": 0}
        self.nice = nice
        self.writer = RecordWriter(direct=lambda: bool(store.files.direct), chunk=chunk, rate=rate, sleep=self._sleep,
                                   nice=nice)
        self.thread = threading.Thread(target=self._run, name="luwu-opt-ckpt", daemon=True)
        self.thread.start()

    # -- requests (called with the node's lock held) ------------------------------------------------
    def begin(self, targets: dict[tuple[str, int], int],
              layer_plans: dict[tuple[str, int], LayerPlan]) -> PendingCheckpoint:
        with self.cv:
            ck = PendingCheckpoint(self.next_seq, self.root / f"ckpt-{self.next_seq:06d}", dict(targets), layer_plans)
            self.next_seq += 1
            ck.remaining = sum(len(layer_plans[k].shards) for k in targets)
            ck.captured = {k: set() for k in targets}
            self.pending.append(ck)
            self.counts["requested"] += 1
            return ck

    def wants(self, job_id: str, layer_id: int, version: int) -> bool:
        with self.cv:
            return any(ck.targets.get((job_id, layer_id)) == version for ck in self.pending)

    def capture_shard(self, plan: ShardPlan, version: int) -> None:
        """The shard is at `version` (after its step, or in a quiescent layer): capture it for
        every pending checkpoint that wants it at this version."""
        lk = (plan.job_id, plan.layer_id)
        with self.cv:
            for ck in self.pending:
                if ck.targets.get(lk) != version or plan.index in ck.captured[lk] or ck.error:
                    continue
                cap = Capture(ck, plan, version)
                ck.captured[lk].add(plan.index)
                self.queue.append(cap)
                self.by_shard.setdefault(plan.key, []).append(cap)
            self.cv.notify_all()

    def capture_layer(self, layer: LayerPlan, version: int) -> None:
        for shard in layer.shards:
            self.capture_shard(shard, version)

    def has_capture(self, key: tuple) -> bool:
        """Read by the store's eviction (without this lock: a stale answer only changes which
        victim is preferred)."""
        return key in self.by_shard

    # -- the pipeline's copy-on-write ----------------------------------------------------------------
    def before_modify(self, entry: Entry) -> None:
        """Called before a shard's step (the pipeline holds its pin): a capture of it that still
        reads the live buffer gets a staging copy, and the writer switches to it at its next
        chunk; past the staging budget the step waits for the writer instead."""
        key = entry.plan.key
        n = entry.plan.entry_bytes
        with self.cv:
            while True:
                caps = [c for c in self.by_shard.get(key, ()) if c.state != DONE and c.staging is None]
                if not caps:
                    break
                cap = caps[0]
                if self.staging_used + n > self.staging_bytes:
                    self.counts["cow_waits"] += 1
                    self.cv.wait(WAIT_SLICE)
                    continue
                if entry.buf is None:  # pinned for its step, so in memory
                    raise AssertionError(f"shard {entry.plan.name()} is modified while not in memory")
                self.staging_used += n
                staging = self.pool.take(n)
                np.copyto(staging, entry.buf[:n])  # the writer may be reading it too: both only read
                cap.staging = staging
                self.counts["cow_copies"] += 1
            busy = [c for c in self.by_shard.get(key, ()) if c.state == WRITING]
        for cap in busy:
            with cap.lock:  # the chunk in flight from the live buffer (or the file read) is done
                pass

    # -- the writer --------------------------------------------------------------------------------
    def _sleep(self, seconds: float) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.stop, timeout=seconds)

    def _run(self) -> None:
        lower_priority(self.nice)
        while True:
            with self.cv:
                while not self.queue and not self.stop:
                    self.cv.wait(WAIT_SLICE)
                if self.stop:
                    return
                cap = self.queue.popleft()
                cap.lock.acquire()  # before WRITING shows: a step seeing WRITING then waits on this lock
                cap.state = WRITING
            try:
                self._source(cap)
                err = None
            except BaseException as e:
                err = e
            finally:
                cap.lock.release()
            try:
                if err is None:
                    self._write(cap)
            except BaseException as e:  # a failed checkpoint must not stop training
                err = e
            try:
                self._finish(cap, err)
            except BaseException as e:  # never leave the writer dead with steps waiting on it
                log.exception("checkpoint writer failed")
                self.fail_all(e)

    def _source(self, cap: Capture) -> None:
        """(cap.lock held) The live buffer if the shard is in RAM, else its record read from its
        file now (its file is current: dirty entries are written back before eviction)."""
        if cap.staging is not None:
            return
        cap.entry = self.store.hold(cap.plan.key)
        if cap.entry is None:
            n = cap.plan.entry_bytes
            with self.cv:
                self.staging_used += n  # may exceed the bound by one record: the writer's own copy
                buf = self.pool.take(n)
            self.store.read_record(cap.plan.key, buf)
            cap.staging = buf
            with self.cv:
                self.counts["file_sources"] += 1

    def _write(self, cap: Capture) -> None:
        ck, plan = cap.ck, cap.plan
        if ck.error is not None:
            return
        n = plan.entry_bytes

        def source() -> np.ndarray:
            if cap.staging is not None:
                return cap.staging
            if cap.entry is None or cap.entry.buf is None:  # a capture holds one of the two until written
                raise AssertionError(f"capture of shard {plan.name()} has neither a copy nor a live buffer")
            return cap.entry.buf[:n]

        rel = shard_file_name(plan)
        crc = self.writer.write(ck.path / rel, n, source, cap.lock)
        with self.cv:
            ck.files[plan.key] = {"file": rel, "bytes": n, "crc32": crc}
            self.counts["files"] += 1
            self.counts["bytes"] += n
        self.emit("file", {"checkpoint": str(ck.path), "file": rel, "bytes": n})

    def _finish(self, cap: Capture, err: BaseException | None) -> None:
        ck = cap.ck
        with self.cv:
            cap.state = DONE
            if cap.staging is not None:
                self.pool.give(cap.staging)
                self.staging_used -= cap.plan.entry_bytes
                cap.staging = None
                self.pool.drop(max(0, self.pool.free_bytes - self.staging_bytes))
            if cap.entry is not None:
                self.store.unhold(cap.entry)
                cap.entry = None
            lst = self.by_shard.get(cap.plan.key, [])
            if cap in lst:
                lst.remove(cap)
                if not lst:
                    del self.by_shard[cap.plan.key]
            if err is not None and ck.error is None:
                ck.error = err
            ck.remaining -= 1
            complete = ck.remaining == 0
            self.committing += complete
            self.cv.notify_all()
        if complete:
            try:
                self._commit(ck)
            finally:
                with self.cv:
                    self.committing -= 1
                    self.cv.notify_all()

    def _commit(self, ck: PendingCheckpoint) -> None:
        try:
            if ck.error is None:
                jobs: dict[str, list] = {}
                for (job_id, layer_id), version in sorted(ck.targets.items()):
                    lp = ck.layer_plans[(job_id, layer_id)]
                    jobs.setdefault(job_id, []).append({"layer_id": layer_id, "version": version,
                                                        "shards": [ck.files[s.key] for s in lp.shards]})
                manifest = {"format": MANIFEST_FORMAT, "seq": ck.seq, "created": time.time(),
                            "jobs": [{"spec": self.job_json(j), "state": layers} for j, layers in jobs.items()]}
                write_manifest(ck.path, manifest)
        except BaseException as e:
            ck.error = e
        with self.cv:
            if ck not in self.pending:  # failed by fail_all meanwhile
                return
            self.pending.remove(ck)
            self.counts["committed" if ck.error is None else "failed"] += 1
        if ck.error is None:
            self._retire_old(ck.seq)
            self.emit("commit", {"checkpoint": str(ck.path), "seconds": time.monotonic() - ck.started})
        else:
            shutil.rmtree(ck.path, ignore_errors=True)
            self.emit("error", {"checkpoint": str(ck.path), "error": str(ck.error)})
        ck.done.set()

    def _retire_old(self, newest: int) -> None:
        """Keep the newest `keep` committed checkpoints; drop interrupted ones older than newest."""
        with self.cv:
            active = {ck.seq for ck in self.pending}
        dirs = checkpoint_dirs(self.root)  # listed once: the manifests are looked at only where they decide
        old = [(s, p) for s, p in dirs if s not in active and s <= newest]
        # the newest `keep` committed ones stay: committed, newest first, until `keep` are found
        kept = 0
        keep: set[int] = set()
        for s, p in reversed(dirs):
            if kept >= self.keep:
                break
            if s == newest or (p / MANIFEST).is_file():
                keep.add(s)
                kept += 1
        for s, p in old:
            if s not in keep:
                shutil.rmtree(p, ignore_errors=True)

    def fail_all(self, err: BaseException) -> None:
        """The node failed: every pending checkpoint fails (its partial directory is removed)."""
        with self.cv:
            pending, self.pending = list(self.pending), []
            self.cv.notify_all()
        for ck in pending:
            if ck.error is None:
                ck.error = err
            self.counts["failed"] += 1
            shutil.rmtree(ck.path, ignore_errors=True)
            ck.done.set()

    def close(self, timeout: float) -> None:
        """Finish every capture already taken (and the manifests they complete), within
        `timeout`; checkpoints still waiting for versions that will now never come fail."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while (self.queue or self.by_shard or self.committing) and time.monotonic() < deadline:
                self.cv.wait(min(WAIT_SLICE, max(0.0, deadline - time.monotonic())))
        self.fail_all(CheckpointError("the node closed before every layer reached this checkpoint's version"))
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.thread.join(max(0.1, deadline - time.monotonic()))
        self.writer.close()

    def stats(self) -> dict:
        with self.cv:
            return {**self.counts, "pending": len(self.pending), "queued_shards": len(self.queue),
                    "staging_bytes": self.staging_used}
