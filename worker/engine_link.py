"""A worker's SmartNIC engine, one interface for the torch backend and ModelInNetwork.

`EmbeddedLink` runs `luwu.dataplane.engine.Engine` in a thread of this process; `DaemonLink`
runs it in an engine process (`luwu engine`) and moves data through /dev/shm buffers. Both give:
`allreduce(x, op, out=)` (a Handle whose result is an array the caller owns: `out` when given, which
may be `x` itself; the daemon's buffers come from a pool, as DDP reuses the same bucket sizes every
step), and for model-in-network training
`staging(numel)` buffers that `push` reads and `pull` writes in place (the pulled parameters land
in the posted buffer, no copy), `stats`, `describe`/`failure` for error messages, `close`.
`open_engine` picks one by name or wraps a running Engine / EngineClient the caller keeps.

A process has one engine process (`EngineHost`), whatever its number of process groups: it is
started before the first group's plan is known (`prestart`, so its start-up overlaps the
switch's and the plan's exchange), each group opens its own engine in it over its own
connection (new_group starts no process), and the last group to close stops it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from luwu.dataplane.engine.client import EngineClient
from luwu.dataplane.engine.handles import CorruptResult, EngineError, Handle
from luwu.dataplane.engine.shm import ShmBuffer
from luwu.dataplane.process import children
from luwu.dataplane.session import EndpointPlan

if TYPE_CHECKING:  # annotations only: the engine link itself does not need torch
    import torch

    # the engine itself is imported where an embedded one starts: a worker whose engine runs in the
    # engine daemon never loads it (~30 ms of CPU on init_process_group's path)
    from luwu.dataplane.engine.engine import Engine, EngineConfig

MIN_SHM_BUFFER = 1 << 16  # bytes; smaller requests share this size class


class Staging:
    """One staging buffer of `capacity` float32 elements: a unit's values (a pull lands there) or
    its gradient (a push reads it until the push completes). A bf16 pull may land its values as
    their raw 16 bits (`view(..., np.uint16)`: the buffer's first half, in bf16 elements)."""

    __slots__ = ("array", "buf", "capacity", "tensor", "views")

    def __init__(self, array: np.ndarray, buf: ShmBuffer | None = None):
        self.array = array
        self.buf = buf  # the ShmBuffer behind `array` (engine daemon) or None
        self.capacity = array.size
        self.tensor: torch.Tensor | None = None  # a torch view of `array`, made once by a user that copies tensors in (ModelInNetwork)
        self.views: dict = {}  # views of `tensor` a user makes once and keeps (ModelInNetwork: a unit's gradient slots)

    def view(self, numel: int, offset: int = 0, dtype: type = np.float32) -> np.ndarray:
        """Elements offset..offset+numel of the buffer seen as `dtype` (float32, or uint16: bf16 bits)."""
        arr = self.array if dtype is np.float32 else self.array.view(dtype)
        return arr[offset:offset + numel]


def _shared(st: Staging) -> ShmBuffer:
    if st.buf is None:
        raise ValueError("a staging buffer of an embedded engine handed to the engine daemon")
    return st.buf


class EngineLink:
    kind = "engine"
    # float sums' wire format for this link's pushes and allreduces ("fixed32" | "fixed16"; None:
    # the engine's config.grad_format, LUWU_GRAD_FORMAT): ModelInNetwork(grad_format=) sets it
    grad_format: str | None = None

    def allreduce(self, x: np.ndarray, op: str = "sum", check: np.ndarray | None = None,
                  out: np.ndarray | None = None) -> Handle:
        """The engine's allreduce of x; `check`: fingerprint fields every worker must have equal
        (Engine.allreduce: else the handle fails with CollectiveMismatch on every worker).

        `out` (a C-contiguous array of x's dtype and size, possibly x itself) receives the result
        with no new array: the embedded engine decodes RESULTs straight into it; the daemon decodes
        into its shared buffer and copies that into `out` once. Except: a float sum whose handle is
        `saturated` (NaN chunks for an exact recomputation) gets a new array from the daemon, and
        `out` (and so an in-place x) is left as it was, the input that recomputation reads; the
        embedded engine decodes into `out` and keeps the inputs it needs (`handle.info["kept"]`)."""
        raise NotImplementedError

    def staging(self, numel: int) -> Staging:
        raise NotImplementedError

    def push(self, st: Staging, numel: int, session: int, tensor: int, offset: int = 0) -> Handle:
        """Push st[offset:offset+numel] as layer `tensor`'s gradient (a slice of a unit: offset > 0)."""
        raise NotImplementedError

    def pull(self, st: Staging, numel: int, session: int, tensor: int, version: int, offset: int = 0,
             dtype: type = np.float32) -> Handle:
        """Pull layer `tensor` at `version` into st.view(numel, offset, dtype): float32 (a bf16 or
        fp16 served copy widened exactly), or uint16 for a bf16 served copy's raw bits, byte-swapped
        from the wire and nothing else (a served copy of another dtype then fails the handle)."""
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

    def startup_over(self) -> None:
        """The user's start-up is over (the torch backend's start barrier passed): an engine that
        deferred loading its compiled kernels (`open_engine(defer_kernels=True)`) loads them now.
        The engine daemon decides this itself (after its first completed operation)."""


class EmbeddedLink(EngineLink):
    kind = "embedded"

    def __init__(self, plan: EndpointPlan | None = None, engine: Engine | None = None,
                 config: EngineConfig | None = None, defer_kernels: bool = False):
        self.owned = engine is None  # a running engine handed in stays the caller's to close
        self._kernels_go = threading.Event()  # set by startup_over (defer_kernels)
        if engine is None:
            if plan is None:
                raise ValueError("EmbeddedLink needs a plan or a running engine")
            from luwu.dataplane.engine.engine import Engine

            engine = Engine(plan, config).start(self._kernels_go if defer_kernels else None)
        self.engine = engine

    def startup_over(self) -> None:
        self._kernels_go.set()

    def allreduce(self, x: np.ndarray, op: str = "sum", check: np.ndarray | None = None,
                  out: np.ndarray | None = None) -> Handle:
        return self.engine.allreduce(x, op, out=out, check=check, grad_format=self.grad_format)

    def staging(self, numel: int) -> Staging:
        return Staging(np.zeros(numel, dtype=np.float32))

    def push(self, st: Staging, numel: int, session: int, tensor: int, offset: int = 0) -> Handle:
        return self.engine.push(session, tensor, st.view(numel, offset), grad_format=self.grad_format)

    def pull(self, st: Staging, numel: int, session: int, tensor: int, version: int, offset: int = 0,
             dtype: type = np.float32) -> Handle:
        return self.engine.pull(session, tensor, version, out=st.view(numel, offset, dtype))

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
        if self.owned:
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

    def __init__(self, plan: EndpointPlan | None, workdir: str, connect_timeout: float,
                 client: EngineClient | None = None):
        self.host: EngineHost | None = None
        if client is not None:  # a running daemon the caller keeps
            self.client, self.owned = client, False
        else:
            if plan is None:
                raise ValueError("DaemonLink needs a plan or a running engine client")
            self.host = EngineHost.acquire(workdir)
            try:
                self.client = self.host.open(plan, connect_timeout)
            except BaseException:
                self.host.release()
                raise
            self.owned = True
        self.proc = self.client.process or (self.host.proc if self.host is not None else None)
        self.log_path = self.client.log_path or (self.host.log_path if self.host is not None else None)
        self.pool = _ShmPool(self.client)

    def staging(self, numel: int) -> Staging:
        buf = self.client.buffer(4 * max(numel, 1))
        return Staging(buf.view(np.float32, max(numel, 1)), buf)

    def push(self, st: Staging, numel: int, session: int, tensor: int, offset: int = 0) -> Handle:
        return self.client.push(_shared(st), st.view(numel, offset), session, tensor, grad_format=self.grad_format)

    def pull(self, st: Staging, numel: int, session: int, tensor: int, version: int, offset: int = 0,
             dtype: type = np.float32) -> Handle:
        return self.client.pull(_shared(st), st.view(numel, offset, dtype), session, tensor, version)

    def allreduce(self, x: np.ndarray, op: str = "sum", check: np.ndarray | None = None,
                  out: np.ndarray | None = None) -> Handle:
        if out is not None and (out.dtype != x.dtype or out.size != x.size or not out.flags.c_contiguous):
            raise ValueError(f"allreduce out= must be a C-contiguous {x.dtype} array of {x.size} elements")
        dest = None if out is None else out.reshape(-1)  # a view: out is contiguous
        buf = self.pool.take(x.nbytes)
        view = buf.view(x.dtype, x.size)
        np.copyto(view, x.reshape(-1))
        res = Handle(f"allreduce({x.size} x {x.dtype}, {op})")

        def done(h: Handle) -> None:
            if h.error is not None:
                err = h.error
                if isinstance(err, CorruptResult) and err.chunks is not None:  # the other chunks' sums (reductions.py)
                    err = CorruptResult(str(err), err.chunks, err.per, view.copy())
                res.set_error(err)
                self.pool.give(buf)
                return
            if dest is not None and not h.saturated:  # one copy, from the shared buffer into the caller's
                np.copyto(dest, view)
                result = dest
            else:  # dest (maybe the caller's input) stays as it was for the exact recomputation
                result = view.copy()
            self.pool.give(buf)
            res.saturated = h.saturated
            res.set_result(result)

        try:
            self.client.allreduce(buf, view, op, check=check, grad_format=self.grad_format).add_done_callback(done)
        except Exception:
            self.pool.give(buf)
            raise
        return res

    def describe(self) -> str:
        pid = self.proc.pid if self.proc is not None else "not a child of this process"
        return f"the engine daemon (pid {pid}, log {self.log_path})"

    def failure(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.poll()
        return (f"the engine daemon (pid {self.proc.pid}) exited with code {code}; its log {self.log_path} ends "
                f"with:\n{children.tail(self.log_path) if self.log_path else '(no log)'}")

    def stats(self) -> dict | None:
        if self.failure() is not None:
            return None
        try:
            return self.client.stats(timeout=5.0)
        except (EngineError, TimeoutError):
            return None

    def close(self) -> None:
        if not self.owned:
            return
        self.client.close()  # this connection's engine; the process stays for the other users
        if self.host is not None:
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


def open_engine(kind: str | Engine | EngineClient, plan: EndpointPlan, workdir: str,
                connect_timeout: float = 30.0, defer_kernels: bool = False) -> EngineLink:
    """This worker's engine for `plan`.

    Args:
        kind: "embedded" (a thread of this process), "process" (an engine of this process's engine
            daemon, started on first use and shared by every user here), or a running `Engine` /
            `EngineClient` to use as it is (the caller closes it).
        plan: the endpoint plan the engine serves.
        workdir: where the daemon's socket and log go.
        connect_timeout: seconds to wait for the daemon to listen.
        defer_kernels: an embedded engine loads its compiled kernels once `startup_over()` is
            called (or after a few seconds) rather than at once: numba's import holds this
            process's GIL for most of ~0.5 s of CPU (the torch backend's start-up and first
            collective would wait). Results are the same bits either way.

    Returns:
        An EngineLink; close it when done.
    """
    if isinstance(kind, EngineClient):
        return DaemonLink(None, workdir, connect_timeout, client=kind)
    if kind == "embedded":
        return EmbeddedLink(plan, defer_kernels=defer_kernels)
    if kind == "process":
        return DaemonLink(plan, workdir, connect_timeout)
    if not isinstance(kind, str):
        from luwu.dataplane.engine.engine import Engine

        if isinstance(kind, Engine):
            return EmbeddedLink(engine=kind)
    raise ValueError(f"engine={kind!r}: use 'process', 'embedded', or a running Engine / EngineClient")
