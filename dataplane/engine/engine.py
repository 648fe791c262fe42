"""The SmartNIC endpoint engine: one event loop that owns an endpoint's socket and sessions.

A worker's engine runs allreduce (collective sessions), push and pull (node sessions); an
optimizer node's engine assembles summed gradients and serves parameters. API calls may come
from any thread and return a `Handle` at once: while the loop sleeps, the call runs on the
caller's thread under the loop's lock (with the sends it makes: no wake-up of the loop), else it
is queued for the loop's next turn (`_submit`).
The loop drains received batches, lets every session send what its window allows, and runs
timers (retransmission, heartbeats, pull retries).

This file holds the engine's construction, lifecycle and API (what callers use); the loop and the
hand-over of commands to it are `EngineLoop` (loop.py), the receive dispatch of a batch to its
sessions `DispatchMixin` (dispatch.py), mixins of `Engine`.
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
from collections.abc import Callable

import numpy as np

from ..integrity import FIXED16_BLOCK, FIXED16_MIN_LANES
from ..kernels import mode as kernel_mode
from ..net.transport import Transport
from ..protocol import HEADER_LEN, NODE
from ..quantize import FIXED16_MAX_CONTRIBUTORS, block_exponents, chunk_exponents
from ..session import EndpointPlan, SessionSpec
from .collective import CollectiveSession
from .config import EngineConfig, check_grad_format
from .dispatch import DispatchMixin, Session
from .handles import EngineError, Handle
from .liveness import PeerWatch
from .loop import EngineLoop
from .node_server import GradientSink, NodeServerSession, ParamProvider
from .node_worker import WorkerNodeSession
from .reductions import AllreduceOp, check_reduction
from .send_stream import RtoEstimator
from .transport import open_transport, switch_name

KERNELS_DEFER = 5.0  # s a start(kernels_after=) engine waits for its event before loading its compiled kernels
# the dtypes' names in a handle's name: str(dtype) costs numpy's Python-level naming on every call
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32"}


class Engine(EngineLoop, DispatchMixin):
    def __init__(self, plan: EndpointPlan, config: EngineConfig | None = None,
                 provider: ParamProvider | None = None, on_gradient: GradientSink | None = None):
        self.config = cfg = config or EngineConfig()
        kernel_mode()  # a bad LUWU_KERNELS fails here, as one line, not later in the engine's loop
        self.plan = plan
        w = plan.wiring
        self.rank = w.rank
        self.is_node = w.rank == NODE
        lanes = max([s.lanes for s in plan.sessions] or [64])
        # the transport seam (transport.py): a UDP BatchSocket or shared-memory rings, one interface
        self.sock: Transport = open_transport(w, cfg.batch, HEADER_LEN + 4 * lanes + 64, cfg.socket_buffer)
        # a transport with a doorbell (the shm rings), or None (a socket): the loop arms it before
        # it sleeps, lets a busy turn sleep, and goes on at once after a send cut short (tx_full)
        self._shm: Transport | None = self.sock if self.sock.doorbell else None
        now = time.monotonic()
        self.watch = PeerWatch(switch_name(w), cfg.peer_timeout, now)
        self.sessions: dict[int, Session] = {}
        self.meta: CollectiveSession | None = None
        self.data: CollectiveSession | None = None
        for spec in plan.sessions:
            spec.validate()
            self.sessions[spec.session] = self._make_session(spec, provider, on_gradient, now)
        self._cmds: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stop = False
        # set by the loop before its last look at the commands, cleared once it is awake: a command
        # submitted meanwhile writes the wake pipe; one submitted while the loop runs needs not
        self._sleeping = True
        # held by the loop for all of a turn, free while it sleeps in poll(): a caller that takes it
        # runs its command (and the sends it makes) on its own thread, so a pull's PULL or a push's
        # exponent row goes out with no wake-up of the loop and no hand-over of the GIL (_submit)
        self._lock = threading.Lock()
        self._sleep_until = 0.0  # when the sleeping loop wakes by itself (its earliest deadline)
        self._pumps: list[Callable[[float], int]] = []
        self._wakers: list[Callable[[], float]] = []
        self._thread: threading.Thread | None = None
        self._handles: set[Handle] = set()
        # what the loop's poll() waits on: the port, the wake pipe and `add_reader`'s fds; the
        # readers alone again for a turn that does not sleep (poll(0))
        self._readers: dict[int, Callable[[], None]] = {}
        self._poller = select.poll()
        self._reader_poller = select.poll()
        # direct: commands run on the caller's thread while the loop slept; direct_wakes: those
        # whose new deadline came before the loop's, which then had to be woken after all
        self.stats = {"rx_bad": 0, "rx_unexpected": 0, "loop_turns": 0, "direct": 0, "direct_wakes": 0,
                      "dropped.bad_header": 0}
        self.error: BaseException | None = None

    def _make_session(self, spec: SessionSpec, provider: ParamProvider | None, on_gradient: GradientSink | None,
                      now: float) -> Session:
        cfg = self.config
        rto = RtoEstimator(cfg.rto)
        if spec.kind == "collective":
            if self.is_node:
                raise ValueError(f"session {spec.session}: an optimizer node takes no part in collective sessions")
            s = CollectiveSession(spec, self.rank, self.sock, rto, now)
            if spec.purpose == "meta":
                self.meta = s
            elif self.data is None:
                self.data = s
            return s
        if self.is_node:
            return NodeServerSession(spec, self.sock, rto, cfg.heartbeat, now, provider, on_gradient)
        return WorkerNodeSession(spec, self.rank, self.sock, rto, cfg.heartbeat, cfg.pull_retry, now)

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        """The local UDP address, or (ring prefix, 0) on a shared-memory port."""
        address = self.sock.address
        return address if isinstance(address, tuple) else (address, 0)

    def start(self, kernels_after: threading.Event | None = None) -> Engine:
        """Start the engine's loop. Its compiled kernels load in the background meanwhile, and the
        first sums run the numpy reference (the same bits) instead of waiting ~0.5 s for numba;
        `kernels_after`: the loading waits until it is set (or `KERNELS_DEFER` s have passed), as
        the engine daemon's does, so that numba's import (which holds this process's GIL) stays
        off a start-up that waits for this engine (the torch backend's, embedded: its start barrier)."""
        from ..kernels import load_in_background
        from ..quantize import warm_up

        if kernels_after is None:
            load_in_background(warm_up)
        else:
            def load() -> None:
                kernels_after.wait(KERNELS_DEFER)
                warm_up()

            load_in_background(load)
        self._thread = threading.Thread(target=self._run, name=f"luwu-engine-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        for h in list(self._handles):
            h.set_error(EngineError("the engine was closed before this operation completed"))
        self.sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    @property
    def stopped(self) -> bool:
        """Closed, or its loop ended (`error` says why when it failed)."""
        return self._stop or (self._thread is not None and not self._thread.is_alive())

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API (any thread) -------------------------------------------------------------------------
    def allreduce(self, x: np.ndarray, op: str = "sum", session: int | None = None,
                  out: np.ndarray | None = None, check: np.ndarray | None = None,
                  grad_format: str | None = None) -> Handle:
        """Reduce a float32/int32 buffer over the session's workers.

        Args:
            x (np.ndarray): this worker's contribution, float32 or int32 (read, never written,
                unless it is also `out`).
            op (str): "sum", "avg", "max" or "min" (not "avg" for int32).
            session (int, optional): the collective session; default: the plan's data session.
            out (np.ndarray, optional): a C-contiguous array of x's dtype and size that the
                result is decoded into as it arrives (no new array, no copy). It may be `x`
                itself (in place: each chunk of x is read before its sum can arrive), but then x
                is gone for an exact recomputation of saturated elements. Its contents are
                undefined until the handle completes.
            check (np.ndarray, optional): this worker's fingerprint of the operation, non-negative
                int32 fields every worker must have equal (reductions.py); if any worker's differ,
                the handle fails with `CollectiveMismatch` (lo/hi per field) on every worker.
            grad_format (str, optional): a float sum's wire format, "fixed32" or "fixed16"
                (docs/protocol.md 5.2); default: the engine's `config.grad_format`. Every worker
                must use the same. Ignored for max/min and int32.

        Returns:
            Handle: its result is `out` (a flat view of it when it is not 1-D), or a new
            array when `out` is None; `handle.saturated`
            marks float sums whose NaN chunks need the exact path (docs/protocol.md 5.1).

        Examples::

            >>> y = np.empty_like(x)
            >>> eng.allreduce(x, "sum", out=y).wait(60) is y
            True
        """
        data = self._collective(session)
        x = np.ascontiguousarray(x).reshape(-1)
        check_reduction(x.dtype, op)
        if out is not None:
            if not isinstance(out, np.ndarray) or out.dtype != x.dtype or out.size != x.size \
                    or not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError(f"allreduce out= must be a writable C-contiguous {x.dtype} array of {x.size} "
                                 f"elements, got {getattr(out, 'dtype', type(out).__name__)} of "
                                 f"{getattr(out, 'size', '?')}")
            if out.ndim != 1:
                out = out.reshape(-1)
        fmt = check_grad_format(grad_format or self.config.grad_format)
        if fmt == "fixed16" and data.lanes < FIXED16_MIN_LANES:
            fmt = "fixed32"  # a packet too small for one block: the 32-bit format, exact as ever
        handle = Handle(f"allreduce({x.size} x {_DTYPE_NAMES.get(x.dtype) or x.dtype}, {op})")
        aop = AllreduceOp(x, op, data.spec.num_workers, handle, AllreduceOp.local_exponents(x, op, data.lanes, fmt),
                          out, check, fmt)
        self._submit(handle, lambda: aop.start(self.meta, data))
        return handle

    def push(self, session: int, tensor: int, x: np.ndarray, grad_format: str | None = None) -> Handle:
        """Sum a worker's float32 gradient for layer `tensor` into the node serving `session`.

        Every worker of the session pushes the same layer; the switch sums the contributions and
        forwards one stream to the optimizer node, which steps the layer when it is complete.

        Args:
            session (int): the node session (EndpointPlan) of the node that serves the layer.
            tensor (int): the layer id.
            x (np.ndarray): the gradient, flattened to float32 (not modified). It must stay
                unchanged until the handle is done: a resend quantises it again (nothing is
                copied); once done it may be reused.
            grad_format (str, optional): "fixed32" or "fixed16" (docs/protocol.md 5.2); default:
                the engine's `config.grad_format`. Every worker of the session must use the same.

        Returns:
            Handle: completes when the node has acknowledged the whole gradient; its error names
            a dead switch or node (LuwuPeerDead) or a refused push.

        Examples:
            >>> h = engine.push(node_session, layer_id, grad.numpy())  # doctest: +SKIP
            >>> h.wait(timeout=60)
        """
        s = self._node_session(session)
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        if self.meta is None:
            raise EngineError("push needs the job's meta session (exponent agreement); the plan has none")
        meta = self.meta  # the narrowed session, for the command that runs later on the engine thread
        handle = Handle(f"push(layer {tensor}, {x.size})")
        fmt = check_grad_format(grad_format or self.config.grad_format)
        if fmt == "fixed16" and (s.lanes < FIXED16_MIN_LANES or s.spec.num_workers > FIXED16_MAX_CONTRIBUTORS):
            fmt = "fixed32"  # the format cannot carry this session's sums: the 32-bit one, exact as ever
        if not x.size:
            exps = None
        else:
            exps = block_exponents(x, FIXED16_BLOCK) if fmt == "fixed16" else chunk_exponents(x, s.lanes)
        self._submit(handle, lambda: s.push(tensor, x, meta, handle, exps, fmt))
        return handle

    def pull(self, session: int, tensor: int, version: int, out: np.ndarray | None = None) -> Handle:
        """Fetch layer `tensor` at `version` from the node serving `session` (into `out` if given)."""
        s = self._node_session(session)
        handle = Handle(f"pull(layer {tensor} v{version})")
        self._submit(handle, lambda: s.pull(tensor, version, handle, out, time.monotonic()))
        return handle

    def bind(self, session: int, provider: ParamProvider, on_gradient: GradientSink) -> Handle:
        """Node role: serve `session` from `provider`, handing its summed gradients to `on_gradient`."""
        s = self.sessions.get(session)
        if not isinstance(s, NodeServerSession):
            raise EngineError(f"session {session} is not a node session served by this endpoint "
                              f"(it serves {sorted(k for k, v in self.sessions.items() if isinstance(v, NodeServerSession))})")
        handle = Handle(f"bind(session {session})")

        def go() -> None:
            s.bind(provider, on_gradient)
            s.retry_waiting()
            handle.set_result(None)

        self._submit(handle, go)
        return handle

    def notify_params(self) -> None:
        """Node role: parameters became available; retry pulls that were waiting for them.

        Wakes the loop only when a pull waits (most publications find none: a loop turn each). A
        pull that arrives meanwhile cannot be missed: the loop puts it in `waiting` before it looks
        its version up, and the caller made the version visible before calling this."""
        if not any(isinstance(s, NodeServerSession) and s.waiting for s in list(self.sessions.values())):
            return

        def retry() -> None:
            for s in self.sessions.values():
                if isinstance(s, NodeServerSession):
                    s.retry_waiting()
        self._cmds.append(retry)
        self._wake()

    def add_reader(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Run `on_readable()` on the engine's thread whenever `fd` is readable (or hung up).

        For a control channel served by the loop itself (luwu/daemons/engine.py): a request then
        costs no second thread's wake-up, no hand-over of the GIL and no wake pipe. The loop
        looks at `fd` with its packets before it sleeps, and with a poll(0) on a turn that goes on
        at once. `on_readable` must not block, must read what made `fd` readable (or call
        `remove_reader`), and should not raise (an exception fails the engine).

        Args:
            fd (int): a file descriptor that stays open until `remove_reader(fd)`.
            on_readable (Callable[[], None]): called with no arguments on the engine thread.

        Examples:
            >>> engine.add_reader(conn.fileno(), lambda: handle(conn.recv(65536)))  # doctest: +SKIP
        """
        def add() -> None:
            self._readers[fd] = on_readable
            self._poller.register(fd, select.POLLIN)
            self._reader_poller.register(fd, select.POLLIN)

        self._cmds.append(add)
        self._wake()

    def remove_reader(self, fd: int) -> None:
        """Stop watching `fd` (`add_reader`); on the engine thread only (from `on_readable`)."""
        if self._readers.pop(fd, None) is not None:
            self._poller.unregister(fd)
            self._reader_poller.unregister(fd)

    def session_stats(self) -> dict:
        out = {"engine": dict(self.stats), "socket": dict(self.sock.stats)}
        for sid, s in self.sessions.items():
            entry = dict(getattr(s, "stats", {}))
            for name in ("send", "grad", "params"):
                stream = getattr(s, name, None)
                if stream is not None:
                    entry[f"{name}_stream"] = dict(stream.stats, ack=stream.ack, rto=stream.rto.rto)
            out[f"session {sid}"] = entry
        return out

    def _collective(self, session: int | None) -> CollectiveSession:
        if session is None:
            if self.data is None:
                raise EngineError("this endpoint's plan has no collective data session")
            return self.data
        s = self.sessions.get(session)
        if not isinstance(s, CollectiveSession):
            raise EngineError(f"session {session} is not a collective session of this endpoint")
        return s

    def _node_session(self, session: int) -> WorkerNodeSession:
        s = self.sessions.get(session)
        if not isinstance(s, WorkerNodeSession):
            raise EngineError(f"session {session} is not a node session of this worker")
        return s
