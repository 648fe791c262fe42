"""The optimizer node's control channel: how a job is handed to a node (its spec and initial
parameters), and how operators ask for stats, a checkpoint, or the steps a job skipped for a
non-finite gradient (`skipped`, for that job's token too).

Framing (luwu.dataplane.net.framing): a 4-byte big-endian length, a JSON header, then the
binary blobs the header lists in `blobs` (sizes in bytes). Addresses are `unix:/path` or `host:port`. One request, one reply.
The server is control_server.py's `ControlServer`; this module holds the protocol's pieces
(`ControlAuth`, `ControlClient`, array packing).

Authentication and bounds (a server with a `ControlAuth`; `luwu node` always has one; the
numbers are `ControlLimits`, flags `luwu node --control-*`): a connection's first message must be
`{"op": "hello", "job_id": J, "token": T}` within `hello_timeout` seconds, at most `HELLO_MAX`
bytes and without blobs; the token is the job's own (the controller's per-job token, checked by
asking the controller) or the node's control token (every job). A job token reaches only its
own job (add_job of another job id is refused). One event-loop thread accepts and reads hellos:
at most `max_unauthenticated` connections (`..._per_peer` from one source address) wait for
theirs, and one more evicts the oldest of the peer holding the most, so silent connections
never lock a token holder out. Past the hello a connection has a thread of its own: at most
`max_authenticated` (`..._per_peer`) at once, more are refused with an error naming the limit,
and one that sends nothing for `idle_timeout` seconds is closed. Every size a message claims
(header, each blob, their sum) is checked against `max_message` before anything is read, the
claims being received on all connections together never exceed it, and a blob's memory is
taken as its bytes arrive (framing.recv_exact), so a client that claims much and sends little
pins little, and only until its idle timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import json
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

    def known(self, job_id: object, token: object) -> Grant | None:
        """The grant of the node's token or of a job token already confirmed; None otherwise
        (without asking anyone: the node's event loop calls it)."""
        if not isinstance(token, str) or not token or not isinstance(job_id, str):
            return None
        if self._token and hmac.compare_digest(token.encode(), self._token.encode()):
            return Grant(None)
        with self._lock:
            if (job_id, _token_key(token)) in self._known:
                return Grant(job_id)
        return None

    def can_verify(self, job_id: object, token: object) -> bool:
        """Whether `grant` would ask `verify` about this pair (a job id, a token, a verifier)."""
        return self._verify is not None and isinstance(job_id, str) and bool(job_id) and isinstance(token, str) \
            and bool(token)

    def grant(self, job_id: str, token: str) -> Grant | None:
        """What `token` may do (None: nothing); may ask `verify` (and wait for it)."""
        known = self.known(job_id, token)
        if known is not None or self._verify is None or not self.can_verify(job_id, token):
            return known
        if not self._verify(job_id, token):
            return None
        with self._lock:
            self._known.add((job_id, _token_key(token)))
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

    def add_job_streamed(self, session: int, contributors: int, job: dict,
                         layers: Sequence[tuple[int, dict[str, tuple[int, ...]]]],
                         produce: Callable[[int], dict[str, np.ndarray]]) -> dict:
        """`add_job` whose initial values are made while the message is sent, one layer at a time:
        `layers` lists (layer, {name: shape}) in sending order, `produce(layer)` returns that
        layer's {name: array}. The sender holds one layer's values at a time (the node receives the
        message as `add_job`'s). If `produce` raises, the connection is closed (the node drops the
        partial message and adds nothing) and the error propagates."""
        desc = [{"layer": int(layer), "name": name, "shape": [int(d) for d in shape]}
                for layer, shapes in layers for name, shape in shapes.items()]
        sizes = [4 * int(np.prod(shape, dtype=np.int64)) for _, shapes in layers for shape in shapes.values()]
        header = {"op": "add_job", "session": session, "contributors": contributors, "job": job, "initial": desc,
                  "blobs": sizes}
        with self._lock:
            data = json.dumps(header).encode()
            try:
                self.sock.sendall(framing.LENGTH.pack(len(data)) + data)
                for layer, shapes in layers:
                    values = produce(layer)
                    for name, shape in shapes.items():
                        a = np.ascontiguousarray(np.asarray(values[name], dtype=np.float32))
                        if a.size != int(np.prod(shape, dtype=np.int64)):
                            raise ControlError(f"layer {layer} {name!r}: {a.size} values for shape {list(shape)}")
                        self.sock.sendall(a.data.cast("B"))
                    del values
                reply, _ = recv_msg(self.sock)
            except BaseException:
                self.sock.close()  # a partial message: the node drops it
                raise
        if not reply.get("ok"):
            raise ControlError(reply.get("error", "the node refused the request"))
        return reply

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
