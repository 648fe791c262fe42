"""The optimizer node's control channel: how a job is handed to a node (its spec and initial
parameters), and how operators ask for stats or a checkpoint.

Framing: a 4-byte big-endian length, a JSON header, then the binary blobs the header lists in
`blobs` (sizes in bytes). Addresses are `unix:/path` or `host:port`. One request, one reply.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Callable

import numpy as np

_LEN = struct.Struct("!I")
MAX_HEADER = 16 << 20


class ControlError(RuntimeError):
    """The node refused a request (the message says why) or could not be reached."""


def parse_address(addr: str) -> tuple[int, object]:
    if addr.startswith("unix:"):
        return socket.AF_UNIX, addr[5:]
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"control address {addr!r}: use unix:/path or host:port")
    return socket.AF_INET, (host, int(port))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed the control connection")
        got += k
    return bytes(buf)


def send_msg(sock: socket.socket, header: dict, blobs: list = ()) -> None:
    header = dict(header, blobs=[memoryview(b).nbytes for b in blobs])
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data)
    for b in blobs:
        sock.sendall(memoryview(b).cast("B"))


def recv_msg(sock: socket.socket) -> tuple[dict, list[bytes]]:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise ControlError(f"control header of {n} bytes is larger than {MAX_HEADER}")
    header = json.loads(_recv_exact(sock, n))
    blobs = [_recv_exact(sock, int(size)) for size in header.get("blobs", [])]
    return header, blobs


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
    """Serves requests with `handler(header, blobs) -> dict` on a thread per connection."""

    def __init__(self, address: str, handler: Callable[[dict, list[bytes]], dict]):
        family, target = parse_address(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_UNIX:
            if os.path.exists(target):
                os.unlink(target)
        else:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(target)
        self.sock.listen(16)
        self.address = f"unix:{target}" if family == socket.AF_UNIX else "%s:%d" % self.sock.getsockname()[:2]
        self.handler = handler
        self._stop = False
        self._thread = threading.Thread(target=self._accept, name="luwu-node-control", daemon=True)

    def start(self) -> "ControlServer":
        self._thread.start()
        return self

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._stop:
                try:
                    header, blobs = recv_msg(conn)
                except (ConnectionError, OSError, ValueError):
                    return
                try:
                    reply = {"ok": True, **(self.handler(header, blobs) or {})}
                except Exception as e:  # a bad request fails alone; the node goes on
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
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


class ControlClient:
    def __init__(self, address: str, timeout: float = 60.0):
        family, target = parse_address(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(target)
        except OSError as e:
            raise ControlError(f"cannot reach the optimizer node's control channel at {address}: {e}; "
                               "is `luwu node` running with --control at that address?") from e
        self._lock = threading.Lock()

    def call(self, header: dict, blobs: list = ()) -> dict:
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

    def close(self) -> None:
        self.sock.close()
