"""The Work objects the luwu process group returns: completed from another thread, never blocking
the collective call.

`wait()` blocks until the collective finished (raising its error), `get_future()` returns a
`torch.futures.Future` whose value is the list of output tensors (what DDP's reducer reads), and
callbacks chained with `then` run in the backend's completion thread (or, for a collective handed to
a thread blocked in `wait()`, `hand_to_waiter`, in that thread).

A failed Work's future must carry the error as C++ sees errors. `torch.futures.Future.set_exception`
does not: it completes the C++ future *successfully*, its value the exception object, and only
Python's `wait()` raises it. DDP's reducer reads that value in C++ as the bucket's tensors (an
empty list: it indexed past it, and both ranks died with SIGSEGV in `loss.backward()` when the
switch died). So `get_future()` is a `then` of the future the backend completes: a callback that
raises marks the C++ future failed (`setError`), and `loss.backward()` raises a RuntimeError with the
backend's message. Backend code waits on `_done_future` (the one it completes), which raises the
error as it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future


def _unwrap(fut: Future) -> list[torch.Tensor]:
    """The value of a completed Work's future, or its error raised (C++ then marks the chained future failed;
    its message is this error's, after torch's "Got the following error when running the callback")."""
    try:
        return fut.value()
    except Exception as e:
        raise e.with_traceback(None) from None  # the message gets the traceback's frames: keep them to this one


class LuwuWork(dist.Work):
    def __init__(self, name: str, outputs: list[torch.Tensor], timeout: float | None = None):
        super().__init__()
        self.name = name
        self.outputs = outputs
        self.timeout = timeout  # s; the scheduler's watchdog fails the work after that
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.probe = False  # the startup barrier: a timeout means the switch is unreachable
        self.small = False  # the scheduler's latency path (scheduler.py): set by the group for small collectives
        self.source = -1  # a receive from any source: the rank it came from
        self.fingerprint = None  # what every rank must agree on (fingerprint.py); None: not checked
        self.checks: list[int] = []  # the group's check numbers of its engine operations (fingerprint.py)
        self._done_future: Future = Future()  # what the backend completes (Python's set_exception)
        self._future: Future | None = None  # what c10d and DDP get (get_future: made on first use, a
        # `then` of _done_future, so C++ sees errors); a blocking dist.all_reduce never asks for it
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._waiters = 0  # threads blocked in wait(): one of them may run the result's assembly
        self._handoff: Callable[[], None] | None = None  # the assembly handed to a blocked waiter (hand_to_waiter)
        self._wake = threading.Event()  # set on completion, failure or a hand-off

    # -- completion (backend threads) -------------------------------------------------------------------
    def _complete(self) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._done.set()
            self._wake.set()
        self._done_future.set_result(self.outputs)
        return True

    def _fail(self, error: BaseException) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._error = error
            self._done.set()
            self._wake.set()
        self._done_future.set_exception(error)
        return True

    def hand_to_waiter(self, assembly: Callable[[], None]) -> bool:
        """Have a thread blocked in `wait()` run `assembly()` (which completes or fails this Work)
        itself, instead of the completion thread: one thread wake-up less per blocking collective
        (the engine thread wakes the caller, not the completion thread which then wakes the caller).
        Returns False, and runs nothing, when no thread waits (the caller then queues the assembly
        for the completion thread as before)."""
        with self._lock:
            if not self._waiters or self._done.is_set() or self._handoff is not None:
                return False
            self._handoff = assembly
            self._wake.set()
        return True

    # -- the c10d Work API ------------------------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        deadline = time.monotonic() + seconds if seconds else None  # None, or c10d's kNoTimeout (0 ms)
        with self._lock:
            self._waiters += 1
        try:
            self._wake.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            with self._lock:
                self._waiters -= 1
                assembly, self._handoff = self._handoff, None  # never left behind, even on a timeout
            if assembly is not None:  # handed to this thread (hand_to_waiter): it completes or fails the Work
                assembly()
        # else done, or another waiter took the hand-off and is finishing the assembly
        if not self._done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"luwu {self.name}: not complete after wait(timeout={seconds} s)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        with self._lock:
            if self._future is None:
                self._future = self._done_future.then(_unwrap)  # runs at once when already complete
            return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self.outputs

    def _source_rank(self) -> int:
        """The sender of a completed receive from any source (`dist.recv(t)` without `src`)."""
        return self.source

    def synchronize(self) -> None:  # CPU tensors: nothing to order against a stream
        pass

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done.is_set() else "pending")
        return f"<LuwuWork {self.name} {state}>"
