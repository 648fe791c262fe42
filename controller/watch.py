"""A worker's watch on the controller that planned its job: the controller's death named in seconds.

A running job does not need its controller. The switches hold the job's tables, the optimizer
nodes their plans and state, every engine its endpoint plan: aggregation, pushes and pulls go on
unchanged when the controller dies (docs/protocol.md 7.5). What stops is what only the controller
does: JoinJob (a new rank, a new process group), EndJob, drift repair, health and counters for
`luwu-ctl`. So a dead controller is a warning naming it, not a failed collective, and the calls
that need it fail with `ControllerUnreachable` naming its address.

The watch holds one idle WatchJob stream open (no polling load on the controller). A killed
controller process closes its sockets, so the stream breaks at once; a controller host that
dies silently (or a frozen process) stops answering HTTP/2 keepalive pings, which ends the stream
after `keepalive` + `keepalive_timeout` seconds. Lost, back and ended are reported once each, to
`on_change(state, message)` (default: a `ControllerLostWarning`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable

from luwu.proto import controller_pb2 as pb

from .client import ControllerClient, ControllerRefused, ControllerUnreachable

log = logging.getLogger("luwu.controller")
DEFAULT_KEEPALIVE = 2.0  # s between HTTP/2 pings on the idle stream
DEFAULT_KEEPALIVE_TIMEOUT = 3.0  # s a ping may go unanswered before the controller counts as gone
DEFAULT_RETRY = 1.0  # s between reconnection attempts while the controller is gone
PROBE_TIMEOUT = 5.0  # s for the GetJob that confirms the controller (and the job) before streaming


_WATCHES: weakref.WeakSet[ControllerWatch] = weakref.WeakSet()  # live watches of this process


def lost_controller(address: str) -> ControllerWatch | None:
    """A watch of this process that finds the controller at `address` lost, if any: an operation
    that needs it (JoinJob) can fail at once, naming it, instead of waiting out an RPC timeout."""
    return next((w for w in list(_WATCHES) if w.address == address and w.state == "lost"), None)


class ControllerLostWarning(RuntimeWarning):
    """The controller that planned this job stopped answering (or came back, or ended the job)."""


def keepalive_options(keepalive: float, timeout: float) -> list[tuple[str, int]]:
    """Client channel options: ping an idle stream every `keepalive` s, give up after `timeout` s.
    The controller's server accepts pings this often (server.py KEEPALIVE_SERVER_OPTIONS). gRPC
    core times a ping out by `grpc.http2.ping_timeout_ms` (default a minute), not by
    keepalive_timeout alone, so both are set."""
    ms, timeout_ms = int(keepalive * 1000), int(timeout * 1000)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.http2.min_time_between_pings_ms", ms)]


class ControllerWatch:
    """Watches job `job_id` at the controller at `address` from a daemon thread.

    Args:
        address: the controller's ``host:port`` (as given to JoinJob's client).
        job_id: the job this worker joined.
        token: the job's token (or the admin token).
        on_change: ``callback(state, message)`` with state "lost", "back" or "ended"; called from
            the watch thread. Default: ``warnings.warn(message, ControllerLostWarning)``.
        keepalive, keepalive_timeout: seconds (see `keepalive_options`).
        retry: seconds between reconnection attempts while the controller is gone.
        tls_ca: PEM CA of the controller's certificate (as `ControllerClient`).

    Examples::

        >>> watch = ControllerWatch("127.0.0.1:50100", job_id, job_token)
        >>> ...                                   # training; a dead controller warns, naming it
        >>> if watch.state == "lost": raise watch.error("new_group")
        >>> watch.stop()
    """

    def __init__(self, address: str, job_id: str, token: str, on_change: Callable[[str, str], None] | None = None,
                 keepalive: float = DEFAULT_KEEPALIVE, keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
                 retry: float = DEFAULT_RETRY, tls_ca: str | None = None):
        self.address, self.job_id, self.token = address, job_id, token
        self.on_change = on_change or (lambda state, msg: warnings.warn(msg, ControllerLostWarning, stacklevel=2))
        self.retry = retry
        options = keepalive_options(keepalive, keepalive_timeout)
        self._connect: Callable[[], ControllerClient] = lambda: ControllerClient(
            address, token=token, tls_ca=tls_ca, timeout=PROBE_TIMEOUT, options=options)
        self.state = "connecting"  # connecting | up | lost | ended
        self.lost_at: float | None = None  # time.time() of the loss, while lost
        self.detail = ""  # why it counts as lost
        self.events: list[tuple[float, str, str]] = []  # (time.time(), state, message) of every change
        self._stop = threading.Event()
        self._client: ControllerClient | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"luwu-controller-watch-{job_id}", daemon=True)
        self._thread.start()
        _WATCHES.add(self)

    # -- what callers ask ------------------------------------------------------------------------------
    def describe(self) -> str:
        """One sentence on the controller's state, for error messages ('' while it answers)."""
        if self.state == "lost":
            since = time.strftime("%H:%M:%S", time.localtime(self.lost_at or time.time()))
            return (f"The controller {self.address} that planned job {self.job_id} has not answered since {since} "
                    f"({self.detail}).")
        if self.state == "ended":
            return f"The controller {self.address} ended job {self.job_id}."
        return ""

    def error(self, operation: str) -> ControllerUnreachable:
        """The error for `operation`, which needs the controller, while it is lost."""
        return ControllerUnreachable(f"{operation} needs the luwu controller at {self.address}, which planned job "
                                     f"{self.job_id} and stopped answering ({self.detail}); restart it (its --db keeps "
                                     "the job) or check --controller / LUWU_CONTROLLER")

    def stop(self) -> None:
        self._stop.set()
        _WATCHES.discard(self)
        with self._lock:
            if self._client is not None:
                self._client.close()  # cancels the stream the thread is blocked in
        self._thread.join(10)

    # -- the thread ------------------------------------------------------------------------------------
    def _change(self, state: str, message: str) -> None:
        if self._stop.is_set():
            return
        self.events.append((time.time(), state, message))  # before the state: whoever sees the state finds the event
        self.state = state
        try:
            self.on_change(state, message)
        except Exception:  # noqa: BLE001 - a reporting bug must not end the watch
            log.exception("controller watch: on_change failed")

    def _lost(self, detail: str) -> None:
        if self.state == "lost" or self._stop.is_set():
            return
        self.lost_at, self.detail = time.time(), detail
        self._change("lost", f"luwu: the controller {self.address} that planned job {self.job_id} stopped answering "
                             f"({detail}). The job keeps running on the plan its switches, nodes and engines hold; "
                             "what needs the controller (JoinJob: new ranks and process groups, EndJob, drift repair, "
                             "health, luwu-ctl) fails until it is back.")

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    return
                self._client = self._connect()
            try:
                job = self._client.job(self.job_id)
                if self.state == "lost":
                    self._change("back", f"luwu: the controller {self.address} answers again (job {self.job_id}).")
                self.state, self.lost_at, self.detail = "up", None, ""
                if job.state == pb.ENDED:
                    self._change("ended", f"luwu: the controller {self.address} ended job {self.job_id}.")
                    return
                for event in self._client.watch(self.job_id, include_past=False):
                    if event.kind == "ended":
                        self._change("ended", f"luwu: the controller {self.address} ended job {self.job_id}.")
                        return
                if not self._stop.is_set():  # the stream ended without an end of job: the server went away
                    self._lost("its WatchJob stream closed")
            except ControllerUnreachable as exc:
                self._lost(_short(exc))
            except ControllerRefused as exc:
                self._lost(f"it refused the watch: {exc}")
            except ValueError:  # the channel was closed by stop()
                return
            finally:
                with self._lock:
                    self._client.close()
                    self._client = None
            self._stop.wait(self.retry)


def _short(exc: ControllerUnreachable) -> str:
    """The gRPC status part of ControllerUnreachable's message (the address is said elsewhere)."""
    found = re.search(r"\((UNAVAILABLE|DEADLINE_EXCEEDED): (.*)\)$", str(exc), re.DOTALL)
    return f"{found.group(1)}: {found.group(2)}" if found else str(exc)
