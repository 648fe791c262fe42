"""The SmartNIC endpoint engine: one event loop that owns an endpoint's socket and sessions.

A worker's engine runs allreduce (collective sessions), push and pull (node sessions); an
optimizer node's engine assembles summed gradients and serves parameters. API calls may come
from any thread and return a `Handle` at once: while the loop sleeps, the call runs on the
caller's thread under the loop's lock (with the sends it makes: no wake-up of the loop), else it
is queued for the loop's next turn (`_submit`).
The loop drains received batches, lets every session send what its window allows, and runs
timers (retransmission, heartbeats, pull retries).
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
from collections.abc import Callable

import numpy as np

from ..integrity import FIXED16_BLOCK, header_ok, headers_ok
from ..kernels import mode as kernel_mode
from ..net.transport import Transport
from ..protocol import DATA_HEADER, HEADER_LEN, HEARTBEAT_HEADER, NODE, VERSION, Dtype, Flag, MsgType
from ..quantize import FIXED16_MAX_CONTRIBUTORS, block_exponents, chunk_exponents
from ..session import EndpointPlan, SessionSpec
from .collective import CollectiveSession
from .config import FIXED16_MIN_LANES, EngineConfig, check_grad_format
from .grouping import SCALAR_BATCH, groups_reference, groups_scalar
from .handles import EngineError, Handle
from .liveness import PeerWatch
from .node_server import GradientSink, NodeServerSession, ParamProvider
from .node_worker import WorkerNodeSession
from .reductions import AllreduceOp, check_reduction
from .send_stream import RtoEstimator
from .transport import open_transport, switch_name

Session = CollectiveSession | NodeServerSession | WorkerNodeSession  # what an endpoint's session id names
_ALL, _MIN = np.logical_and.reduce, np.minimum.reduce  # without the ndarray methods' wrappers (per batch)
# a header's first 32-bit word less its flags byte (ver_type, flags, session: bytes 0-3), in either byte order
_SAME_BATCH = np.frombuffer(bytes([0xFF, 0x00, 0xFF, 0xFF]), dtype=np.uint32)[0]


def _bad_headers(hb: np.ndarray, k: int) -> np.ndarray | None:
    """None when every one of the k (k, 32) headers `hb` passes its header check, else which do."""
    if k <= 4:
        if all(map(header_ok, [x.tobytes() for x in hb])):
            return None
        return np.array([header_ok(x.tobytes()) for x in hb], dtype=bool)
    ok = headers_ok(hb)
    return None if _ALL(ok) else ok


class Engine:
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

    def start(self) -> Engine:
        from ..kernels import load_in_background
        from ..quantize import warm_up

        # compiled kernels load beside startup; the first sums run the numpy reference (the same
        # bits) instead of waiting ~0.5 s for numba
        load_in_background(warm_up)
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
        handle = Handle(f"allreduce({x.size} x {x.dtype}, {op})")
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

    def _submit(self, handle: Handle, fn: Callable[[], None]) -> None:
        if self._stop or self._thread is None:
            raise EngineError("the engine is not running (start() it, or it was closed)")
        self._handles.add(handle)
        handle.add_done_callback(self._handles.discard)

        def guarded() -> None:
            try:
                fn()
            except Exception as e:  # an op that cannot start fails alone, the engine goes on
                handle.set_error(e)

        self._cmds.append(guarded)
        if self._lock.acquire(blocking=False):
            self._run_here()
        else:
            self._wake()  # the loop is in a turn (it looks at the commands before it sleeps) or is this thread

    def _run_here(self) -> None:
        """With the loop's lock, on the caller's thread: run the queued commands in their order
        (sequence numbers and pull ids are given out in submission order), send what they made
        sendable, and wake the loop only when it must act before it would wake by itself: a
        deadline more than `caller_slack` earlier than its own, or sends left over by a full up
        ring. Usually the answer (a RESULT, the PARAMs) is what wakes it: one wake-up per
        operation instead of two."""
        try:
            if self._stop or not self._pumps:  # closing, or the loop has not set up yet: its turn runs them
                wake = True
            else:
                while self._cmds:
                    self._cmds.popleft()()
                now = time.monotonic()
                shm = self._shm
                if shm is not None:
                    shm.tx_full = False
                for pump in self._pumps:
                    pump(now)
                wake = shm is not None and shm.tx_full  # the rest waits for room: the loop's to send
                if not wake:
                    until = self._sleep_until - self.config.caller_slack
                    for wake_at in self._wakers:
                        if wake_at() < until:
                            wake = True
                            break
                self.stats["direct"] += 1
                if wake:
                    self.stats["direct_wakes"] += 1
        finally:
            self._lock.release()
        if wake:
            self._wake()

    def _wake(self) -> None:
        if not self._sleeping:
            return  # the loop looks at its commands before it sleeps again: no byte, no extra turn
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        poller, readers, reader_poll = self._poller, self._readers, self._reader_poller.poll
        poller.register(self.sock.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        sock_fd = self.sock.fd
        now = time.monotonic()
        for s in self.sessions.values():
            if not isinstance(s, CollectiveSession):  # node sessions greet their peer; collectives have no hello
                s.hello(now)
        next_timer = deadlines_at = now
        rung = True  # the doorbell may hold a byte: drained at the first arm, then only once poll() reports it
        sessions = list(self.sessions.values())
        node_sessions = [(sid, s) for sid, s in self.sessions.items() if isinstance(s, WorkerNodeSession)]
        # the loop's per-turn work in plain loops over bound methods: a turn runs a dozen times per
        # allreduce, and generators, list building and attribute lookups were a tenth of its calls
        pumps: list[Callable[[float], int]] = [s.pump for s in sessions]
        wakers: list[Callable[[], float]] = [s.wake_at for s in sessions]  # every session kind says when it next needs the loop
        recv, dispatch, stats, shm = self.sock.recv, self._dispatch, self.stats, self._shm
        rx_batches, timer_tick = range(cfg.rx_batches_per_turn), cfg.timer_tick
        lock = self._lock
        lock.acquire()  # held for every turn, given up only while asleep in poll() (_run_here)
        self._pumps, self._wakers = pumps, wakers
        try:
            while not self._stop:
                while self._cmds:
                    self._cmds.popleft()()
                now = time.monotonic()
                got = 0
                for _ in rx_batches:
                    try:
                        k = recv()
                    except ConnectionRefusedError:  # the switch's port is gone (IP_RECVERR)
                        self._refused(now)
                        break
                    if not k:
                        break
                    dispatch(k, now)
                    got += k
                if got:
                    self.watch.heard(now)
                sent = 0
                if shm is not None:
                    shm.tx_full = False
                for pump in pumps:
                    sent += pump(now)
                if now >= next_timer:
                    for s in sessions:
                        s.on_timer(now)
                    self._check_peers(now, node_sessions)
                    next_timer = now + cfg.idle_tick  # liveness checks; the sessions' own deadlines below
                    deadlines_at = now  # the deadlines may have moved: ask the sessions this turn
                self._sleeping = True  # before the look at the commands (_wake)
                # on a shm port a turn that received or sent may sleep at once: what it received was
                # dispatched and pumped, and arm() looks for packets that came meanwhile. That saves
                # the empty turn that followed every busy one (half of all turns). Only a send that
                # stopped short on a full up ring (tx_full) goes on at once, as every busy turn did:
                # once a turn publishes nothing it sleeps (at least a tick: no spinning while the
                # switch, which needs the core, drains the ring). A UDP socket keeps going while busy.
                quiet = not (shm.tx_full and sent) if shm is not None else got == 0 and sent == 0
                idle = quiet and not self._cmds and not self._stop
                # sleep until the earliest deadline (retransmission, heartbeat, pull retry), not a fixed
                # tick. A turn that goes on at once asks the sessions at most once per timer tick: half
                # the turns do not sleep, and the question was a fifth of an idle turn's work
                if idle or now >= deadlines_at:
                    for wake_at in wakers:
                        at = wake_at()
                        if at < next_timer:
                            next_timer = at
                    deadlines_at = now + timer_tick
                if next_timer < now + timer_tick:
                    next_timer = now + timer_tick
                stats["loop_turns"] += 1
                # a shm port rings its doorbell only once armed; arming may find packets: then do not
                # sleep. Its doorbell is read only when the last poll() reported it (rung): most sleeps
                # end by a timer or a command, and an empty read was a system call and an exception each
                if idle and shm is not None:
                    idle, rung = shm.arm(rung), False
                if idle:
                    wait = max(0.0, next_timer - time.monotonic())
                    woken = False
                    self._sleep_until = next_timer
                    lock.release()
                    try:
                        ready = poller.poll(max(1, int(wait * 1000 + 0.5)) if wait > 0 else 0)
                    finally:
                        lock.acquire()
                    self._sleeping = False
                    for fd, ev in ready:
                        if fd == sock_fd:
                            rung = True
                            if ev & select.POLLERR:
                                self._refused(now, certain=False)
                        elif fd == self._wake_r:
                            woken = True
                        else:
                            on_readable = readers.get(fd)
                            if on_readable is not None:
                                on_readable()
                    if woken:  # drain the wake pipe only when poll says it holds a byte (an empty read raises)
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                else:
                    self._sleeping = False
                    if readers:  # a busy loop still takes requests as they come
                        for fd, _ in reader_poll(0):
                            on_readable = readers.get(fd)
                            if on_readable is not None:
                                on_readable()
        except BaseException as e:  # noqa: BLE001 - surface the failure on every waiting handle
            self.error = e
            for h in list(self._handles):
                h.set_error(EngineError(f"the engine loop failed: {e!r}"))
            raise
        finally:
            self._pumps = []  # callers queue again (and find the loop stopped)
            lock.release()

    def _refused(self, now: float, certain: bool = True) -> None:
        """The kernel reported an error on the socket: drain its queue (else poll spins on POLLERR)
        and note the switch's port as unreachable when it says so (a refused recv says so itself)."""
        if self.sock.drain_errors() or certain:
            self.watch.refused(now)

    def _check_peers(self, now: float, node_sessions: list[tuple[int, WorkerNodeSession]]) -> None:
        """Fail every pending operation with LuwuPeerDead once the switch or a node it waits on is dead."""
        self.watch.pending(bool(self._handles), now)
        gone = self.sock.peer_gone(now)  # (a ring's switch process exited; sockets: drain_errors)
        if gone:
            self.watch.refused(now, gone)
        dead = self.watch.verdict(now, [(sid, s.node_heard, s.busy()) for sid, s in node_sessions])
        if dead is None:
            return
        self.stats["peer_dead"] = self.stats.get("peer_dead", 0) + 1
        for h in list(self._handles):
            h.set_error(dead)
        self.watch.pending(False, now)  # the next operation gets its own full timeout

    def _dispatch(self, k: int, now: float) -> None:
        rows = self.sock.rx[:k]
        lens = self.sock.rx_len[:k]
        # the headers gathered once into 32-byte rows: the sessions read a dozen fields, and each
        # read of the packet rows themselves (64 KiB apart, a page each) missed cache and TLB per row
        hb = np.ascontiguousarray(rows[:, :HEADER_LEN])
        # the header check first (docs/protocol.md 3.5): a corrupted header is dropped, counted and
        # never read further; the sender's timeout and resend recover it like a lost packet
        ok = _bad_headers(hb, k)
        if ok is not None:
            keep = np.flatnonzero(ok)
            self.stats["dropped.bad_header"] += k - len(keep)
            if not len(keep):
                return
            rows, lens, hb = rows[keep], lens[keep], hb[keep]
            k = len(keep)
        h = hb.view(DATA_HEADER)[:, 0]  # header_view's checks hold: hb is (k, 32) uint8
        # the common batch, one session's packets of one type: every header's first word (ver_type,
        # flags, session) the same but for the flags, checked in a few calls before any grouping
        # (a lone packet, a third of all batches, is one by itself)
        vt, _flags, s_hi, s_lo = hb[0, :4].tolist()
        if k == 1:
            same = True
        else:
            word = hb.view(np.uint32)[:, 0] & _SAME_BATCH
            same = _ALL(word == word[0])
        if same and vt >> 4 == VERSION and _MIN(lens) >= HEADER_LEN:
            s = self.sessions.get((s_hi << 8) | s_lo)
            if s is None or not self._handle(s, vt & 0xF, np.arange(k), rows, lens, h, now):
                self.stats["rx_unexpected"] += k
            return
        # a mixed batch (a PARAM and a HEARTBEAT...): one group per (session, type), in that order
        groups, bad = groups_scalar(hb, lens) if k <= SCALAR_BATCH else groups_reference(h, lens)
        self.stats["rx_bad"] += bad
        for sid, t, idx in groups:
            s = self.sessions.get(sid)
            if s is None or not self._handle(s, t, idx, rows, lens, h, now):
                self.stats["rx_unexpected"] += len(idx)

    def _handle(self, s: Session, t: int, idx: np.ndarray, rows: np.ndarray, lens: np.ndarray, h: np.ndarray,
                now: float) -> bool:
        if t in (MsgType.RESULT, MsgType.AGG, MsgType.GRAD):
            row_lanes = getattr(s, "row_lanes", s.lanes)  # (collective: with check lanes)
            good = lens[idx] == HEADER_LEN + 4 * row_lanes
            if not _ALL(good):  # FIXED16 packets have 2-byte lanes
                good |= (lens[idx] == HEADER_LEN + 2 * row_lanes) & (h["dtype"][idx] == int(Dtype.FIXED16))
            if not _ALL(good):
                self.stats["rx_bad"] += int((~good).sum())
                idx = idx[good]
        if isinstance(s, CollectiveSession):
            if t == MsgType.RESULT:
                s.on_results(idx, rows, h, now)
                return True
            return False
        if isinstance(s, WorkerNodeSession):
            if t == MsgType.PARAM:
                s.on_params(idx, rows, lens, h, now)
                return True
            if t == MsgType.HEARTBEAT:
                # the gathered headers seen as heartbeats (rows[idx] copied whole rows of up to 64 KiB)
                # one tolist() of the records: four field views and their lists cost more than a few packets
                for _vt, flags, _s, worker, _c, _seq, ack, credit, *_r in h.view(HEARTBEAT_HEADER)[idx].tolist():
                    if worker == NODE:
                        s.on_node_heartbeat(ack, credit, now, bool(flags & int(Flag.GAP)))
                return True
            return False
        if t == MsgType.AGG:
            s.on_agg(idx, rows, h, now)
        elif t == MsgType.GRAD:
            fb = (h["flags"][idx] & int(Flag.FALLBACK)) != 0
            s.on_fallback(idx[fb], rows, h, now)
            if not fb.all():
                return False
        elif t == MsgType.HEARTBEAT:
            for _vt, _f, _s, _w, _c, _seq, ack, credit, *_r in h.view(HEARTBEAT_HEADER)[idx].tolist():
                s.on_workers_heartbeat(ack, credit, now)
        elif t == MsgType.PULL:
            s.on_pull(idx, rows, lens, h, now)
        else:
            return False
        return True
