"""A rank's SmartNIC engine as the backend sees it: allreduce of a flat float32/int32 array.

`EmbeddedLink` runs `luwu.dataplane.engine.Engine` in a thread of this process; `DaemonLink`
runs it as its own process (`luwu engine`) and moves data through /dev/shm buffers kept in a
pool (DDP reuses the same bucket sizes every step). Both return engine `Handle`s whose result
is an array the caller owns, completed from another thread.
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
        return f"the embedded engine (a thread of pid {os.getpid()}, UDP {host}:{port})"

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
        self.client = EngineClient.spawn(plan, workdir, connect_timeout=connect_timeout)
        self.proc = self.client.process
        self.log_path = self.client.log_path
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
        self.client.close()
        self._kill()

    def _kill(self) -> None:
        children.stop(self.proc, grace=10.0)


def open_engine(kind: str, plan: EndpointPlan, workdir: str, connect_timeout: float) -> EngineLink:
    if kind == "embedded":
        return EmbeddedLink(plan)
    return DaemonLink(plan, workdir, connect_timeout)
