"""A rank's SmartNIC engine as the backend sees it: allreduce of a flat float32/int32 array.

`EmbeddedLink` runs `luwu.dataplane.engine.Engine` in a thread of this process; `DaemonLink`
runs it in an engine process (`luwu engine`) and moves data through /dev/shm buffers kept in a
pool (DDP reuses the same bucket sizes every step). Both return engine `Handle`s whose result
is an array the caller owns, completed from another thread.

A process has one engine process (`EngineHost`), whatever its number of process groups: it is
started before the first group's plan is known (`prestart`, so its start-up overlaps the
switch's and the plan's exchange), each group opens its own engine in it over its own
connection (new_group starts no process), and the last group to close stops it.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from luwu.dataplane import children
from luwu.dataplane.engine import Engine, EngineError, Handle
from luwu.dataplane.engine.client import EngineClient
from luwu.dataplane.engine.shm import ShmBuffer
from luwu.dataplane.session import EndpointPlan

MIN_SHM_BUFFER = 1 << 16  # bytes; smaller requests share this size class


class EngineLink:
    kind = "engine"

    def allreduce(self, x: np.ndarray, op: str) -> Handle:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the engine cannot work any more, or None while it is alive."""
        raise NotImplementedError

    def stats(self) -> dict | None:
        return None

    def close(self) -> None:
        raise NotImplementedError


class EmbeddedLink(EngineLink):
    kind = "embedded"

    def __init__(self, plan: EndpointPlan):
        self.engine = Engine(plan).start()

    def allreduce(self, x: np.ndarray, op: str) -> Handle:
        return self.engine.allreduce(x, op)

    def describe(self) -> str:
        host, port = self.engine.address
        where = f"shared-memory port {host}" if self.engine.plan.wiring.transport == "shm" else f"UDP {host}:{port}"
        return f"the embedded engine (a thread of pid {os.getpid()}, {where})"

    def failure(self) -> str | None:
        if self.engine.error is not None:
            return f"the embedded engine's loop failed: {self.engine.error!r}"
        thread = self.engine._thread
        if thread is not None and not thread.is_alive():
            return "the embedded engine's thread has stopped"
        return None

    def stats(self) -> dict | None:
        return self.engine.session_stats()

    def close(self) -> None:
        self.engine.close()


class _ShmPool:
    """Shared buffers by power-of-two size class, reused once an operation has completed."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.free: dict[int, list[ShmBuffer]] = {}
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> ShmBuffer:
        size = max(MIN_SHM_BUFFER, 1 << max(0, nbytes - 1).bit_length())
        with self.lock:
            bucket = self.free.get(size)
            if bucket:
                return bucket.pop()
        return self.client.buffer(size)

    def give(self, buf: ShmBuffer) -> None:
        with self.lock:
            self.free.setdefault(buf.nbytes, []).append(buf)


class DaemonLink(EngineLink):
    kind = "process"

    def __init__(self, plan: EndpointPlan, workdir: str, connect_timeout: float):
        self.host = EngineHost.acquire(workdir)
        try:
            self.client = self.host.open(plan, connect_timeout)
        except BaseException:
            self.host.release()
            raise
        self.proc = self.host.proc
        self.log_path = self.host.log_path
        self.pool = _ShmPool(self.client)

    def allreduce(self, x: np.ndarray, op: str) -> Handle:
        buf = self.pool.take(x.nbytes)
        view = buf.view(x.dtype, x.size)
        np.copyto(view, x.reshape(-1))
        out = Handle(f"allreduce({x.size} x {x.dtype}, {op})")

        def done(h: Handle) -> None:
            if h.error is not None:
                out.set_error(h.error)
                self.pool.give(buf)
                return
            result = view.copy()
            self.pool.give(buf)
            out.saturated = h.saturated
            out.set_result(result)

        try:
            self.client.allreduce(buf, view, op).add_done_callback(done)
        except Exception:
            self.pool.give(buf)
            raise
        return out

    def describe(self) -> str:
        return f"the engine daemon (pid {self.proc.pid}, log {self.log_path})"

    def failure(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        return (f"the engine daemon (pid {self.proc.pid}) exited with code {code}; its log {self.log_path} ends "
                f"with:\n{children.tail(self.log_path)}")

    def stats(self) -> dict | None:
        if self.proc.poll() is not None:
            return None
        try:
            return self.client.stats(timeout=5.0)
        except (EngineError, TimeoutError):
            return None

    def close(self) -> None:
        self.client.close()  # this group's engine; the process stays for the other groups
        self.host.release()


class EngineHost:
    """This process's engine process, shared by its process groups (reference-counted)."""

    _lock = threading.Lock()
    _current: EngineHost | None = None

    def __init__(self, workdir: str):
        self.proc, self.control, self.log_path = EngineClient.launch(None, workdir)
        self.users = 0

    @classmethod
    def prestart(cls, workdir: str) -> None:
        """Start the engine process now, without waiting for it (idempotent while it runs)."""
        with cls._lock:
            cur = cls._current
            if cur is None or cur.proc.poll() is not None:
                cls._current = cls(workdir)

    @classmethod
    def acquire(cls, workdir: str) -> EngineHost:
        with cls._lock:
            cur = cls._current
            if cur is None or cur.proc.poll() is not None:
                cur = cls._current = cls(workdir)
            cur.users += 1
            return cur

    @classmethod
    def stop_if_unused(cls) -> None:
        """Stop a prestarted process no group took (the group's set-up failed first)."""
        with cls._lock:
            cur = cls._current
            if cur is None or cur.users > 0:
                return
            cur.users = 1
        cur.release()

    def open(self, plan: EndpointPlan, connect_timeout: float) -> EngineClient:
        """A connection with its own engine for `plan`."""
        try:  # waits for the process to listen (it may still be starting), or names its exit
            client = EngineClient(self.control, self.proc, connect_timeout)
        except EngineError as e:
            raise EngineError(f"{e}; the engine log {self.log_path} says:\n{children.tail(self.log_path)}") from e
        client.process = None  # shared: the client's close must not wait for it to exit (release stops it)
        client.log_path = self.log_path
        try:
            client.open(plan, connect_timeout)
        except BaseException:
            client.close()
            raise
        return client

    def release(self) -> None:
        """One group is done with the process; the last one stops it."""
        with EngineHost._lock:
            self.users -= 1
            if self.users > 0:
                return
            if EngineHost._current is self:
                EngineHost._current = None
        children.stop(self.proc, grace=10.0)


def open_engine(kind: str, plan: EndpointPlan, workdir: str, connect_timeout: float) -> EngineLink:
    if kind == "embedded":
        return EmbeddedLink(plan)
    return DaemonLink(plan, workdir, connect_timeout)
