"""The engine's event loop and its hand-over with callers (a mixin of Engine, engine.py).

`_run` is the engine thread: each turn runs the queued commands, drains received batches into
`_dispatch` (dispatch.py), lets every session send what its window allows (`pump`), runs the
timers (retransmission, heartbeats, pull retries, liveness: `_check_peers`), and sleeps in
poll() until a packet, a command, an `add_reader` fd or the earliest deadline. It holds
`_lock` for all of a turn: an API call (engine.py) made while the loop sleeps takes the lock and
runs on the caller's thread (`_submit`, `_run_here`), else it is queued and the loop woken only
if it sleeps (`_wake`).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .collective import CollectiveSession
from .handles import EngineError, Handle
from .node_worker import WorkerNodeSession

if TYPE_CHECKING:
    import collections
    import threading

    from ..net.transport import Transport
    from .config import EngineConfig
    from .dispatch import Session
    from .liveness import PeerWatch


class EngineLoop:
    if TYPE_CHECKING:  # what the mixin uses of Engine (engine.py), declared for the type checker
        config: EngineConfig
        sock: Transport
        _shm: Transport | None
        watch: PeerWatch
        sessions: dict[int, Session]
        _cmds: collections.deque[Callable[[], None]]
        _wake_r: int
        _wake_w: int
        _stop: bool
        _sleeping: bool
        _lock: threading.Lock
        _sleep_until: float
        _pumps: list[Callable[[float], int]]
        _wakers: list[Callable[[], float]]
        _thread: threading.Thread | None
        _handles: set[Handle]
        _readers: dict[int, Callable[[], None]]
        _poller: select.poll
        _reader_poller: select.poll
        stats: dict[str, int]
        error: BaseException | None

        def _dispatch(self, k: int, now: float) -> None: ...

    # -- commands from callers (any thread) -----------------------------------------------------------
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
