"""Keeps every rank's engine operations in one order and completes Works off the caller's thread.

The switch pairs packet `seq` of every worker, so all ranks must submit their engine operations
in the same order. The collective call only validates and queues; one *submit* thread starts
each collective in call order. A collective whose next step depends on a result (all_to_all
first agrees on the block sizes) `hold`s the queue: later collectives wait until that step has
been submitted, so the order stays the same on every rank without blocking anyone's caller.
Results are turned into output tensors on a *completion* thread (never on the engine's packet
thread), which also fails operations that pass their deadline (the process group's timeout); a
small one that is the only one outstanding, by the thread blocked in its wait() (_hand_off).
Small collectives (`LuwuWork.small`: SMALL_BYTES or less, docs/backend.md "Order and completion")
take a latency path: the caller submits one itself when nothing is queued before it, and with the
engine daemon its result is assembled on the link's reply thread; each saves a thread hand-off.
Every collective gets its sequence number here, in call order, and each of its engine operations
carries its fingerprint (fingerprint.py); a disagreement fails it and breaks the group.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from luwu.dataplane.engine import Handle
from luwu.dataplane.engine.handles import CollectiveMismatch

from .diagnostics import LuwuError, engine_failure, timeout_failure
from .work import LuwuWork

Start = Callable[["OpContext"], None]


class OpContext:
    """What a collective's steps may do; steps run on the submit thread."""

    def __init__(self, sched: Scheduler, work: LuwuWork):
        self.sched = sched
        self.work = work

    def allreduce(self, x: np.ndarray, op: str, out: np.ndarray | None = None) -> Handle:
        """The engine's allreduce of x; a float sum's saturated elements are recomputed exactly (fallback.py).
        `out` (possibly x itself): where the result goes, no new array (EngineLink.allreduce); a
        rail-only plan's result is a new array all the same."""
        x = np.ascontiguousarray(x).reshape(-1)
        submit = self.sched.link.allreduce
        fp = self.work.fingerprint
        if fp is not None and self.sched.mismatch is not None:  # fingerprint.py: agreed on the meta session
            self.work.checks.append(self.sched._checks)
            self.sched._checks += 1
            submit = functools.partial(submit, check=fp.fields(len(self.work.checks) - 1, self.sched.shapes))
        if self.sched.hierarchy is not None:  # a rail-only plan: server, rail, server (hierarchy.py)
            h = self.sched.hierarchy.allreduce(x, op, submit)
            h.info["numel"] = int(x.size)
            return h
        proof = None  # SUM/AVG: verified by the wire's check words; MAX/MIN: proven here (max_proof.py)
        if op in ("max", "min") and self.sched.fallback is not None:
            proof = self.sched.fallback.prove(self, x, op, fp)
        h = submit(x, op) if out is None else submit(x, op, out=out)
        h.info["numel"] = int(x.size)
        if proof is not None:  # a MAX/MIN result proven end to end (max_proof.py)
            h = proof.attach(h)
        if x.dtype == np.float32 and op in ("sum", "avg") and self.sched.fallback is not None:
            h = self.sched.fallback.guard(h, x, op)
        elif x.dtype == np.float32 and op in ("max", "min") and self.sched.fallback is not None \
                and fp is not None:  # NaN elements as Gloo computes them (fallback.py)
            h = self.sched.fallback.guard(h, x, op, fp.dtypes[0].itemsize if fp.dtypes else 4, fp.kind)
        elif x.dtype == np.int32 and self.sched.fallback is not None:  # chunks with a corrupt stored sum (fallback.py)
            h = self.sched.fallback.guard_exact(h, x, op)
        return h

    def direct(self, sends: dict[int, np.ndarray], sources: list[int]) -> tuple[list[Handle], dict[int, Handle]]:
        """Blocks with one receiver each, point to point over TCP (direct.py): the send handles and,
        per source rank, a handle whose result is the bytes it sent."""
        if self.sched.direct is None:
            raise LuwuError(f"luwu {self.work.name}: this process group has no point-to-point channel")
        return self.sched.direct.exchange(self.work.name, sends, sources)

    def then(self, handle: Handle, step: Callable[[np.ndarray], None]) -> None:
        """Run `step(result)` on the submit thread before any later collective starts."""
        self.sched._holds += 1
        handle.add_done_callback(lambda h: self.sched._submit_q.put(("step", self, h, step)))

    def finish(self, handles: list[Handle], assemble: Callable[[list[np.ndarray]], None]) -> None:
        """When every handle is done: `assemble(results)` on the completion thread, then complete the Work."""
        self.sched._finish(self, handles, assemble)


class Scheduler:
    def __init__(self, link, lease, name: str, tick: float, fallback=None, direct=None, hierarchy=None):
        self.link = link
        self.hierarchy = hierarchy  # RailHierarchy on a rail-only plan, else None
        self.direct = direct  # DirectMoves: gather, scatter and all_to_all blocks, point to point
        self.lease = lease
        self.fallback = fallback  # ExactFallback for saturated float sums (None: a float sum may not saturate)
        self.tick = tick
        self.broken: LuwuError | None = None
        self.mismatch = None  # (store, rank, world): fingerprint every collective (fingerprint.py); None: don't
        self.shapes = False  # compare shapes too (TORCH_DISTRIBUTED_DEBUG=DETAIL)
        self._seq = 0  # the next collective's sequence number
        self._checks = 0  # the next fingerprinted engine operation's number (the same on every rank)
        self._submit_q: queue.SimpleQueue = queue.SimpleQueue()
        self._done_q: queue.SimpleQueue = queue.SimpleQueue()
        self._holds = 0
        self._deferred: collections.deque = collections.deque()
        self._order = threading.Lock()  # held while a collective is submitted (submit thread, or inline)
        self._queued = 0  # "op" items in _submit_q not yet submitted (under _order)
        self.inline_completion = getattr(link, "kind", "") == "process"  # see _finish
        self._handed: weakref.ref[LuwuWork] | None = None  # the last work handed to its waiter (_hand_off)
        self._pending: dict[int, LuwuWork] = {}
        self._pending_lock = threading.Lock()
        self._submitter = threading.Thread(target=self._submit_loop, name=f"luwu-submit-{name}", daemon=True)
        self._completer = threading.Thread(target=self._complete_loop, name=f"luwu-complete-{name}", daemon=True)
        self._submitter.start()
        self._completer.start()

    # -- caller side ---------------------------------------------------------------------------------
    def run(self, work: LuwuWork, start: Start) -> LuwuWork:
        if self.broken is not None:
            raise LuwuError(f"luwu {work.name}: the process group is broken by an earlier failure: {self.broken}")
        if work.fingerprint is not None:
            work.fingerprint.seq = self._seq
        self._seq += 1
        with self._pending_lock:
            self._pending[id(work)] = work
        ctx = OpContext(self, work)
        with self._order:
            if work.small and not self._queued and not self._holds and not self._deferred \
                    and self.hierarchy is None:
                # the latency path: nothing is waiting to be submitted before it, so the caller submits
                # it itself (the order is still the call order; no hand-off to the submit thread)
                self._guard(ctx, start)
                return work
            self._queued += 1
            self._submit_q.put(("op", ctx, None, start))
        return work

    def close(self, timeout: float = 10.0) -> None:
        self._submit_q.put(("stop", None, None, None))
        self._done_q.put(None)
        self._submitter.join(timeout)
        self._completer.join(timeout)
        error = LuwuError("the luwu process group was shut down before this collective completed")
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), {}
        for w in pending:
            w._fail(error)

    # -- submit thread -------------------------------------------------------------------------------
    def _submit_loop(self) -> None:
        while True:
            kind, ctx, handle, fn = self._submit_q.get()
            if kind == "stop":
                return
            with self._order:
                self._submit_one(kind, ctx, handle, fn)

    def _submit_one(self, kind: str, ctx: OpContext, handle, fn) -> None:
        if kind == "op":
            self._queued -= 1
            if self._holds:
                self._deferred.append((ctx, fn))
                return
            self._guard(ctx, fn)
        else:  # a held step: its input is ready
            self._holds -= 1
            if handle.error is not None:
                self._fail(ctx.work, handle.error)
            else:
                self._guard(ctx, lambda c, fn=fn, handle=handle: fn(handle.wait()))
        while not self._holds and self._deferred:
            self._guard(*self._deferred.popleft())

    def _guard(self, ctx: OpContext, fn) -> None:
        if ctx.work.is_completed():  # failed meanwhile (watchdog, broken group): submit nothing more
            return
        try:
            fn(ctx)
        except Exception as e:  # noqa: BLE001 - the collective fails alone
            self._fail(ctx.work, e)

    # -- completion thread ---------------------------------------------------------------------------
    def _finish(self, ctx: OpContext, handles: list[Handle], assemble) -> None:
        remaining = [len(handles)]
        lock = threading.Lock()

        def one_done(_h: Handle) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if not last:
                return
            if ctx.work.small and self.inline_completion:
                # the latency path: a small result is assembled on the engine link's reply thread (the
                # engine daemon's, not a packet thread), without a hand-off to the completion thread
                self._assemble(ctx, handles, assemble)
            elif not self._hand_off(ctx, handles, assemble):
                self._done_q.put((ctx, handles, assemble))

        if not handles:
            self._done_q.put((ctx, handles, assemble))
        for h in handles:
            h.add_done_callback(one_done)

    def _complete_loop(self) -> None:
        while True:
            try:
                item = self._done_q.get(timeout=self.tick)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                handed = self._handed() if self._handed is not None else None
                while handed is not None and handed is not item[0].work and not handed.is_completed():
                    handed._done.wait(self.tick)  # its waiter is assembling it (_hand_off): it completes first
                    self._watchdog()
                self._assemble(*item)
            self._watchdog()

    def _assemble(self, ctx: OpContext, handles: list[Handle], assemble) -> None:
        work = ctx.work
        failed = next((h.error for h in handles if h.error is not None), None)
        if failed is not None:
            self._fail(work, failed)
            return
        try:
            results = [h.wait() for h in handles]
            assemble(results)
        except Exception as e:  # noqa: BLE001
            self._fail(work, e, engine=False)
            return
        work._complete()  # before it leaves _pending: a later work handed to its waiter (_finish) completes after it
        self._forget(work)

    def _hand_off(self, ctx: OpContext, handles: list[Handle], assemble) -> bool:
        """A thread blocked in the work's wait() (a blocking dist.all_reduce on the latency path,
        SMALL_BYTES or less) assembles it itself when it is the group's only collective not yet
        complete: one wake-up of the completion thread less per call (issue 28). The completion thread assembles nothing after it until it
        is complete (_complete_loop), so collectives still complete in call order."""
        work = ctx.work
        if not work.small:  # kept to the latency path's calls (not measured above SMALL_BYTES)
            return False
        with self._pending_lock:
            if len(self._pending) != 1 or id(work) not in self._pending:
                return False
        if not work.hand_to_waiter(lambda: self._assemble(ctx, handles, assemble)):
            return False
        self._handed = weakref.ref(work)  # not kept alive by this
        return True

    def _watchdog(self) -> None:
        now = time.monotonic()
        with self._pending_lock:
            # a work has a deadline exactly when it has a timeout (work.py): both are checked to narrow them
            late = [(w, w.timeout) for w in self._pending.values()
                    if w.timeout is not None and w.deadline is not None and now > w.deadline
                    and not w.is_completed()]  # completed, not yet forgotten (_assemble)
        for w, timeout in late:
            error = timeout_failure(w.name, timeout, self.link, self.lease, probe=w.probe)
            self.broken = self.broken or error
            self._forget(w)
            w._fail(error)

    # -- failures --------------------------------------------------------------------------------------
    def _fail(self, work: LuwuWork, error: BaseException, engine: bool = True) -> None:
        from luwu.dataplane.engine import EngineError

        if isinstance(error, CollectiveMismatch) and self.mismatch is not None and work.fingerprint is not None:
            from .fingerprint import mismatch_error

            store, rank, world = self.mismatch
            error = mismatch_error(store, work.checks[0] if work.checks else -1, rank, world, work.fingerprint, error)
            self.broken = self.broken or error
            self._forget(work)
            work._fail(error)
            # the ranks' packet streams no longer line up: what is in flight cannot complete either
            broken = LuwuError(f"luwu: the process group is broken by an earlier failure: {error}")
            with self._pending_lock:
                pending, self._pending = list(self._pending.values()), {}
            for w in pending:
                w._fail(broken)
            return
        if engine and isinstance(error, EngineError):
            error = engine_failure(work.name, error, self.link, self.lease)
            self.broken = self.broken or error
        self._forget(work)
        work._fail(error)

    def _forget(self, work: LuwuWork) -> None:
        with self._pending_lock:
            self._pending.pop(id(work), None)
