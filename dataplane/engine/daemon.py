"""`luwu engine`: the SmartNIC engine as its own process beside a worker.

It lives in the data plane, not with the application's daemons in luwu/daemons/, because the data
plane starts it: `EngineClient.launch` (client.py) runs it as
`children.python_module("luwu.dataplane.engine.daemon")`, a name tests/test_layering.py reads.

The worker talks to it over a Unix socket (frames of dataplane/net/framing.py: a length and a
JSON header) and shares its buffers through /dev/shm (`shm.py`), so packet work never competes
with training for the GIL. Requests:
`allreduce` (in place), `push`, `pull` (into the buffer), `stats`, `close`. Every request
carries an `id`; the reply `{"id", "ok", ...}` comes when the operation completes.

One daemon can host several engines: a connection whose first request is `{"op": "open", "plan":
EndpointPlan}` gets an engine of its own, closed with the connection (`close` on it closes only
that engine). Connections that open none use the `--plan` engine, and their `close` stops the
daemon. Once a connection has an engine, that engine's own loop reads its requests
(`Engine.add_reader`): a request costs no thread switch; the connection's thread waits for the end. Started without `--plan`, the daemon waits for `open`s: a worker starts it before it
knows its plan (the plan and the process start overlap) and each of its process groups opens an
engine in it instead of starting a process (worker/engine_link.py, for the torch backend and ModelInNetwork).
Its compiled kernels load in the background (dataplane/kernels `load_in_background`) once its
first operation has completed (the torch backend's start barrier) or `KERNELS_DEFER` s have passed;
float sums run the numpy reference, the same bits, until they are in.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from typing import Any

import numpy as np

from luwu.dataplane.engine.engine import Engine, EngineConfig
from luwu.dataplane.engine.handles import CollectiveMismatch, CorruptResult, Handle
from luwu.dataplane.engine.shm import ShmCache
from luwu.dataplane.kernels import load_in_background
from luwu.dataplane.net.framing import FrameError, FrameReader, send_json_text, send_msg
from luwu.dataplane.process.heap import freeze_collector, refreeze, retain_freed_memory
from luwu.dataplane.process.usage import positive_int
from luwu.dataplane.quantize import warm_up
from luwu.dataplane.session import EndpointPlan

MAX_REQUEST = 16 << 20  # bytes of one request (a plan is the largest)
ENGINE_CHECK = 1.0  # s between a connection thread's looks at whether its engine's loop still runs
KERNELS_DEFER = 5.0  # s an engine process waits for its first completed operation before loading its kernels
DTYPES = {"float32": np.float32, "int32": np.int32, "float16": np.float16, "bfloat16": np.uint16}


class EngineServer:
    def __init__(self, engine: Engine | None, control_path: str, config: EngineConfig | None = None,
                 served: threading.Event | None = None):
        self.served = served or threading.Event()  # set when an operation has completed (run() defers kernels)
        self.engine = engine  # the --plan engine, for connections that open none
        self.config = config  # of the engines connections open
        self.path = control_path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(control_path):
            os.unlink(control_path)
        self.listener.bind(control_path)
        self.listener.listen(8)
        self.stopped = threading.Event()
        self._orphans: set[ShmCache] = set()  # the buffer maps of connections whose worker has not said `close`

    def serve_forever(self) -> None:
        threads = []
        self.listener.settimeout(0.2)
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            t = threading.Thread(target=self._client, args=(conn,), daemon=True)
            t.start()
            threads.append(t)
        self.listener.close()

    def stop(self) -> None:
        self.stopped.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept() now, not at its next timeout
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _client(self, conn: socket.socket) -> None:
        shm = ShmCache()
        lock = threading.Lock()

        def reply(msg: dict) -> None:
            with lock:
                try:
                    send_msg(conn, msg)
                except OSError:
                    pass

        def reply_text(text: str) -> None:
            with lock:
                try:
                    send_json_text(conn, text)
                except OSError:
                    pass

        state: dict[str, Any] = {"engine": self.engine, "own": None, "closed": False}
        reader = FrameReader(conn)
        self._orphans.add(shm)

        def serve(req: dict) -> bool:
            """One request; False once the connection is to end (`close`)."""
            engine, own = state["engine"], state["own"]
            try:
                if req.get("op") == "close":
                    state["closed"] = True  # the worker unlinks its buffers itself
                    self._orphans.discard(shm)
                    reply({"id": req.get("id"), "ok": True})
                    if own is None:
                        self.stop()
                    return False
                if req.get("op") == "open":
                    if own is not None:
                        raise ValueError("this connection already has an engine (one per connection)")
                    own = engine = Engine(EndpointPlan.from_json(json.dumps(req["plan"])), self.config).start()
                    state["engine"] = state["own"] = own
                    host, port = engine.address
                    reply({"id": req.get("id"), "ok": True, "udp": f"{host}:{port}"})
                    return True
                if engine is None:
                    raise ValueError("no engine on this connection: send {'op': 'open', 'plan': ...} first")
                self._request(engine, req, shm, reply, reply_text)
            except Exception as e:  # a bad request fails alone
                reply({"id": req.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"})
            return True

        def refuse(e: FrameError) -> None:  # the stream cannot be followed past a bad frame: close it
            reply({"id": None, "ok": False, "error": f"a request that is not a luwu frame: {e}"})

        try:
            with conn:
                # this thread reads the requests until the connection has an engine; then the
                # engine's own loop does (Engine.add_reader): no thread switch per request
                while state["engine"] is None or reader.has_buffered():
                    try:
                        req, _ = reader.recv_msg(max_message=MAX_REQUEST)
                    except FrameError as e:
                        refuse(e)
                        return
                    except OSError:  # the client closed or died
                        return
                    if not serve(req):
                        return
                if self._served_by_engine(conn, reader, state["engine"], serve, refuse):
                    return
                while True:  # the engine stopped (closed, or its loop failed): its requests get its error here
                    try:
                        req, _ = reader.recv_msg(max_message=MAX_REQUEST)
                    except FrameError as e:
                        refuse(e)
                        return
                    except OSError:
                        return
                    if not serve(req):
                        return
        finally:
            if state["own"] is not None:
                state["own"].close()
            if not state["closed"]:  # the worker died (SIGKILL, a crash): its buffers are nobody's now
                shm.unlink_all()
            self._orphans.discard(shm)
            shm.close()

    def remove_orphans(self) -> None:
        """At exit (SIGTERM: the worker died and the daemon goes with it, maybe before a connection's
        thread saw the end): remove the buffers of every worker that never said `close`."""
        for shm in list(self._orphans):
            shm.unlink_all()

    def _served_by_engine(self, conn: socket.socket, reader: FrameReader, engine: Engine, serve, refuse) -> bool:
        """Hand the connection's reading to `engine`'s loop; returns True once the connection ended
        there, False if the engine stopped first (the caller reads on in this thread)."""
        ended = threading.Event()
        fd = conn.fileno()

        def end() -> None:
            engine.remove_reader(fd)
            ended.set()

        def on_readable() -> None:  # on the engine thread: poll said readable, so recv does not block
            try:
                data = conn.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # the client closed or died
                end()
                return
            reader.feed(data)
            while True:
                try:
                    msg = reader.next_msg(max_message=MAX_REQUEST)
                except FrameError as e:
                    refuse(e)
                    end()
                    return
                if msg is None:
                    return
                if not serve(msg[0]):
                    end()
                    return

        engine.add_reader(fd, on_readable)
        while not ended.wait(ENGINE_CHECK):
            if engine.error is not None or engine.stopped:
                return False  # its loop is gone: nothing reads the connection there any more
        return True

    def _request(self, engine: Engine, req: dict, shm: ShmCache, reply, reply_text) -> None:
        rid, op = req.get("id"), req.get("op")
        if op == "stats":
            reply({"id": rid, "ok": True, "stats": engine.session_stats()})
            return
        if op == "forget":
            shm.forget(req["buf"])
            reply({"id": rid, "ok": True})
            return
        dtype = np.dtype(DTYPES[req.get("dtype", "float32")])
        numel = int(req["numel"])
        buf = shm.get(req["buf"], int(req.get("offset", 0)) + numel * dtype.itemsize)
        view = buf.view(dtype, numel, int(req.get("offset", 0)))

        def done(h: Handle) -> None:
            self.served.set()
            if h.error is not None:
                err = h.error
                mismatch = {"lo": err.lo, "hi": err.hi, "mine": err.mine} if isinstance(err, CollectiveMismatch) else None
                msg = {"id": rid, "ok": False, "error": str(err), "mismatch": mismatch}
                if isinstance(err, CorruptResult) and err.chunks is not None:  # the shared buffer holds the rest
                    msg["corrupt"] = {"chunks": err.chunks, "per": err.per}
                reply(msg)
                return
            # the common reply, formatted directly (a client's ids are ints; anything else as JSON)
            reply_text(f'{{"id": {rid if type(rid) is int else json.dumps(rid)}, "ok": true, '
                       f'"saturated": {"true" if h.saturated else "false"}}}')

        if op == "allreduce":
            # in place: the result is decoded straight into the worker's buffer (the worker keeps
            # its own input for an exact recomputation of saturated elements)
            check = req.get("check")  # the collective's fingerprint fields (Engine.allreduce)
            h = engine.allreduce(view, req.get("reduce", "sum"), req.get("session"), out=view,
                                 check=None if check is None else np.asarray(check, dtype=np.int32),
                                 grad_format=req.get("grad_format"))
        elif op == "push":
            h = engine.push(int(req["session"]), int(req["tensor"]), view, grad_format=req.get("grad_format"))
        elif op == "pull":
            h = engine.pull(int(req["session"]), int(req["tensor"]), int(req["version"]), out=view)
        else:
            raise ValueError(f"unknown request {op!r}: open, allreduce, push, pull, stats, forget or close")
        h.add_done_callback(done)


def add_arguments(p) -> None:
    p.add_argument("--plan", help="endpoint plan JSON file (luwu.dataplane.session.EndpointPlan); without it the "
                                  "daemon hosts the engines its connections open")
    p.add_argument("--control", required=True, help="Unix socket path the worker connects to")
    p.add_argument("--batch", type=positive_int, default=EngineConfig.batch, help="datagrams per system call")


def run(args) -> int:
    retain_freed_memory()  # the engine's batch temporaries stay mapped (dataplane/process/heap.py)
    # compiled kernels (numba: ~0.4 s of CPU) load at low priority, and float sums run the numpy
    # reference (same bits) until they are in: init_process_group never waits for them. The loading
    # starts after the first completed operation (the start barrier): its thread holds the GIL for
    # most of numba's import and, descheduled on a busy host, would stall this process's start-up
    served = threading.Event()

    def load() -> None:
        served.wait(KERNELS_DEFER)
        warm_up()
        refreeze()  # numba's objects are long-lived too (dataplane/process/heap.py)

    load_in_background(load, "luwu-kernels-load")
    config = EngineConfig(batch=args.batch)
    engine = None
    if args.plan:
        plan = EndpointPlan.from_file(args.plan)
        engine = Engine(plan, config).start()
    server = EngineServer(engine, args.control, config, served)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    ready = {"ready": True, "control": args.control}
    if engine is not None:
        host, port = engine.address
        ready.update(rank=plan.wiring.rank, udp=f"{host}:{port}")
    # start-up objects leave the garbage collector's traversals: the engine's garbage is young, and
    # full collections over numpy's and the engine's long-lived objects were ~2% of its CPU (perf)
    freeze_collector()
    print(json.dumps(ready), flush=True)
    try:
        server.serve_forever()
    finally:
        server.remove_orphans()
        if engine is not None:
            engine.close()
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="luwu engine")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
