"""`luwu mininet`: run luwu on an emulated star, multi-rack or rail-only network.

    luwu mininet run  --topo star|multi-rack|rail-only [--workers N] [--backend auto|mininet|netns]
                      [--switch software|bmv2] [--size 256KiB] [--drop P] [--push-pull]
                      [--workload allreduce|ddp|train [--steps N]] [--controller auto|process|in-process] [--json]
    luwu mininet show --topo ...      # the emulation spec and the plan, without building anything
    luwu mininet up   --topo ...      # build it, program the switches, print how to reach each host, wait

`run` builds the network (Mininet when it is installed, else plain namespaces) and a management
network to every host, starts `luwu controller` on it and one switch per switch node, which
register with it and are programmed by it over P4Runtime (control.py; --controller in-process:
the runner plans with the same planner and hands each switch a runtime file), runs an
in-network allreduce of int32 tensors between the workers (hierarchical over NVLink on
rail-only) and, with --push-pull, a pull/push/pull through the optimizer nodes (or, with
--workload ddp, torch DDP over the luwu backend against the same training without network), checks every
result, prints grep-able `key: value` lines (or one JSON object) and tears everything down. Exit
status 0 when every check passed, 1 when one failed, 2 for bad options or a missing prerequisite.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from luwu.dataplane.protocol import DEFAULT_UDP_PORT, lanes_for_mode

from . import links
from .job import plan_job
from .mgmt import MGMT_SUBNET
from .orchestrator import Emulation, RunOptions, RunResult
from .processes import ChildError
from .results import summary, summary_lines
from .switches import SWITCH_KINDS, bmv2_missing, drop_entries, route_entries
from .topologies import JUMBO_MTU, NODE_MODES, TOPOLOGIES, TopologyError, TopologyOptions, build_topology, emulate

BACKENDS = ("auto", "mininet", "netns")
CONTROLLER_MODES = ("auto", "process", "in-process")
WORKLOAD_TIMEOUT = 120.0  # s: --timeout's default with the software switch (TIMEOUT_SCALE below)
DEFAULTS = {"size": "256KiB", "bw": 1000.0, "timeout": WORKLOAD_TIMEOUT, "nvlink_port": 19600}
MININET_MAX_BW = 1000.0  # Mbit/s: Mininet's TCLink refuses more
_MAIN_PID = 0  # the runner's process: the only one whose SIGTERM unwinds into teardown
PUSH_PULL_SMALL_LAYER = 777  # elements of the second push/pull layer: not a multiple of any lane count
# Slots of every session's pool on BMv2. A pool is also each stream's window, and BMv2 forwards
# about a thousand 64-lane packets a second here and holds 64 packets per egress port (more are
# dropped, uncounted): with the planner's 256-slot pools the queues overflow, every loss costs a
# retransmission that queues behind the rest and the run collapses into resends (docs/mininet.md).
BMV2_POOL = 16
# The workload's default time limit, per switch kind: WORKLOAD_TIMEOUT times this. BMv2 forwards
# about 100x slower than the software switch (its twin), but a workload's time is mostly start-up,
# torch and the optimizer nodes, so its limit grows 5x, not 100x: the rail-only train workload on
# BMv2 ran 112 s of training on 2 cores (past the software switch's 120 s once start-up is added).
# An explicit --timeout is used as given.
TIMEOUT_SCALE = {"software": 1.0, "bmv2": 5.0}


def add_arguments(p) -> None:
    p.add_argument("action", choices=["run", "show", "up"],
                   help="run: emulate and check; show: print spec and plan; up: build the network, start and "
                        "program its switches, print how to reach every host, keep it up until Ctrl-C")
    p.add_argument("--duration", type=float, default=0.0, help="up: tear down after this many seconds (0: at Ctrl-C)")
    p.add_argument("--topo", choices=TOPOLOGIES, default="star", help="topology (default star)")
    p.add_argument("--workers", type=int, default=None,
                   help="workers in all (default: 3 on a star, two per rack on multi-rack, two servers on rail-only)")
    p.add_argument("--nodes", type=int, default=1, help="optimizer nodes (star, multi-rack; default 1)")
    p.add_argument("--racks", type=int, default=2, help="multi-rack: racks, workers split evenly (default 2)")
    p.add_argument("--gpus", type=int, default=2, help="rail-only: GPUs per server = rails (default 2)")
    p.add_argument("--node-mode", choices=NODE_MODES, default=None,
                   help="rail-only: one node with a port per rail, or a node per rail (default: port_per_rail; "
                        "node_per_rail with --workload train, whose `luwu node` daemons serve one attachment each)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="mininet, netns (plain namespaces, pyroute2), or auto: mininet when installed")
    p.add_argument("--switch", choices=SWITCH_KINDS, default="software",
                   help="software: `luwu switch` on raw interfaces; bmv2: simple_switch_grpc")
    p.add_argument("--size", default=DEFAULTS["size"], help="bytes of each worker's int32 tensor (default 256KiB)")
    p.add_argument("--drop", type=float, default=0.0, help="loss probability on every switch port's ingress")
    p.add_argument("--push-pull", action="store_true", help="also pull/push/pull through the optimizer nodes")
    p.add_argument("--workload", choices=["allreduce", "ddp", "train"], default="allreduce",
                   help="allreduce: engine checks (int32 sums bit for bit, --push-pull); ddp: torch DDP over "
                        "init_process_group('luwu') on every worker; train: a small GPT with ModelInNetwork, AdamW "
                        "on `luwu node` daemons out of core; both compared with the same training without network")
    p.add_argument("--steps", type=int, default=20, help="ddp, train: training steps (default 20)")
    p.add_argument("--collectives", action="store_true",
                   help="ddp on rail-only: after training, all_to_all, gather and send/recv between every pair of "
                        "GPUs, checked exactly; cross-rail pairs go through a mate GPU's NVLink (docs/mininet.md)")
    p.add_argument("--packet-mode", default=None,
                   help="lanes per packet: jumbo (software default), tofino (bmv2, the only one it has) or a number")
    p.add_argument("--slots", type=int, default=1024, help="slots per set of every switch (default 1024)")
    p.add_argument("--pool", type=int, default=None,
                   help=f"slots of every session's pool and packets of the PARAM window, a power of two (default: "
                        f"the planner's, meta 32 and data/node 256; bmv2: {BMV2_POOL}, what its queues hold)")
    p.add_argument("--link", action="append", default=[], metavar="SWITCH:PORT=bw=MBIT,drop=P",
                   help="one link's bandwidth and/or ingress loss, overriding --bw/--drop there (repeatable)")
    p.add_argument("--bw", type=float, default=DEFAULTS["bw"], help="link bandwidth in Mbit/s, 0 = unshaped "
                   "(tc htb; default 1000, Mininet's maximum)")
    p.add_argument("--mtu", type=int, default=JUMBO_MTU, help=f"MTU of every link (default {JUMBO_MTU})")
    p.add_argument("--udp-port", type=int, default=DEFAULT_UDP_PORT, help="luwu UDP port of every switch")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds the workload may take (default {WORKLOAD_TIMEOUT:g}, times "
                        f"{TIMEOUT_SCALE['bmv2']:g} with --switch bmv2: it forwards about 100x slower)")
    p.add_argument("--seed", type=int, default=1, help="seeds the tensors, epochs and the drop simulator")
    p.add_argument("--nvlink-port", type=int, default=DEFAULTS["nvlink_port"], help="TCP port of the NVLink exchange")
    p.add_argument("--mininet-python", default=None, help="python that imports mininet (default /usr/bin/python3)")
    p.add_argument("--run-dir", type=Path, default=None, help="where configs and logs go (default: a temp dir, "
                   "removed after a passing run)")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="run: where the timeline of every process goes, a Chrome trace (default: trace.json in "
                        "--run-dir, or luwu-mininet-ID-trace.json in the temp dir; docs/observability.md)")
    p.add_argument("--controller", choices=CONTROLLER_MODES, default="auto",
                   help="process: `luwu controller` runs on a management network, the switches register with it "
                        "and are programmed by it over P4Runtime, workers join its job; in-process: the runner plans "
                        "and hands each switch a runtime file; auto (default): process where supported (not yet "
                        "for rail-only nodes with a port per rail), else in-process")
    p.add_argument("--mgmt-subnet", default=MGMT_SUBNET,
                   help=f"where the management network's /24 comes from (default {MGMT_SUBNET})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key: value lines")


class UsageError(ValueError):
    """Options that cannot work together, or a missing prerequisite; exit status 2."""


def _options(args) -> tuple[TopologyOptions, RunOptions]:
    if args.workers is None:  # a count every topology can hold with its other defaults
        args.workers = {"multi-rack": 2 * args.racks, "rail-only": 2 * args.gpus}.get(args.topo, 3)
    if args.node_mode is None:  # train: a node daemon per rail (hierarchical push/pull); else one node on every rail
        args.node_mode = "node_per_rail" if args.workload == "train" else "port_per_rail"
    from luwu.bench.sizes import parse_size

    if args.timeout is None:
        args.timeout = WORKLOAD_TIMEOUT * TIMEOUT_SCALE[args.switch]
    mode = args.packet_mode or ("tofino" if args.switch == "bmv2" else "jumbo")
    try:
        lanes = lanes_for_mode(mode)
        size = parse_size(args.size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.switch == "bmv2" and lanes != lanes_for_mode("tofino"):
        raise UsageError(f"--switch bmv2 runs the {lanes_for_mode('tofino')}-lane build; drop --packet-mode {mode}")
    if size < 4 or size % 4:
        raise UsageError(f"--size {args.size}: each worker's tensor is int32, so a positive multiple of 4 bytes")
    if not 0.0 <= args.drop < 1.0:
        raise UsageError(f"--drop {args.drop} must be a probability in [0, 1)")
    if args.bw < 0 or args.timeout <= 0:
        raise UsageError("--bw must be >= 0 and --timeout positive")
    topo = TopologyOptions(args.topo, args.workers, args.nodes, args.racks, args.gpus, args.node_mode, lanes,
                           args.slots, args.udp_port)
    topo.validate()
    if args.topo == "rail-only" and size // 4 < args.gpus:
        raise UsageError(f"--size {args.size}: rail-only shards the tensor over {args.gpus} GPUs; use at least "
                         f"{4 * args.gpus} bytes")
    if args.pool is not None and (args.pool < 1 or args.pool & (args.pool - 1) or args.pool > args.slots):
        raise UsageError(f"--pool {args.pool} must be a power of two between 1 and --slots ({args.slots})")
    if args.workload == "train":
        if args.topo == "rail-only" and args.node_mode == "port_per_rail":
            raise UsageError("--workload train on rail-only runs a `luwu node` daemon per rail, each owning its rail's "
                             "slice of every unit (a daemon serves one attachment): use --node-mode node_per_rail")
        if args.nodes < 1:
            raise UsageError("--workload train needs an optimizer node (--nodes 1 or more)")
        if args.push_pull:
            raise UsageError("--workload train already pushes and pulls through the optimizer nodes: drop --push-pull")
    if args.workload in ("ddp", "train"):
        if args.workload == "ddp" and args.push_pull:
            raise UsageError("--workload ddp trains with the torch backend's allreduce: drop --push-pull")
        if args.steps < 1:
            raise UsageError(f"--steps {args.steps} must be at least 1")
    if args.collectives and (args.workload != "ddp" or args.topo != "rail-only"):
        raise UsageError("--collectives runs with --workload ddp --topo rail-only (only rail-only hosts route "
                         "GPU to GPU)")
    if args.push_pull and args.topo != "rail-only" and args.nodes < 1:
        raise UsageError("--push-pull needs an optimizer node (--nodes 1 or more)")
    try:
        mgmt = ipaddress.ip_network(args.mgmt_subnet)
    except ValueError as e:
        raise UsageError(f"--mgmt-subnet {args.mgmt_subnet}: {e}") from None
    if mgmt.prefixlen > 24 or mgmt.version != 4:
        raise UsageError(f"--mgmt-subnet {args.mgmt_subnet}: give an IPv4 /24 or larger (each run takes a /24)")
    in_process_why = _in_process_why(args)
    if args.controller == "process" and in_process_why:
        raise UsageError(f"--controller process: {in_process_why}; use --controller in-process")
    run = RunOptions(backend=args.backend, switch=args.switch, elements=size // 4, push_pull=args.push_pull,
                     workload=args.workload, steps=args.steps, collectives=args.collectives,
                     timeout=args.timeout, seed=args.seed, nvlink_port=args.nvlink_port,
                     mininet_python=args.mininet_python, controller=args.controller != "in-process" and not in_process_why,
                     mgmt_subnet=args.mgmt_subnet, pool=args.pool or (BMV2_POOL if args.switch == "bmv2" else None))
    return topo, run


def _in_process_why(args) -> str:
    """Why this run cannot have its controller as a process ('' when it can)."""
    if args.topo == "rail-only" and args.push_pull and args.node_mode == "port_per_rail":
        return ("a rail-only node with a port per rail has an address per rail, and a controller node "
                "registration holds one (use --node-mode node_per_rail)")
    return ""


def _backend(args) -> str:
    from . import mininet_backend, netns_backend

    if args.backend in ("auto", "mininet"):
        why = mininet_backend.missing(args.mininet_python)
        if why is None:
            if args.bw > MININET_MAX_BW:
                raise UsageError(f"--bw {args.bw:g}: Mininet shapes links up to {MININET_MAX_BW:g} Mbit/s; use "
                                 "--bw 0 (unshaped) or --backend netns")
            return "mininet"
        if args.backend == "mininet":
            raise UsageError(why)
    why = netns_backend.require_root()
    if why:
        raise UsageError(why)
    return "netns"


def prepare(args, run_id: str):
    """(topology, emulation spec, planned job, run options) from the command line."""
    topo_opts, run_opts = _options(args)
    topo = build_topology(topo_opts)
    spec = emulate(topo, run_id, args.mtu, args.bw)
    link_settings = links.parse(args.link)
    links.apply_bandwidth(spec, link_settings)
    run_opts.port_drops = links.port_drops(spec, link_settings, args.drop)
    layers = [(0, max(1, run_opts.elements // 4)), (1, PUSH_PULL_SMALL_LAYER)] if run_opts.push_pull else None
    if run_opts.workload == "train":  # the model's units are the job's layers
        from .train_workload import layers as train_layers

        layers = train_layers(args.seed)
    nodes = 1 if args.topo == "rail-only" else args.nodes  # rail-only: the node(s) on each rail serve it
    config = _planner_config(args.pool or (BMV2_POOL if args.switch == "bmv2" else None))
    if args.switch == "bmv2":
        from luwu.p4 import BUILD_DIR, P4INFO_TXTPB

        job = plan_job(topo, spec, layers, "bmv2", str(P4INFO_TXTPB), str(BUILD_DIR / "luwu_v1model.json"),
                       config=config, seed=args.seed, nodes=nodes)
    else:
        job = plan_job(topo, spec, layers, config=config, seed=args.seed, nodes=nodes)
    for sw in spec.switches:
        job.runtime.setdefault(sw.name, {"table_entries": [], "multicast_group_entries": []})
        for port, p in sorted(run_opts.port_drops[sw.name].items()):
            job.runtime[sw.name]["table_entries"] += drop_entries([port], p)
        job.runtime[sw.name]["table_entries"] += route_entries(sw)  # GPU-to-GPU TCP on a rail (cross-rail p2p)
    return topo, spec, job, run_opts


def _planner_config(pool: int | None):
    """The planner's settings with every pool (meta, data, node) and the PARAM window at `pool`
    packets; None: its defaults."""
    if pool is None:
        return None
    from luwu.controller.config import ControllerConfig

    return ControllerConfig(meta_pool=pool, data_pool=pool, node_pool=pool, param_window=pool,
                            min_pool=min(pool, ControllerConfig.min_pool))


def run(args) -> int:
    run_id = secrets.token_hex(2)
    try:
        topo, spec, job, run_opts = prepare(args, run_id)
        if args.action == "show":
            print(json.dumps({"spec": json.loads(spec.to_json()), "explanation": job.plan.explanation,
                              "runtime": job.runtime}, indent=1))
            return 0
        if args.switch == "bmv2" and bmv2_missing():
            raise UsageError(bmv2_missing())
        run_opts.backend = _backend(args)
        if args.trace is not None and not args.trace.resolve().parent.is_dir():
            raise UsageError(f"--trace {args.trace}: directory {args.trace.resolve().parent} does not exist")
    except (UsageError, TopologyError, ValueError) as e:
        print(f"luwu mininet: {e}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"luwu-mininet-{run_id}-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    # the trace outlives a passing run's temporary run directory
    run_opts.trace_out = args.trace or (run_dir / "trace.json" if args.run_dir else
                                        Path(tempfile.gettempdir()) / f"luwu-mininet-{run_id}-trace.json")
    global _MAIN_PID
    _MAIN_PID = os.getpid()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    if args.action == "up":
        try:
            return _up(args, topo, spec, job, run_opts, run_dir)
        finally:
            signal.signal(signal.SIGTERM, previous)
    try:
        result = _execute(topo, spec, job, run_opts, run_dir, args.json)
    except KeyboardInterrupt:
        print(f"luwu mininet: interrupted; everything started was stopped (logs: {run_dir})", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    compared = None
    params = run_dir / "train-params-rank0.npz"
    if run_opts.workload == "train" and params.exists():  # the same training without network, here
        from .train_workload import compare

        compared = compare(params, args.seed, run_opts.steps, len(job.worker_host))
    info = summary(args, spec, job, run_opts, result, run_dir, compared)
    info["trace"] = result.trace
    info["metrics"] = result.metrics  # what served /metrics during the run (named on stderr while it ran)
    info["controller"] = ({"mode": "process", **result.controller} if run_opts.controller else
                          {"mode": "in-process", "why": _in_process_why(args) or "--controller in-process"})
    if args.json:
        print(json.dumps(info))
    else:
        print("\n".join(summary_lines(info)))
    if info["passed"] and args.run_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if info["passed"] else 1


def _up(args, topo, spec, job, run_opts: RunOptions, run_dir: Path) -> int:
    """`luwu mininet up`: everything up until Ctrl-C / SIGTERM / --duration, then torn down."""
    from rich.console import Console

    console = Console(stderr=True, quiet=args.json)

    def ready(info: dict) -> None:
        if args.json:
            print(json.dumps(info), flush=True)
            return
        print(f"luwu mininet up: {args.topo}, {len(job.worker_host)} worker(s), {run_opts.switch} switch(es) "
              f"{' '.join(info['switches'])}, run directory {run_dir}")
        for name, h in sorted(info["hosts"].items()):
            role = f"rank {h['rank']}" if "rank" in h else h["kind"]
            print(f"  {name} ({role}, {' '.join(h['addresses'])}"
                  + (f", management {h['management']}" if "management" in h else "") + f"): {h['enter']}"
                  + (f"   LUWU_PLAN={h['plan']}" if "plan" in h else "") + (f"   {h['join']}" if "join" in h else ""))
        for name, sw in sorted(info["switches"].items()):
            print(f"  switch {name}: {sw['ports']} ports, log {sw['log']}"
                  + (f", P4Runtime {sw['p4runtime']}" if sw["p4runtime"] else "")
                  + (f", metrics: curl -s {sw['metrics']}" if sw.get("metrics") else ""))
        ctl = info.get("controller")
        if ctl:
            print(f"  controller {ctl['address']} (job {ctl['job']}, admin token in {ctl['token_file']}, log "
                  f"{ctl['log']}): {ctl['luwu_ctl']}"
                  + (f"; metrics: curl -s {ctl['metrics']}" if ctl.get("metrics") else ""))
            for who, url in sorted(info.get("metrics", {}).items()):
                if who.startswith("node "):
                    print(f"  optimizer {who}: metrics: curl -s {url}")
            print("  torch on a worker host: <its LUWU_CONTROLLER=... line above> LUWU_ENGINE=embedded "
                  "python train.py  (init_process_group('luwu', ...) joins the job; docs/mininet.md); add "
                  "LUWU_METRICS=<its management address>:PORT to serve its engines' /metrics there")
        else:
            print("  torch on a worker host: LUWU_PLAN=<its plan> LUWU_ENGINE=embedded LUWU_P2P_HOST=<its address> "
                  "python train.py  (init_process_group('luwu', ...); docs/mininet.md)")
        print("Ctrl-C tears everything down.", flush=True)

    def wait() -> None:
        if args.duration > 0:
            time.sleep(args.duration)
        else:
            while True:
                time.sleep(3600)

    try:
        with console.status("luwu mininet up") as status:
            def progress(msg: str) -> None:
                status.update(f"luwu mininet: {msg}")
                console.log(msg)

            emu = Emulation(topo, spec, job, run_opts, run_dir, progress)
            status.stop()  # the wait is the user's time: no spinner
            leftovers = emu.up(ready, wait)
    except KeyboardInterrupt:
        leftovers = []  # the user ended it; teardown ran in up()'s finally
    except (ChildError, RuntimeError, OSError) as e:
        print(f"luwu mininet up: {e} (logs: {run_dir})", file=sys.stderr)
        return 1
    for left in leftovers:
        print(f"leftover: {left}", file=sys.stderr)
    print("luwu mininet up: torn down" if not args.json else json.dumps({"stopped": True, "leftovers": leftovers}),
          flush=True)
    return 0 if not leftovers else 1


def _execute(topo, spec, job, run_opts: RunOptions, run_dir: Path, quiet: bool) -> RunResult:
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    with console.status("luwu mininet") as status:
        def progress(msg: str) -> None:
            status.update(f"luwu mininet: {msg}")
            console.log(msg)

        return Emulation(topo, spec, job, run_opts, run_dir, progress).run()


def _interrupt(signum, frame):
    """SIGTERM: unwind through every `finally` (teardown) -- in this process only. A forked child
    that inherited the handler (pyroute2 forks to open namespace sockets) must just exit: unwinding
    there would run the parent's teardown from inside the child."""
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signum)
    raise KeyboardInterrupt
