"""`luwu node`: run an in-network optimizer node (an engine hosting an `OptimizerNode`).

Prints one JSON line `{"ready": true, "udp": ..., "control": ..., "params_per_second": ...}` when
it serves, and runs until SIGINT/SIGTERM. With --controller it registers the optimizer throughput
it offers: `--params-per-second`, or by default its own step rate measured at start
(luwu/bench/node_rate.py: `luwu bench optimizer`'s node step on a small model, 1-3 s).

The control channel is always authenticated (control.py): a job's token, checked with the
controller (--controller), or the node's own --control-token-file (which, like the admin token
of --token-file, reaches every job).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

from luwu.dataplane.optimizer import control_server as cs
from luwu.dataplane.optimizer.errors import CheckpointError
from luwu.dataplane.optimizer.node import OptimizerNode
from luwu.dataplane.optimizer.service import OptimizerService
from luwu.dataplane.optimizer.spec import NodeConfig
from luwu.dataplane.process.usage import UserError, host_port, positive_float, positive_int, size
from luwu.dataplane.session import EndpointPlan, shm_port_address

MEASURE_WAIT = 30.0  # s the start-up measurement waits for the compiled kernels' background load


def add_arguments(p) -> None:
    p.add_argument("--plan", required=True, help="endpoint plan JSON (the node's sessions and wiring)")
    p.add_argument("--state-dir", required=True, type=Path, help="directory for the optimizer state files")
    p.add_argument("--ram-budget", default="1GiB", type=size, help="RAM for state and served copies (e.g. 512MiB)")
    p.add_argument("--checkpoint-dir", type=Path, help="where checkpoints go (none: checkpoints refused)")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                   help="take a lazy checkpoint of every job each N optimizer steps (versions N, 2N, ...; needs "
                        "--checkpoint-dir); a node restarted with --restore latest resumes from the newest")
    p.add_argument("--restore", help="checkpoint to resume from: a path, or 'latest' in --checkpoint-dir")
    p.add_argument("--control", default=None, help="control channel address: unix:/path or host:port; clients "
                                                   "authenticate with a job's token (checked with --controller) or "
                                                   "the --control-token-file token")
    p.add_argument("--control-token-file", default="", help="file holding a token that reaches every job on the "
                                                            "control channel (needed for --control without "
                                                            "--controller)")
    p.add_argument("--control-max-message", type=size, default=None,
                   help="bytes one control message may carry (checked before allocating; default: --ram-budget)")
    p.add_argument("--control-max-unauthenticated", type=positive_int, default=cs.DEFAULT_MAX_UNAUTHENTICATED,
                   metavar="N", help="control connections at once waiting for their hello; one more evicts the "
                                     f"oldest (default {cs.DEFAULT_MAX_UNAUTHENTICATED})")
    p.add_argument("--control-max-unauthenticated-per-peer", type=positive_int, metavar="N",
                   default=cs.DEFAULT_MAX_UNAUTHENTICATED_PER_PEER,
                   help=f"the same, per source address (default {cs.DEFAULT_MAX_UNAUTHENTICATED_PER_PEER})")
    p.add_argument("--control-hello-timeout", type=positive_float, default=cs.DEFAULT_HELLO_TIMEOUT, metavar="S",
                   help=f"seconds a control connection has to say hello (default {cs.DEFAULT_HELLO_TIMEOUT:g})")
    p.add_argument("--control-max-authenticated", type=positive_int, default=cs.DEFAULT_MAX_AUTHENTICATED,
                   metavar="N", help="authenticated control connections at once (a thread each); more are refused "
                                     f"(default {cs.DEFAULT_MAX_AUTHENTICATED})")
    p.add_argument("--control-max-authenticated-per-peer", type=positive_int, metavar="N",
                   default=cs.DEFAULT_MAX_AUTHENTICATED_PER_PEER,
                   help=f"the same, per source address (default {cs.DEFAULT_MAX_AUTHENTICATED_PER_PEER})")
    p.add_argument("--control-idle-timeout", type=positive_float, default=cs.DEFAULT_IDLE_TIMEOUT, metavar="S",
                   help="seconds an authenticated control connection may send nothing before it is closed "
                        f"(default {cs.DEFAULT_IDLE_TIMEOUT:g})")
    p.add_argument("--metrics", metavar="HOST:PORT", type=host_port,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (docs/observability.md)")
    p.add_argument("--pipeline", choices=["step", "layer"], default="step", help="optimizer pipeline shape")
    p.add_argument("--threads-per-step", type=positive_int, default=1)
    from luwu.controller.daemon_link import add_controller_arguments

    add_controller_arguments(p, "node")
    p.add_argument("--params-per-second", type=positive_float, default=None,
                   help="with --controller: optimizer throughput this node offers (the planner balances layers "
                        "over nodes by it, `luwu-ctl plan --explain` predicts with it); default: measured at "
                        "start, `luwu bench optimizer`'s node step on a small model (1-3 s)")


def run(args) -> int:
    from luwu.dataplane import kernels
    from luwu.dataplane.observe import trace
    from luwu.dataplane.process.heap import freeze_collector, refreeze, retain_freed_memory

    # as the switch and engine daemons do (dataplane/process/heap.py): each layer's gradient assembly and the
    # step's temporaries (hundreds of KiB to MiB) stay mapped instead of an mmap, page faults and
    # munmap per layer step; the state and served copies are mappings of their own (buffers.py)
    retain_freed_memory()
    plan = EndpointPlan.from_file(args.plan)
    trace.start(f"optimizer node ({Path(args.plan).stem})")
    config = NodeConfig(state_dir=args.state_dir, ram_budget=args.ram_budget, checkpoint_dir=args.checkpoint_dir,
                        pipeline=args.pipeline, threads_per_step=args.threads_per_step)
    if args.checkpoint_every and args.checkpoint_dir is None:
        raise UserError("--checkpoint-every needs --checkpoint-dir (where the checkpoints go)")
    restore = args.restore
    if restore == "latest":
        if args.checkpoint_dir is None:
            raise UserError("--restore latest needs --checkpoint-dir")
        restore = OptimizerNode.latest_checkpoint(args.checkpoint_dir)
        if restore is None:
            raise UserError(f"--restore latest: no complete checkpoint in {args.checkpoint_dir}")
    elif restore is not None and not Path(restore).is_dir():
        raise UserError(f"--restore {restore}: no such checkpoint directory (or pass 'latest')")
    auth = _control_auth(args) if args.control else None
    try:
        service = OptimizerService(plan, config, restore)
    except CheckpointError as exc:  # a corrupt or foreign checkpoint is the user's to replace, not a crash
        raise UserError(f"--restore {restore}: {exc}") from None
    except ValueError as exc:  # a plan this host cannot honour (e.g. shared-memory ports of another host)
        raise UserError(f"--plan {args.plan}: {exc}") from None
    except ConnectionRefusedError as exc:  # a shared-memory port whose switch has stopped: no rings to open
        raise UserError(f"--plan {args.plan}: {exc.strerror}: start the node while the plan's switch runs") from None
    if args.checkpoint_every:
        from luwu.dataplane.optimizer.periodic import PeriodicCheckpoints

        PeriodicCheckpoints(service.node, args.checkpoint_every)
        service.node.add_checkpoint_listener(_log_checkpoint)
    service.start(args.control, auth, limits=control_limits(args, config.ram_budget))
    try:
        capacity = node_capacity(args) if getattr(args, "controller", None) else None
        beat = _join_controller(args, service, config, capacity)
    except Exception:
        service.close()
        raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    address = data_address(service, plan)
    metrics = None
    if args.metrics:
        from luwu.dataplane.observe.metrics import NodeCollector, serve

        metrics = "{}:{}".format(*serve(args.metrics, NodeCollector(service.node.stats)))
    # torch's and the node's start-up objects leave the collector's sight: a full collection traversed
    # them all again while the engine loop's garbage is young (again once the compiled kernels are in)
    freeze_collector()
    refrozen = False
    print(json.dumps({"ready": True, "udp": None if plan.wiring.transport == "shm" else address,
                      "data_address": address, "metrics": metrics,
                      "control": service.control.address if service.control else None,
                      "sessions": [s.session for s in plan.sessions],
                      "params_per_second": capacity["params_per_second"] if capacity else None,
                      "params_per_second_source": capacity["source"] if capacity else None}), flush=True)
    try:
        while not stop.wait(0.5):
            if service.engine.error is not None:
                raise SystemExit(f"the engine failed: {service.engine.error!r}")
            if not refrozen and kernels.wait_loaded(0):
                refreeze()  # numba's objects are long-lived too
                refrozen = True
    finally:
        if beat is not None:
            beat.stop()
        service.close()
    return 0


def control_limits(args, ram_budget: int):
    """The control channel's bounds from the --control-* flags (max message: --ram-budget unless set)."""
    return cs.ControlLimits(max_message=args.control_max_message or ram_budget,
                            max_unauthenticated=args.control_max_unauthenticated,
                            max_unauthenticated_per_peer=args.control_max_unauthenticated_per_peer,
                            hello_timeout=args.control_hello_timeout,
                            max_authenticated=args.control_max_authenticated,
                            max_authenticated_per_peer=args.control_max_authenticated_per_peer,
                            idle_timeout=args.control_idle_timeout)


def _log_checkpoint(event: str, info: dict) -> None:
    """One stderr line per committed or failed checkpoint (what `--restore latest` will find)."""
    if event == "commit":
        print(f"luwu node: checkpoint {info['checkpoint']} committed in {info['seconds']:.1f} s", file=sys.stderr,
              flush=True)
    elif event == "error":
        print(f"luwu node: checkpoint {info['checkpoint']} failed: {info['error']}", file=sys.stderr, flush=True)


def _control_auth(args):
    """Who may use the control channel: --control-token-file, the admin token, and job tokens the
    controller confirms (its job-scoped GetJob answers only the job's own token)."""
    from luwu.controller.config import read_token
    from luwu.dataplane.optimizer.control import ControlAuth

    static = read_token("", args.control_token_file) if args.control_token_file else ""
    verify = None
    if getattr(args, "controller", None):
        static = static or read_token("", args.token_file)

        def verify(job_id: str, token: str) -> bool:
            from luwu.controller.client import ControllerClient, ControllerRefused

            with ControllerClient(args.controller, token, timeout=10) as client:
                try:
                    return client.job(job_id).job_id == job_id
                except ControllerRefused:  # not this job's token
                    return False
                except ConnectionError:  # nobody to ask: the client hears that, not "bad token"
                    raise ConnectionError(f"the luwu controller {args.controller} that checks job tokens for this "
                                          "node does not answer (use the node's control token, or restart the "
                                          "controller)") from None
    if not static and verify is None:
        raise UserError("--control needs --control-token-file FILE or --controller: the control channel takes "
                        "only authenticated clients")
    return ControlAuth(token=static, verify=verify)


def data_address(service: OptimizerService, plan: EndpointPlan) -> str:
    """The node's data-plane address as the controller takes it: HOST:PORT of its UDP socket, or the
    shared-memory port it opened (shm:/dev/shm/NAME, `luwu.dataplane.session.parse_port_address`)."""
    host, port = service.address
    return shm_port_address(host) if plan.wiring.transport == "shm" else f"{host}:{port}"


def node_capacity(args) -> dict:
    """The params/s this node registers: --params-per-second, else measured now (luwu/bench/node_rate.py,
    after the compiled kernels' background load, so that the measurement runs the kernels the node
    steps with). Returns {"params_per_second", "source"} plus the measurement's figures."""
    if args.params_per_second is not None:
        return {"params_per_second": float(args.params_per_second), "source": "--params-per-second"}
    from luwu.bench.node_rate import measure
    from luwu.dataplane import kernels

    kernels.wait_loaded(MEASURE_WAIT)
    rate = measure(pipeline=args.pipeline, threads_per_step=args.threads_per_step)  # as this node steps
    print(f"luwu node: measured {rate.params_per_second:.3g} params/s ({rate.params:,} params, median of "
          f"{rate.steps} steps, {rate.seconds:.1f} s with warm-up); --params-per-second overrides", file=sys.stderr,
          flush=True)
    return rate.to_dict()


def _join_controller(args, service: OptimizerService, config: NodeConfig, capacity: dict | None = None):
    """Register (or re-register, with the engine's real address) and report health; None without
    --controller. A node that stops reporting is marked down by the controller. `capacity`:
    `node_capacity(args)` (measured here when not given)."""
    from luwu.controller.daemon_link import HEARTBEAT_INTERVAL, connect

    client = connect(args)
    if client is None:
        return None
    import shutil

    from luwu.proto import controller_pb2 as pb

    config.state_dir.mkdir(parents=True, exist_ok=True)
    address = data_address(service, service.engine.plan)
    capacity = capacity or node_capacity(args)
    client.register_node(pb.Node(name=args.name, data_address=address, capacity=pb.NodeCapacity(
        params_per_second=capacity["params_per_second"], ram_bytes=config.ram_budget,
        disk_bytes=shutil.disk_usage(config.state_dir).free)))

    def counters() -> dict[str, int]:
        out = {}
        for name, session in service.engine.session_stats().items():
            if name.startswith("session "):
                for key in ("gradients", "pulls_served", "agg_packets", "fallback_packets"):
                    if key in session:
                        out[f"{name.replace(' ', '_')}.{key}"] = int(session[key])
        return out

    return client.heartbeat_loop("node", args.name, HEARTBEAT_INTERVAL, counters=counters)
