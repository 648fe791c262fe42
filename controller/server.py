"""`luwu controller`: the gRPC controller process (and `ControllerServer` to run one in-process).

Options: --listen HOST:PORT, --db FILE (sqlite state), --token-file FILE (else LUWU_TOKEN),
--tls-cert/--tls-key (PEM; both or neither), --health-timeout SECONDS, pool sizes, --p4info,
--bmv2-json, --switch-tls-ca/--switch-tls-cert/--switch-tls-key (P4Runtime to the switches over
TLS), --reconcile-interval SECONDS, --metrics HOST:PORT (Prometheus, controller/metrics.py). On start it loads the state, re-programs every registered
switch from the live jobs in the background (idempotent), watches heartbeats, and reads every
switch back periodically to find and repair drift.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from luwu.dataplane.process.usage import UserError, existing_file_or_error, host_port, nonnegative_int, positive_float
from luwu.proto import controller_pb2 as pb

from .auth import Authenticator
from .config import DEFAULT_DB, DEFAULT_LISTEN, ControllerConfig, read_token
from .core import ControllerCore
from .grpc_surface import RpcCounts, add_controller_service
from .metrics import ControllerCollector
from .service import ControllerService
from .store import StateStore

log = logging.getLogger("luwu.controller")
STOP_GRACE = 1.0  # seconds in-flight RPCs get at shutdown
JOB_STATES = {number: name for name, number in pb.JobState.items() if number}  # 2 -> "RUNNING", ...
METRICS_WAIT = 10.0  # seconds a scrape waits for the controller's event loop
# Workers keep an idle WatchJob stream open and ping it every few seconds (watch.py), so that a
# controller host that dies silently is noticed; gRPC's default would answer such pings with GOAWAY.
KEEPALIVE_SERVER_OPTIONS = [("grpc.http2.min_ping_interval_without_data_ms", 1000),
                            ("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1)]


class ControllerServer:
    def __init__(self, config: ControllerConfig, programmer=None):
        config.validate()
        self.config = config
        self.auth = Authenticator(config.admin_token)
        self._programmer = programmer
        self.server: grpc.aio.Server | None = None
        self.core: ControllerCore | None = None
        self.address = ""
        self.reconciled: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self.rpcs = RpcCounts()
        self.metrics_address = ""  # HOST:PORT of /metrics once serving (config.metrics)
        self._stop_metrics: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> str:
        store = StateStore(self.config.db)
        self.core = ControllerCore(self.config, store, self._programmer)
        self.server = grpc.aio.server(options=KEEPALIVE_SERVER_OPTIONS)
        add_controller_service(ControllerService(self.core, self.auth), self.server, self.rpcs)
        if self.config.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(self.config.tls_key).read_bytes(),
                                                  Path(self.config.tls_cert).read_bytes())])
            port = self.server.add_secure_port(self.config.listen, creds)
        else:
            port = self.server.add_insecure_port(self.config.listen)
        if not port:
            raise OSError(f"cannot listen on {self.config.listen}: is another controller running there?")
        await self.server.start()
        self.address = f"{self.config.listen.rpartition(':')[0]}:{port}"
        self._loop = asyncio.get_running_loop()
        if self.config.metrics:
            from luwu.dataplane.observe.metrics import serve_stoppable

            try:
                (host, mport), self._stop_metrics = serve_stoppable(self.config.metrics,
                                                                    ControllerCollector(self.metrics_snapshot))
            except OSError as exc:
                await self.server.stop(None)
                raise OSError(f"--metrics {self.config.metrics}: cannot serve there: {exc.strerror}") from None
            self.metrics_address = f"{host}:{mport}"
        self.reconciled = asyncio.create_task(self.core.reconcile_all())
        self._tasks = [self.reconciled, asyncio.create_task(self.core.health_loop()),
                       asyncio.create_task(self.core.drift_loop())]
        return self.address

    def metrics_snapshot(self) -> dict:
        """What ControllerCollector exports, read on the controller's event loop (called from the
        metrics server's thread; waits at most METRICS_WAIT seconds)."""
        if self._loop is None:
            raise RuntimeError("the controller is not running")
        return asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop).result(METRICS_WAIT)

    async def _snapshot(self) -> dict:
        core = self.core
        assert core is not None, "metrics before start"
        jobs: dict[str, int] = dict.fromkeys(JOB_STATES.values(), 0)
        for row in core.store.jobs(include_ended=True):
            name = JOB_STATES.get(row.state, str(row.state))
            jobs[name] = jobs.get(name, 0) + 1
        switches = {n: {"target": sw.target, "health": core.health.health("switch", n),
                        "programmed": core.programmed.get(n, ""), "jobs": len(core.jobs_on("switch", n)),
                        "drift_repairs": core.drift_repairs.get(n, 0)} for n, sw in core.switches.items()}
        nodes = {n: {"health": core.health.health("node", n), "drained": core.drained(n)} for n in core.nodes}
        return {"jobs": jobs, "switches": switches, "nodes": nodes, "rpcs": self.rpcs.snapshot(),
                "refusals": dict(self.auth.refusals), "uptime": core.health.clock() - core.started}

    async def stop(self) -> None:
        if self._stop_metrics is not None:
            await asyncio.to_thread(self._stop_metrics)
            self._stop_metrics = None
        for t in self._tasks:
            t.cancel()
        if self.server is not None:
            await self.server.stop(STOP_GRACE)
        if self.core is not None:
            self.core.store.close()


class BackgroundController:
    """A ControllerServer on its own event loop thread (tests, embedded use). `.address`, `.stop()`."""

    def __init__(self, config: ControllerConfig, programmer=None):
        self.loop = asyncio.new_event_loop()
        self.server = ControllerServer(config, programmer)
        self._thread = threading.Thread(target=self.loop.run_forever, name="luwu-controller", daemon=True)
        self._thread.start()
        self.address = self.call(self.server.start())

    def call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_reconciled(self, timeout: float | None = None) -> dict[str, str]:
        async def wait():
            return await self.server.reconciled

        return self.call(wait(), timeout)

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def add_arguments(p) -> None:
    d = ControllerConfig()
    p.add_argument("--listen", default=DEFAULT_LISTEN, type=host_port, help=f"gRPC address to serve on (default {DEFAULT_LISTEN})")
    p.add_argument("--db", default=str(DEFAULT_DB), help="sqlite file holding registrations, jobs, plans and epochs "
                                                         f"(default {DEFAULT_DB})")
    p.add_argument("--token-file", default="", help="file holding the admin token (default: $LUWU_TOKEN)")
    p.add_argument("--tls-cert", default="", help="PEM certificate: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", default="", help="PEM private key for --tls-cert")
    p.add_argument("--health-timeout", type=positive_float, default=d.health_timeout,
                   help=f"seconds without a heartbeat before a switch or node is down (default {d.health_timeout})")
    p.add_argument("--meta-pool", type=nonnegative_int, default=d.meta_pool, help=f"meta session slots (default {d.meta_pool})")
    p.add_argument("--param-window", type=nonnegative_int, default=d.param_window,
                   help=f"PARAM stream window of node sessions, packets (default {d.param_window}; BMv2's queues "
                        "hold 16, docs/mininet.md)")
    p.add_argument("--data-pool", type=nonnegative_int, default=d.data_pool, help=f"data session slots (default {d.data_pool})")
    p.add_argument("--node-pool", type=nonnegative_int, default=d.node_pool, help=f"node session slots (default {d.node_pool})")
    p.add_argument("--min-pool", type=nonnegative_int, default=d.min_pool,
                   help=f"smallest pool a full switch may shrink a session to (default {d.min_pool})")
    p.add_argument("--allow-fallback", action="store_true",
                   help="when a switch is full, give node sessions pool size 0 (all traffic falls back to the node); "
                        "needs a switch that accepts pool_size 0")
    p.add_argument("--p4info", default="", help="P4Info text file (default: the committed p4/build/p4info.txtpb)")
    p.add_argument("--bmv2-json", default="", help="BMv2 JSON for bmv2 targets (default: p4/build/luwu_v1model.json)")
    p.add_argument("--program-timeout", type=positive_float, default=d.program_timeout,
                   help=f"seconds to connect to and program one switch (default {d.program_timeout})")
    p.add_argument("--switch-tls-ca", default="",
                   help="PEM CA that signed the switches' P4Runtime certificates: program switches over TLS (default: "
                        "plaintext, loopback switches only; the switch token is sent either way)")
    p.add_argument("--switch-tls-cert", default="", help="PEM client certificate for switches that require one (mutual "
                                                         "TLS; with --switch-tls-key)")
    p.add_argument("--switch-tls-key", default="", help="PEM private key for --switch-tls-cert")
    p.add_argument("--reconcile-interval", type=float, default=d.reconcile_interval,
                   help="seconds between read-backs of every switch's tables; drift (entries changed, missing or "
                        f"not written by the controller) is reported and repaired (default {d.reconcile_interval}; "
                        "0: off)")
    p.add_argument("--audit-log", metavar="PATH|off", default=None,
                   help="append every P4Runtime write to a switch (who, what, result) to PATH as JSON lines "
                        "(default: controller-p4runtime-audit.jsonl beside --db; off: none)")
    p.add_argument("--metrics", metavar="HOST:PORT", type=host_port, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics: jobs by state, switch and node "
                        "health, drift repairs, RPCs by method and result, auth refusals (docs/observability.md)")


def config_from_args(args) -> ControllerConfig:
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--p4info", args.p4info),
                       ("--bmv2-json", args.bmv2_json), ("--switch-tls-ca", args.switch_tls_ca),
                       ("--switch-tls-cert", args.switch_tls_cert), ("--switch-tls-key", args.switch_tls_key)):
        if path:
            existing_file_or_error(path, flag)
    return ControllerConfig(listen=args.listen, db=args.db, admin_token=read_token("", args.token_file),
                            tls_cert=args.tls_cert, tls_key=args.tls_key, health_timeout=args.health_timeout,
                            meta_pool=args.meta_pool, data_pool=args.data_pool, node_pool=args.node_pool,
                            param_window=args.param_window, min_pool=args.min_pool, allow_fallback=args.allow_fallback, p4info=args.p4info,
                            bmv2_json=args.bmv2_json, program_timeout=args.program_timeout,
                            switch_tls_ca=args.switch_tls_ca, switch_tls_cert=args.switch_tls_cert,
                            switch_tls_key=args.switch_tls_key, reconcile_interval=args.reconcile_interval,
                            metrics=args.metrics or "", audit_log=_audit_path(args))


def _audit_path(args) -> str:
    if args.audit_log == "off":
        return ""
    return args.audit_log or str(Path(args.db).parent / "controller-p4runtime-audit.jsonl")


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        server = ControllerServer(config)
    except (ValueError, FileNotFoundError, UserError) as exc:
        print(f"luwu controller: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        try:
            address = await server.start()
        except OSError as exc:
            print(f"luwu controller: {exc}", file=sys.stderr)
            return 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        metrics = f", metrics http://{server.metrics_address}/metrics" if server.metrics_address else ""
        print(f"luwu controller listening on {address} (db {config.db}, "
              f"{'TLS' if config.tls_cert else 'plaintext'}{metrics})", flush=True)
        await stop.wait()
        await server.stop()
        return 0

    return asyncio.run(main())
