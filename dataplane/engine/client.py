"""The worker side of an engine daemon: spawn it, share buffers with it, submit operations.

`EngineClient.spawn(plan)` starts `luwu engine` as a child process and connects; operations
return `Handle`s completed by a reader thread, so the caller's thread never blocks in a
collective call. Requests and replies are frames of dataplane/net/framing.py (a length, then a JSON
header); tensors never cross the socket, they live in shared memory (shm.py).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import tempfile
import threading
import time

import numpy as np

from ..net.framing import FrameError, FrameReader, send_msg
from ..process import children
from ..session import EndpointPlan
from .handles import CollectiveMismatch, CorruptResult, EngineError, Handle
from .shm import ShmBuffer

MAX_REPLY = 16 << 20  # bytes of one reply (stats are the largest)
CONNECT_POLL = 0.005  # s between tries to reach a daemon that is still starting (its socket not yet bound):
# the first collective waits for this connection, and a try costs a failed connect() (microseconds)
_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32", np.dtype(np.float16): "float16",
          np.dtype(np.uint16): "bfloat16"}


class EngineClient:
    def __init__(self, control_path: str, process: subprocess.Popen | None = None, connect_timeout: float = 30.0):
        self.process = process
        self.path = control_path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.sock.connect(control_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if process is not None and process.poll() is not None:
                    raise EngineError(f"the engine daemon exited with code {process.returncode} before listening") from None
                if time.monotonic() > deadline:
                    raise EngineError(f"no engine daemon listening at {control_path} after {connect_timeout} s") from None
                time.sleep(CONNECT_POLL)
        self._ids = itertools.count()
        self._pending: dict[int, Handle] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one frame at a time: callers submit from several threads
        self._reader = threading.Thread(target=self._read, name="luwu-engine-client", daemon=True)
        self._reader.start()
        self._buffers: list[ShmBuffer] = []
        self.log_path: str | None = None

    @classmethod
    def spawn(cls, plan: EndpointPlan | None, workdir: str | None = None, batch: int = 64,
              log_path: str | None = None, connect_timeout: float = 30.0) -> EngineClient:
        """Start `luwu engine` for `plan` as a child process that dies with this one (even by
        SIGKILL), logging to `log_path` (default: engine-<rank>.log in `workdir`), and connect.
        `plan=None` starts an engine host: each connection opens its own engine (`open`)."""
        proc, control, log_path = cls.launch(plan, workdir, batch, log_path)
        return cls.connect(proc, control, log_path, connect_timeout)

    @staticmethod
    def launch(plan: EndpointPlan | None, workdir: str | None = None, batch: int = 64,
               log_path: str | None = None) -> tuple[subprocess.Popen, str, str]:
        """Start the daemon without waiting for it: (process, control socket path, log path)."""
        workdir = workdir or tempfile.mkdtemp(prefix="luwu-engine-")
        name = "h" if plan is None else str(plan.wiring.rank)  # short: a Unix socket path holds 107 bytes
        args = []
        if plan is not None:
            plan_path = os.path.join(workdir, f"plan-{name}.json")
            with open(plan_path, "w") as f:
                f.write(plan.to_json())
            args = ["--plan", plan_path]
        control = os.path.join(workdir, f"engine-{name}.sock")
        log_path = log_path or os.path.join(workdir, f"engine-{name}.log")
        env = dict(os.environ, OMP_NUM_THREADS="1", LUWU_NO_BACKEND="1")
        with open(log_path, "ab") as log:
            argv = children.python_module("luwu.dataplane.engine.daemon", *args, "--control", control,
                                          "--batch", str(batch))
            proc = subprocess.Popen(children.die_with_parent(argv),
                env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        return proc, control, log_path

    @classmethod
    def connect(cls, proc: subprocess.Popen | None, control: str, log_path: str,
                connect_timeout: float = 30.0) -> EngineClient:
        """Connect to a daemon `launch` started (`proc`: kill it if it never listens; None: not ours)."""
        try:
            client = cls(control, proc, connect_timeout)
        except EngineError as e:
            if proc is not None:
                children.stop(proc, grace=0)
            raise EngineError(f"{e}; the engine log {log_path} says:\n{children.tail(log_path)}") from e
        client.log_path = log_path
        return client

    def open(self, plan: EndpointPlan, timeout: float = 30.0) -> str:
        """Open this connection's own engine for `plan` in an engine host; returns its UDP address
        (HOST:PORT). The engine closes with the connection."""
        return self._call({"op": "open", "plan": json.loads(plan.to_json())}, "open").wait(timeout)

    # -- buffers ------------------------------------------------------------------------------------
    def buffer(self, nbytes: int) -> ShmBuffer:
        buf = ShmBuffer.create(nbytes)
        self._buffers.append(buf)
        return buf

    # -- operations -----------------------------------------------------------------------------------
    def _call(self, req: dict, name: str, result=None) -> Handle:
        h = Handle(name)
        rid = next(self._ids)
        req["id"] = rid
        with self._lock:
            self._pending[rid] = h
        h.info["result"] = result
        try:
            with self._send_lock:
                send_msg(self.sock, req)
        except OSError as e:
            with self._lock:
                self._pending.pop(rid, None)
            raise EngineError(f"the engine daemon is gone ({e}); check its log") from e
        return h

    def _req(self, buf: ShmBuffer, view: np.ndarray, **kw) -> dict:
        offset = view.__array_interface__["data"][0] - buf.view(np.uint8, 1).__array_interface__["data"][0]
        return dict(kw, buf=buf.path, offset=int(offset), numel=int(view.size), dtype=_NAMES[view.dtype])

    def allreduce(self, buf: ShmBuffer, view: np.ndarray, op: str = "sum", session: int | None = None,
                  check: np.ndarray | None = None, grad_format: str | None = None) -> Handle:
        """In place on `view`, a view of `buf`; `check`: the fingerprint fields, `grad_format`: a
        float sum's wire format (Engine.allreduce; None: the daemon engine's default)."""
        req = self._req(buf, view, op="allreduce", reduce=op, session=session)
        if check is not None:
            req["check"] = [int(v) for v in check]
        if grad_format is not None:
            req["grad_format"] = grad_format
        return self._call(req, f"allreduce({view.size})", view)

    def push(self, buf: ShmBuffer, view: np.ndarray, session: int, tensor: int,
             grad_format: str | None = None) -> Handle:
        req = self._req(buf, view, op="push", session=session, tensor=tensor)
        if grad_format is not None:
            req["grad_format"] = grad_format
        return self._call(req, f"push({tensor})")

    def pull(self, buf: ShmBuffer, view: np.ndarray, session: int, tensor: int, version: int) -> Handle:
        return self._call(self._req(buf, view, op="pull", session=session, tensor=tensor, version=version),
                          f"pull({tensor} v{version})", view)

    def stats(self, timeout: float = 10.0) -> dict:
        return self._call({"op": "stats"}, "stats").wait(timeout)

    def _read(self) -> None:
        reader = FrameReader(self.sock)
        try:
            while True:
                msg, _ = reader.recv_msg(max_message=MAX_REPLY)
                rid = msg.get("id")
                with self._lock:
                    h = self._pending.pop(rid, None) if isinstance(rid, int) else None
                if h is None:
                    continue
                if not msg.get("ok"):
                    m, bad = msg.get("mismatch"), msg.get("corrupt")
                    h.set_error(CollectiveMismatch(msg.get("error", ""), m["lo"], m["hi"], m["mine"]) if m
                                else CorruptResult(msg.get("error", ""), bad["chunks"], bad["per"]) if bad
                                else EngineError(msg.get("error", "engine error")))
                else:
                    h.saturated = bool(msg.get("saturated"))
                    h.set_result(msg.get("stats", msg.get("udp", h.info.get("result"))))
        except (OSError, FrameError):  # closed, or a reply that is not a frame: nothing more can be read
            pass
        with self._lock:
            pending, self._pending = self._pending, {}
        for h in pending.values():
            h.set_error(EngineError("the engine daemon closed the connection"))

    def close(self, timeout: float = 10.0) -> None:
        try:
            self._call({"op": "close"}, "close").wait(timeout)
        except (EngineError, TimeoutError):
            pass
        self.sock.close()
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                children.stop(self.process, grace=0)
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()
