"""The optimizer node's control channel: how a job is handed to a node (its spec and initial
parameters), and how operators ask for stats, a checkpoint, or the steps a job skipped for a
non-finite gradient (`skipped`, for that job's token too).

Framing (luwu.dataplane.net.framing): a 4-byte big-endian length, a JSON header, then the
binary blobs the header lists in `blobs` (sizes in bytes). Addresses are `unix:/path` or `host:port`. One request, one reply.

Authentication and bounds (a server with a `ControlAuth`; `luwu node` always has one): a
connection's first message must be `{"op": "hello", "job_id": J, "token": T}` within
`handshake_timeout` seconds, at most `HELLO_MAX` bytes and without blobs; the token is the job's
own (the controller's per-job token, checked by asking the controller) or the node's control
token (every job). A job token reaches only its own job (add_job of another job id is refused).
At most `max_unauthenticated` connections may be between accept and a good hello; more are
closed at once. Every size a message claims (header, each blob, their sum) is checked against
`max_message` before anything is allocated, and blobs being received on all connections
together never exceed `max_message` bytes, so idle clients claiming large blobs pin nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..net import framing
from ..net.framing import FrameError, FrameTooLarge, send_msg

HELLO_MAX = 64 << 10  # bytes of the whole first message of a connection (before it is authenticated)
DEFAULT_MAX_MESSAGE = 1 << 30  # bytes one authenticated message may carry (`luwu node`: its --ram-budget)
DEFAULT_MAX_UNAUTHENTICATED = 8  # connections at once between accept and a good hello
DEFAULT_HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has to say hello


class ControlError(RuntimeError):
    """The node refused a request (the message says why) or could not be reached."""


def parse_address(addr: str) -> tuple[socket.AddressFamily, str | tuple[str, int]]:
    if addr.startswith("unix:"):
        return socket.AF_UNIX, addr[5:]
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"control address {addr!r}: use unix:/path or host:port")
    return socket.AF_INET, (host, int(port))


class MessageTooLarge(ControlError):
    """A message claims more bytes than the receiver accepts (nothing was allocated for it)."""


def recv_msg(sock: socket.socket, max_message: int | None = None,
             reserve: Callable[[int], Callable[[], None]] | None = None) -> tuple[dict, list[bytes]]:
    """One control message (luwu.dataplane.net.framing), its faults as ControlError."""
    try:
        return framing.recv_msg(sock, max_message, reserve)
    except FrameTooLarge as e:
        raise MessageTooLarge(f"{e}; a control message larger than this node accepts is refused "
                              f"(`luwu node --control-max-message`)") from None
    except FrameError as e:
        raise ControlError(f"control message: {e}") from None


def _token_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Grant:
    """What an authenticated connection may do: one job (`job_id`), or every job (None)."""

    job_id: str | None


class ControlAuth:
    """Who may use a node's control channel.

    Args:
        token: the node's own control token; whoever presents it may do everything.
        verify: `verify(job_id, token) -> bool`: is `token` the token of job `job_id` (the node
            daemon asks the controller); a successful answer is remembered. It raises
            ConnectionError (naming what it asked) when it cannot tell: the client is told why.

    Example:
        >>> auth = ControlAuth(token=secrets.token_urlsafe(32))
    """

    def __init__(self, token: str = "", verify: Callable[[str, str], bool] | None = None):
        if not token and verify is None:
            raise ValueError("a control channel needs a token or a way to verify job tokens")
        self._token = token
        self._verify = verify
        self._known: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def grant(self, job_id: str, token: str) -> Grant | None:
        if not isinstance(token, str) or not token or not isinstance(job_id, str):
            return None
        if self._token and hmac.compare_digest(token.encode(), self._token.encode()):
            return Grant(None)
        if self._verify is None or not job_id:
            return None
        key = (job_id, _token_key(token))
        with self._lock:
            if key in self._known:
                return Grant(job_id)
        if not self._verify(job_id, token):
            return None
        with self._lock:
            self._known.add(key)
        return Grant(job_id)


def pack_arrays(arrays: dict[int, dict[str, np.ndarray]]) -> tuple[list[dict], list]:
    """{layer: {name: array}} -> (descriptions, blobs) for send_msg."""
    desc, blobs = [], []
    for layer, named in arrays.items():
        for name, a in named.items():
            a = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
            desc.append({"layer": int(layer), "name": name, "shape": list(a.shape)})
            blobs.append(a)
    return desc, blobs


def unpack_arrays(desc: list[dict], blobs: list[bytes]) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    if len(desc) != len(blobs):
        raise ControlError(f"{len(desc)} arrays described but {len(blobs)} sent")
    for d, b in zip(desc, blobs):
        a = np.frombuffer(b, dtype=np.float32)
        if a.size != int(np.prod(d["shape"], dtype=np.int64)):
            raise ControlError(f"layer {d['layer']} {d['name']!r}: {a.size} values for shape {d['shape']}")
        out.setdefault(int(d["layer"]), {})[d["name"]] = a.reshape(d["shape"])
    return out


class ControlServer:
    """Serves requests with `handler(header, blobs, grant) -> dict` on a thread per connection.

    Args:
        address: `unix:/path` or `host:port` (port 0: any).
        handler: answers one request; `grant` is the connection's Grant (None without `auth`).
        auth: who may connect (see the module doc); None: no handshake (in-process tests only).
        max_message: bytes one message may claim, and all connections' blobs in flight together.
        max_unauthenticated: connections at once that have not said a good hello yet.
        handshake_timeout: seconds a new connection has to say hello.
    """

    def __init__(self, address: str, handler: Callable[[dict, list[bytes], Grant | None], dict],
                 auth: ControlAuth | None = None, max_message: int = DEFAULT_MAX_MESSAGE,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT):
        self.auth = auth
        self.max_message = int(max_message)
        self.handshake_timeout = float(handshake_timeout)
        self._unauthenticated = threading.BoundedSemaphore(max_unauthenticated)
        self._in_flight = 0
        self._budget = threading.Lock()
        self.refused = {"busy": 0, "handshake": 0, "too_large": 0}  # connections closed, by reason
        family, target = parse_address(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if isinstance(target, str):  # AF_UNIX: a path
            if os.path.exists(target):
                os.unlink(target)
        else:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(target)
        self.sock.listen(16)
        self.sock.settimeout(0.2)  # here, not in the thread: a server closed before its thread runs has no socket
        self.address = f"unix:{target}" if family == socket.AF_UNIX else "{}:{}".format(*self.sock.getsockname()[:2])
        self.handler = handler
        self._stop = False
        self._thread = threading.Thread(target=self._accept, name="luwu-node-control", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.auth is not None and not self._unauthenticated.acquire(blocking=False):
                self.refused["busy"] += 1
                _refuse(conn, "too many unauthenticated control connections: say hello or go away")
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _reserve(self, total: int) -> Callable[[], None]:
        with self._budget:
            if self._in_flight + total > self.max_message:
                raise MessageTooLarge(f"the node is receiving {self._in_flight} bytes on other control connections; "
                                      f"{total} more would exceed {self.max_message}: retry later")
            self._in_flight += total

        def release() -> None:
            with self._budget:
                self._in_flight -= total
        return release

    def _handshake(self, conn: socket.socket, auth: ControlAuth) -> Grant | None:
        """The connection's grant, or None (refused and answered); the slot is released either way."""
        try:
            conn.settimeout(self.handshake_timeout)
            try:
                header, _ = recv_msg(conn, HELLO_MAX)
            except (ConnectionError, OSError, ValueError, ControlError) as e:  # timeouts, garbage, oversized claims
                self.refused["too_large" if isinstance(e, MessageTooLarge) else "handshake"] += 1
                _refuse(conn, f"control handshake failed: {e}" if isinstance(e, ControlError) else None)
                return None
            grant = None
            if header.get("op") == "hello" and not header.get("blobs"):
                try:
                    grant = auth.grant(header.get("job_id", ""), header.get("token", ""))
                except ConnectionError as e:  # who checks job tokens (the controller) does not answer: say so
                    self.refused["handshake"] += 1
                    _refuse(conn, f"cannot check the job's token: {e}")
                    return None
            if grant is None:
                self.refused["handshake"] += 1
                _refuse(conn, "the first control message must be {\"op\": \"hello\", \"job_id\": ..., \"token\": ...} "
                              "with the job's token (or the node's control token)")
                return None
            conn.settimeout(None)
            try:
                send_msg(conn, {"ok": True, "job_id": grant.job_id})
            except OSError:
                return None
            return grant
        finally:
            self._unauthenticated.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            grant = None
            if self.auth is not None:
                grant = self._handshake(conn, self.auth)
                if grant is None:
                    return
            while not self._stop:
                try:
                    header, blobs = recv_msg(conn, self.max_message, self._reserve)
                except MessageTooLarge as e:
                    self.refused["too_large"] += 1
                    _refuse(conn, str(e))  # the rest of the claimed message is never read: the connection goes
                    return
                except (ConnectionError, OSError, ValueError, ControlError):
                    return
                if header.get("op") == "hello":  # a client with a token, on a server without auth (or a repeat)
                    reply = {"ok": True, "job_id": grant.job_id if grant else None}
                    try:
                        send_msg(conn, reply)
                        continue
                    except OSError:
                        return
                try:
                    reply = {"ok": True, **(self.handler(header, blobs, grant) or {})}
                except Exception as e:  # a bad request fails alone; the node goes on
                    reply = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                try:
                    send_msg(conn, reply)
                except OSError:
                    return

    def stop(self) -> None:
        self._stop = True
        self.sock.close()
        if self.address.startswith("unix:"):
            try:
                os.unlink(self.address[5:])
            except FileNotFoundError:
                pass


def _refuse(conn: socket.socket, error: str | None) -> None:
    """Best-effort error reply, then close (the peer may be gone or never read)."""
    try:
        if error:
            conn.settimeout(1.0)
            send_msg(conn, {"ok": False, "error": error})
    except OSError:
        pass
    finally:
        conn.close()


class ControlClient:
    """A connection to a node's control channel.

    Args:
        address: `unix:/path` or `host:port`.
        timeout: seconds per socket operation.
        token: the job's token (or the node's control token); sent in the hello.
        job_id: the job the token belongs to.

    Example:
        >>> ControlClient("unix:/tmp/node.sock", token=job_token, job_id="demo-1").stats()
    """

    def __init__(self, address: str, timeout: float = 60.0, token: str = "", job_id: str = ""):
        family, target = parse_address(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(target)
        except OSError as e:
            raise ControlError(f"cannot reach the optimizer node's control channel at {address}: {e}; "
                               "is `luwu node` running with --control at that address?") from e
        self._lock = threading.Lock()
        if token:
            try:
                self.call({"op": "hello", "job_id": job_id, "token": token})
            except (ConnectionError, OSError) as e:
                self.sock.close()
                raise ControlError(f"the optimizer node at {address} closed the control connection during the "
                                   f"hello: {e}") from e
            except ControlError:
                self.sock.close()
                raise

    def call(self, header: dict, blobs: Sequence[Any] = ()) -> dict:
        with self._lock:
            send_msg(self.sock, header, blobs)
            reply, _ = recv_msg(self.sock)
        if not reply.get("ok"):
            raise ControlError(reply.get("error", "the node refused the request"))
        return reply

    def add_job(self, session: int, contributors: int, job: dict, initial: dict | int = 0) -> dict:
        """Hand a job to the node: `job` is JobSpec.to_json() form; `initial` {layer: {name: array}} or a seed."""
        if isinstance(initial, dict):
            desc, blobs = pack_arrays(initial)
            return self.call({"op": "add_job", "session": session, "contributors": contributors, "job": job,
                              "initial": desc}, blobs)
        return self.call({"op": "add_job", "session": session, "contributors": contributors, "job": job,
                          "seed": int(initial)})

    def stats(self) -> dict:
        return self.call({"op": "stats"})["stats"]

    def checkpoint(self) -> str:
        return self.call({"op": "checkpoint"})["path"]

    def skipped_steps(self, job_id: str) -> dict[int, list[int]]:
        """The job's steps this node skipped for a non-finite gradient: {step: layer ids}."""
        got = self.call({"op": "skipped", "job_id": job_id})["skipped"]
        return {int(s): [int(x) for x in ids] for s, ids in got.items()}

    def close(self) -> None:
        self.sock.close()
