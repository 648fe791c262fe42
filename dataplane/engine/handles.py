"""Completion handles for engine operations: `wait()`, callbacks, errors.

A `Handle` is completed from the engine's thread; callers wait on it from any thread (the
c10d Work objects of the torch backend wrap these).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class EngineError(RuntimeError):
    """An operation failed or the engine stopped before completing it."""


class CollectiveMismatch(EngineError):
    """The workers' fingerprints of one allreduce differ (`Engine.allreduce(check=...)`): `lo` and
    `hi` are the smallest and largest value of each field over the workers; `mine` this worker's."""

    def __init__(self, message: str, lo: list[int], hi: list[int], mine: list[int]):
        super().__init__(message)
        self.lo, self.hi, self.mine = lo, hi, mine


class CorruptResult(EngineError):
    """A result whose check words failed on every resend (docs/protocol.md 3.6): a contribution
    was corrupted before the switch summed it, and the op has no exact path to take instead.

    For an allreduce's data, `chunks` lists the corrupt chunks (sorted; `per` elements each, the
    last one maybe short) and `result` is the result array with every other chunk's sum in it (the
    corrupt chunks hold this worker's input when the allreduce ran in place, else anything): what an
    exact recomputation of those elements needs (the torch backend: worker/backend/fallback.py).
    Otherwise they are None."""

    def __init__(self, message: str, chunks: list[int] | None = None, per: int = 0, result=None):
        super().__init__(message)
        self.chunks, self.per, self.result = chunks, per, result


class Handle:
    __slots__ = ("_callbacks", "_done", "_error", "_event", "_lock", "_result", "info", "name", "saturated")

    def __init__(self, name: str = "op"):
        # the Event is made only when someone waits before completion: most handles of an engine
        # daemon complete through callbacks, and an Event (a Condition and two locks) per request
        # was a tenth of its control thread's CPU
        self._event: threading.Event | None = None
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._lock = threading.Lock()
        self.name = name
        self.saturated = False  # a contributor's quantiser clipped: a float sum's saturated chunks read NaN (protocol.md 5.1)
        self.info: dict = {}

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            with self._lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if not self._done and event is not None and not event.wait(timeout):
                raise TimeoutError(f"{self.name} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done:  # the first completion wins
                return
            self._result, self._error = result, error
            self._done = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, []
        if event is not None:
            event.set()
        for fn in callbacks:
            fn(self)

    def set_result(self, result: Any = None) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)
