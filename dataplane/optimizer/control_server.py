"""The optimizer node's control channel server (the protocol, its authentication and its
bounds: control.py's module doc; the limits: `ControlLimits`, docs/optimizer.md "Control channel").

One event-loop thread (a selector) accepts connections and reads their hellos, so silent or slow
anonymous connections cost no thread and are evicted oldest first when they are too many; each
authenticated connection then has a thread of its own, within `max_authenticated`.
"""

from __future__ import annotations

import json
import os
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..net import framing
from ..net.framing import FrameError, FrameTooLarge, send_msg
from .control import DEFAULT_MAX_MESSAGE, HELLO_MAX, ControlAuth, ControlError, Grant, MessageTooLarge, parse_address

# ControlLimits' defaults (`luwu node --control-*`; docs/optimizer.md "Control channel")
DEFAULT_MAX_UNAUTHENTICATED = 64  # connections at once between accept and a good hello (then: evict the oldest)
DEFAULT_MAX_UNAUTHENTICATED_PER_PEER = 16  # the same, per source address
DEFAULT_HELLO_TIMEOUT = 10.0  # seconds a new connection has to say hello
DEFAULT_MAX_AUTHENTICATED = 64  # connections at once past the hello (a thread each; then: refused)
DEFAULT_MAX_AUTHENTICATED_PER_PEER = 32  # the same, per source address
DEFAULT_IDLE_TIMEOUT = 300.0  # seconds an authenticated connection may send nothing
VERIFY_THREADS = 2  # threads that ask the controller about job tokens the node does not know yet
ACCEPT_BATCH = 128  # connections accepted per event-loop turn


@dataclass(frozen=True)
class ControlLimits:
    """What a node's control channel admits (`luwu node --control-*` flags; docs/optimizer.md).

    Args:
        max_message: bytes one message may claim, and the blobs in flight on all connections
            together (claims are checked before anything is read; memory follows the bytes).
        max_unauthenticated: connections at once between accept and a good hello; one more
            evicts the oldest of the peer holding the most (never refuses the newcomer).
        max_unauthenticated_per_peer: the same, per source address (unix sockets: one peer).
        hello_timeout: seconds a new connection has to say hello.
        max_authenticated: connections at once past the hello (one thread each); one more is
            refused with an error naming the limit.
        max_authenticated_per_peer: the same, per source address.
        idle_timeout: seconds an authenticated connection may send nothing (between messages
            or inside one) before it is closed and its claims released.

    Example:
        >>> ControlLimits(max_authenticated=16, idle_timeout=60.0)  # doctest: +SKIP
    """

    max_message: int = DEFAULT_MAX_MESSAGE
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED
    max_unauthenticated_per_peer: int = DEFAULT_MAX_UNAUTHENTICATED_PER_PEER
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT
    max_authenticated: int = DEFAULT_MAX_AUTHENTICATED
    max_authenticated_per_peer: int = DEFAULT_MAX_AUTHENTICATED_PER_PEER
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"control channel limit {name} must be positive, not {value!r}")


class _Pending:
    """A connection between accept and a good hello (the event loop's; `dead` once it let go)."""

    __slots__ = ("conn", "dead", "deadline", "heard", "peer", "reader", "verifying")

    def __init__(self, conn: socket.socket, peer: str, deadline: float):
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self.reader = framing.FrameReader(conn, chunk=HELLO_MAX)
        self.dead = False
        self.heard = False  # a byte of its hello has arrived (evicted after the silent ones)
        self.verifying = False  # its job token is being checked (VERIFY_THREADS)


class ControlServer:
    """Serves requests with `handler(header, blobs, grant) -> dict`.

    One event-loop thread accepts connections and reads their hellos (`ControlLimits` bounds
    them; the oldest is evicted when they are too many, so anonymous connections never lock a
    token holder out); each authenticated connection then has a thread of its own (at most
    `max_authenticated`), and job tokens the cache does not know are checked on
    `VERIFY_THREADS` threads. `refused` counts closed connections by reason.

    Args:
        address: `unix:/path` or `host:port` (port 0: any).
        handler: answers one request; `grant` is the connection's Grant (None without `auth`).
        auth: who may connect (see the module doc); None: no hello (in-process tests only).
        limits: the channel's bounds (ControlLimits()).

    Example:
        >>> srv = ControlServer("unix:/tmp/n.sock", handle, ControlAuth(token=t)).start()  # doctest: +SKIP
    """

    def __init__(self, address: str, handler: Callable[[dict, list[bytes], Grant | None], dict],
                 auth: ControlAuth | None = None, limits: ControlLimits | None = None):
        self.auth = auth
        self.limits = limits or ControlLimits()
        self.max_message = self.limits.max_message
        self._in_flight = 0  # blob bytes claimed by messages being received
        self._lock = threading.Lock()  # _in_flight, _served, refused
        self.refused = {"busy": 0, "evicted": 0, "handshake": 0, "too_large": 0, "idle": 0}
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first (the event loop's alone)
        self._served: dict[socket.socket, str] = {}  # authenticated connection -> peer
        self._verified: queue.SimpleQueue[tuple[_Pending, Grant | None, str]] = queue.SimpleQueue()
        self._verifier: ThreadPoolExecutor | None = None
        family, target = parse_address(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if isinstance(target, str):  # AF_UNIX: a path
            if os.path.exists(target):
                os.unlink(target)
        else:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(target)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.address = f"unix:{target}" if family == socket.AF_UNIX else "{}:{}".format(*self.sock.getsockname()[:2])
        self.handler = handler
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name="luwu-node-control", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    @property
    def connections(self) -> dict[str, int]:
        """Connections open now: {"unauthenticated": n, "authenticated": m}."""
        with self._lock:
            return {"unauthenticated": len(self._pending), "authenticated": len(self._served)}

    # -- the event loop: accept, hello, eviction, deadlines ------------------------------------
    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop:
                wait = 0.5
                if self._pending:
                    wait = min(wait, max(0.0, next(iter(self._pending.values())).deadline - time.monotonic()))
                accept = False
                for key, _ in sel.select(wait):
                    if key.fileobj is self.sock:
                        accept = True
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    elif key.fileobj in self._pending:  # hellos before newcomers: a newcomer may evict
                        self._read_hello(sel, self._pending[key.fileobj])
                self._finish_verified(sel)
                if accept:
                    self._accept(sel)
                self._expire(sel, time.monotonic())
        finally:
            for p in list(self._pending.values()):
                self._drop(sel, p, None)
            sel.close()
            self.sock.close()
            self._wake_r.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake is pending anyway) or closed (stopping)
            pass

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(ACCEPT_BATCH):  # bounded per turn: hellos get read between batches
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: the backlog waits for the next turn
                return
            peer = addr[0] if isinstance(addr, tuple) and addr else "local"
            conn.setblocking(False)
            if self.auth is None:  # no hello: straight to serving
                self._admit(conn, peer, None, b"")
                continue
            self._make_room(sel, peer)
            p = _Pending(conn, peer, time.monotonic() + self.limits.hello_timeout)
            with self._lock:
                self._pending[conn] = p
            sel.register(conn, selectors.EVENT_READ)
            self._read_hello(sel, p)  # a client's hello often arrives with its connection

    def _make_room(self, sel: selectors.BaseSelector, peer: str) -> None:
        """Evict so one more unauthenticated connection from `peer` fits the limits."""
        mine = [p for p in self._pending.values() if p.peer == peer]
        if len(mine) >= self.limits.max_unauthenticated_per_peer:
            candidates = mine
        elif len(self._pending) >= self.limits.max_unauthenticated:
            top = Counter(p.peer for p in self._pending.values()).most_common(1)[0][0]
            candidates = [p for p in self._pending.values() if p.peer == top]
        else:
            return
        victim = next((p for p in candidates if not p.heard), candidates[0])  # the oldest silent one first
        with self._lock:
            self.refused["evicted"] += 1
        self._drop(sel, victim, "evicted: too many unauthenticated control connections; say hello at once "
                                "after connecting")

    def _read_hello(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            data = p.conn.recv(HELLO_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, p, None)
            return
        p.heard = True
        p.reader.feed(data)
        try:
            msg = p.reader.next_msg(HELLO_MAX)
        except FrameError as e:
            with self._lock:
                self.refused["too_large" if isinstance(e, FrameTooLarge) else "handshake"] += 1
            self._drop(sel, p, f"control handshake failed: control message: {e}")
            return
        if msg is None:
            return
        header = msg[0]
        job_id, token = header.get("job_id", ""), header.get("token", "")
        assert self.auth is not None
        grant = self.auth.known(job_id, token) if header.get("op") == "hello" and not header.get("blobs") else None
        if grant is not None:
            self._authenticated(sel, p, grant)
        elif header.get("op") == "hello" and not header.get("blobs") and self.auth.can_verify(job_id, token):
            sel.unregister(p.conn)  # nothing more is read until the token is checked
            p.verifying = True
            if self._verifier is None:
                self._verifier = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="luwu-node-control-verify")
            self._verifier.submit(self._verify, p, job_id, token)
        else:
            self._bad_hello(sel, p)

    def _bad_hello(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        with self._lock:
            self.refused["handshake"] += 1
        self._drop(sel, p, "the first control message must be {\"op\": \"hello\", \"job_id\": ..., \"token\": ...} "
                           "with the job's token (or the node's control token)")

    def _verify(self, p: _Pending, job_id: str, token: str) -> None:
        """On a verifier thread: ask whoever checks job tokens; the event loop takes the answer."""
        if p.dead or self._stop:
            return
        assert self.auth is not None
        try:
            self._verified.put((p, self.auth.grant(job_id, token), ""))
        except ConnectionError as e:  # who checks job tokens (the controller) does not answer: say so
            self._verified.put((p, None, f"cannot check the job's token: {e}"))
        self._wake()

    def _finish_verified(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                p, grant, error = self._verified.get_nowait()
            except queue.Empty:
                return
            if p.dead:  # evicted or past its deadline meanwhile
                continue
            if error:
                with self._lock:
                    self.refused["handshake"] += 1
                self._drop(sel, p, error)
            elif grant is None:
                self._bad_hello(sel, p)
            else:
                self._authenticated(sel, p, grant)

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        while self._pending:
            p = next(iter(self._pending.values()))  # oldest first: deadlines are in order
            if p.deadline > now:
                return
            with self._lock:
                self.refused["handshake"] += 1
            self._drop(sel, p, f"control handshake failed: the job's token could not be checked within "
                               f"{self.limits.hello_timeout:g} s (is the controller slow?)" if p.verifying else
                               f"control handshake failed: no hello within {self.limits.hello_timeout:g} s")

    def _detach(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        """Take a connection out of the hello loop (it is dropped or admitted next)."""
        p.dead = True
        with self._lock:
            self._pending.pop(p.conn, None)
        try:
            sel.unregister(p.conn)
        except (KeyError, ValueError):
            pass

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, error: str | None) -> None:
        """Close a pending connection with a best-effort error (never blocking the loop)."""
        self._detach(sel, p)
        _refuse(p.conn, error, blocking=False)

    def _authenticated(self, sel: selectors.BaseSelector, p: _Pending, grant: Grant) -> None:
        self._detach(sel, p)
        self._admit(p.conn, p.peer, grant, p.reader.take_buffered())

    def _admit(self, conn: socket.socket, peer: str, grant: Grant | None, buffered: bytes) -> None:
        """A connection past its hello gets a thread, within the authenticated limits."""
        lim = self.limits
        with self._lock:
            total, mine = len(self._served), sum(1 for x in self._served.values() if x == peer)
            busy = total >= lim.max_authenticated or mine >= lim.max_authenticated_per_peer
            if busy:
                self.refused["busy"] += 1
            else:
                self._served[conn] = peer
        if busy:
            _refuse(conn, f"too many authenticated control connections ({total} open, {mine} from {peer}; limits "
                          f"{lim.max_authenticated} in all, {lim.max_authenticated_per_peer} per peer): close idle "
                          "ones and retry, or raise `luwu node --control-max-authenticated`", blocking=False)
            return
        try:
            threading.Thread(target=self._serve, args=(conn, grant, buffered), name="luwu-node-control-conn",
                             daemon=True).start()
        except RuntimeError as e:  # "can't start new thread": the process is out of threads; the loop goes on
            with self._lock:
                self._served.pop(conn, None)
                self.refused["busy"] += 1
            _refuse(conn, f"the node cannot start a thread for this connection ({e}): retry later", blocking=False)

    # -- authenticated connections: one thread each --------------------------------------------
    def _reserve(self, total: int) -> Callable[[], None]:
        with self._lock:
            if self._in_flight + total > self.max_message:
                raise MessageTooLarge(f"the node is receiving {self._in_flight} bytes on other control connections; "
                                      f"{total} more would exceed {self.max_message}: retry later")
            self._in_flight += total

        def release() -> None:
            with self._lock:
                self._in_flight -= total
        return release

    def _serve(self, conn: socket.socket, grant: Grant | None, buffered: bytes) -> None:
        pending = bytearray(buffered)  # what the event loop read past the hello (a pipelining client)

        def read(n: int) -> bytes:
            if not pending:
                return framing.recv_exact(conn, n)
            head = bytes(pending[:n])
            del pending[:n]
            return head if len(head) == n else head + framing.recv_exact(conn, n - len(head))

        try:
            conn.setblocking(True)
            conn.settimeout(self.limits.idle_timeout)
            if self.auth is not None:
                send_msg(conn, {"ok": True, "job_id": grant.job_id if grant else None})
            while not self._stop:
                try:
                    header, blobs = _read_control(read, self.max_message, self._reserve)
                except MessageTooLarge as e:
                    with self._lock:
                        self.refused["too_large"] += 1
                    _refuse(conn, str(e))  # the rest of the claimed message is never read: the connection goes
                    return
                except TimeoutError:
                    with self._lock:
                        self.refused["idle"] += 1
                    _refuse(conn, f"closed after {self.limits.idle_timeout:g} s without a byte "
                                  "(`luwu node --control-idle-timeout`)")
                    return
                if header.get("op") == "hello":  # a client with a token, on a server without auth (or a repeat)
                    send_msg(conn, {"ok": True, "job_id": grant.job_id if grant else None})
                    continue
                try:
                    reply = {"ok": True, **(self.handler(header, blobs, grant) or {})}
                except Exception as e:  # a bad request fails alone; the node goes on
                    reply = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                send_msg(conn, reply)
        except (ConnectionError, OSError, ValueError, ControlError):  # the peer went, or sent garbage
            pass
        finally:
            with self._lock:
                self._served.pop(conn, None)
            conn.close()

    def stop(self) -> None:
        """Stop accepting, close every connection (threads end at their next read) and wait
        for the event loop."""
        self._stop = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        elif self._thread.ident is None:  # never started: nothing else closes the sockets
            self.sock.close()
            self._wake_r.close()
        self._wake_w.close()
        with self._lock:
            served = list(self._served)
        for conn in served:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._verifier is not None:
            self._verifier.shutdown(wait=False, cancel_futures=True)
        if self.address.startswith("unix:"):
            try:
                os.unlink(self.address[5:])
            except FileNotFoundError:
                pass


def _read_control(read: Callable[[int], bytes], max_message: int,
                  reserve: Callable[[int], Callable[[], None]]) -> tuple[dict, list[bytes]]:
    try:
        return framing.read_msg(read, max_message, reserve)
    except FrameTooLarge as e:
        raise MessageTooLarge(f"{e}; a control message larger than this node accepts is refused "
                              f"(`luwu node --control-max-message`)") from None
    except FrameError as e:
        raise ControlError(f"control message: {e}") from None


def _refuse(conn: socket.socket, error: str | None, blocking: bool = True) -> None:
    """Best-effort error reply, then close (the peer may be gone or never read); `blocking`
    False for the event loop: a reply that does not fit the socket's buffer at once is dropped."""
    try:
        if error:
            if blocking:
                conn.settimeout(1.0)
                send_msg(conn, {"ok": False, "error": error})
            else:
                data = json.dumps({"ok": False, "error": error, "blobs": []}).encode()
                conn.send(framing.LENGTH.pack(len(data)) + data)
    except OSError:
        pass
    finally:
        conn.close()
