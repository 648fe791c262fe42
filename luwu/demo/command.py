"""`luwu demo`: train a small GPT through a software switch and an in-network optimizer node on
loopback, then the same model, data and seed with DDP + Gloo + AdamW, and compare. `--model 125m|350m|custom`
trains an OPT-shaped transformers model instead, built on the meta device by the luwu workers
(hf_model.py); the report's memory block gives every process's own peak RSS (rss.py).

The switch's ports are shared-memory rings with 64 KiB (loopback-mode) packets where
`luwu.dataplane.loopback` supports them, else loopback UDP with jumbo packets (`--transport`,
`--packet-mode`); report.json (`control_plane.transport`, `settings`) and the summary say which ran.

Steps: start the fabric (controller, switch, optimizer node; fabric.py), create the job (the
controller plans it and programs the switch over P4Runtime), run N worker processes that join
the job and train with ModelInNetwork (live progress), read the switch counters and the node's
statistics, stop the fabric, run the DDP baseline, write report.json and the plots to --out,
print a summary. Every child process dies with the demo (launch.py), on errors and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from luwu.dataplane.engine.config import DEFAULT_GRAD_FORMAT, GRAD_FORMATS
from luwu.dataplane.loopback import TRANSPORTS, default_transport
from luwu.dataplane.net.shm_ring import supported as shm_supported
from luwu.dataplane.optimizer.spec import SERVED_DTYPES
from luwu.dataplane.process.usage import UserError, existing_file, positive_float, positive_int, probability, size

from .cpu import StepCpu
from .hf_model import DEFAULT_LR, DEFAULT_STEPS, SIZES
from .launch import WorkerGroup
from .progress import DemoProgress, human_bytes

RUN_TIMEOUT = 3600.0  # s a training run may take before the demo gives up
NODE_RAM = 256 << 20  # default --node-memory: bytes of RAM each optimizer node may use for state and served copies
CHECKPOINT_EVERY = 50  # steps between the optimizer node's lazy checkpoints
# packets per transport: on rings 16000-lane (64 KiB) packets trained 1.3x faster than jumbo ones here (2 cores;
# README "Measured here"): fewer packets, each one row copy; UDP keeps jumbo (loopback's 64 KiB datagrams unmeasured)
DEFAULT_PACKET_MODE = {"shm": "loopback", "udp": "jumbo"}
# where each worker's engine (its SmartNIC role) runs: a thread of the worker saves two processes' wake-ups and the
# control socket's round trips per pull and push (README "Measured here": ~11 ms of CPU per step, 8% more tokens/s
# on 2 cores), as in the torch backend's default; "process" keeps an engine daemon beside each worker
ENGINES = ("embedded", "process")
MODELS = ("tiny", *SIZES, "custom")  # the demo's GPT; OPT-shaped transformers models (hf_model.py)
TINY_DIMS = {"d_model": 128, "layers": 4, "heads": 4}  # --d-model, --layers, --heads when not given


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--model", choices=MODELS, default="tiny",
                   help="tiny: the demo's own GPT (default; --d-model/--layers/--heads size it); 125m, 350m: OPT-125m- "
                        "and OPT-350m-shaped transformers models; custom: an OPT of --d-model/--layers/--heads. The "
                        "OPT models are built on the meta device on the luwu workers (the network initialises them "
                        "unit by unit) and whole, to the same values, in the DDP baseline")
    p.add_argument("--vocab", type=positive_int, default=None,
                   help="the model's vocabulary (default: the corpus's characters; at least that many)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="activation checkpointing in every block, in both runs (OPT models only; default: on for "
                        "125m and 350m)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps (default " + ", ".join(f"{v} for {k}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--out", type=Path, default=Path("luwu-demo"), help="where report.json and the plots go")
    p.add_argument("--drop", type=probability, default=0.0, help="simulated packet loss on every switch port and "
                                                           "direction (e.g. 0.01); recovery keeps results exact")
    p.add_argument("--no-baseline", action="store_true", help="skip the DDP + Gloo baseline run")
    p.add_argument("--no-controller", action="store_true",
                   help="plan the loopback star without a controller (no P4Runtime, nothing for luwu-ctl)")
    p.add_argument("--nodes", type=positive_int, default=1, help="optimizer nodes; units are spread over them")
    p.add_argument("--node-memory", type=size, default=NODE_RAM, metavar="SIZE",
                   help="RAM each optimizer node may use for optimizer state and served copies (its --ram-budget; "
                        "past it the state goes out of core to the node's files), e.g. 512MiB (default 256MiB)")
    p.add_argument("--batch", type=positive_int, default=16, help="global batch (sequences per step, split over workers)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="AdamW learning rate (default " + ", ".join(f"{v:g} for {k}" for k, v in DEFAULT_LR.items())
                        + ")")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--d-model", type=positive_int, default=None, help="width of --model tiny or custom (default 128)")
    p.add_argument("--layers", type=positive_int, default=None, help="transformer blocks (tiny, custom; default 4)")
    p.add_argument("--heads", type=positive_int, default=None,
                   help="attention heads (tiny, custom; default 4; must divide --d-model)")
    p.add_argument("--context", type=positive_int, default=64, help="characters per training sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-dtype", choices=sorted(SERVED_DTYPES), default="bf16",
                   help="how the optimizer node serves parameters (the workers compute in fp32)")
    p.add_argument("--grad-format", choices=GRAD_FORMATS, default=DEFAULT_GRAD_FORMAT,
                   help="gradients on the wire: fixed32 (4 B/param) or fixed16 (16-bit values with an exponent per "
                        f"112 elements, ~2.06 B/param; docs/protocol.md 5.2). Default: {DEFAULT_GRAD_FORMAT}")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="how workers and nodes reach the switch: shm (shared-memory ring pairs, the default where "
                        "luwu.dataplane.loopback supports them: Linux x86-64 with /dev/shm) or udp (loopback sockets); "
                        "LUWU_TRANSPORT sets the default")
    p.add_argument("--engine", choices=ENGINES, default="embedded",
                   help="where each worker's engine runs: embedded (a thread of the worker, the default) or process "
                        "(an engine daemon beside it, as the torch backend runs it)")
    p.add_argument("--packet-mode", default=None,
                   help="tofino (64 lanes), jumbo (2048) or loopback (16000); default: "
                        + ", ".join(f"{mode} on {t}" for t, mode in DEFAULT_PACKET_MODE.items()))
    p.add_argument("--corpus", type=existing_file, default=None, help="a UTF-8 text file instead of the packaged corpus")
    p.add_argument("--checkpoint-every", type=positive_int, default=CHECKPOINT_EVERY, metavar="N",
                   help="the optimizer node takes a lazy checkpoint every N steps into OUT/checkpoints/NODE "
                        f"(default {CHECKPOINT_EVERY}; `luwu node --restore latest` resumes from the newest)")
    p.add_argument("--resume", action="store_true",
                   help="continue a run of the same settings from the optimizer nodes' newest common checkpoint in "
                        "OUT/checkpoints: the nodes restart with `luwu node --restore`, the workers at that step")
    p.add_argument("--quiet", action="store_true", help="no live progress (the summary is still printed)")


def _check(args) -> None:
    """Options that argparse's per-flag types cannot check alone (UserError: one line, exit 2)."""
    from luwu.dataplane.protocol import lanes_for_mode

    if not 1 <= args.workers <= 32:
        raise UserError("--workers must be 1..32 (one switch, one bitmap)")
    if args.batch % args.workers:
        raise UserError(f"--batch {args.batch} must be a multiple of --workers {args.workers}")
    if args.transport is None:
        try:
            args.transport = default_transport()
        except ValueError as exc:  # a bad LUWU_TRANSPORT
            raise UserError(str(exc)) from None
    elif args.transport == "shm" and not shm_supported():
        raise UserError("--transport shm: shared-memory rings need Linux on x86-64 with /dev/shm; use --transport udp")
    if args.packet_mode is None:
        args.packet_mode = DEFAULT_PACKET_MODE[args.transport]
    dims = [f"--{k.replace('_', '-')}" for k in TINY_DIMS if getattr(args, k) is not None]
    if args.model in SIZES and dims:
        raise UserError(f"--model {args.model} has fixed dimensions; for {' '.join(dims)} use --model custom")
    for k, v in TINY_DIMS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.checkpointing and args.model == "tiny":
        raise UserError("--checkpointing is for the OPT models (--model 125m, 350m or custom)")
    if args.checkpointing is None:
        args.checkpointing = args.model in SIZES
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.model]
    if args.lr is None:
        args.lr = DEFAULT_LR[args.model]
    if args.d_model % args.heads:
        raise UserError(f"--heads {args.heads} must divide --d-model {args.d_model} (each head gets d_model/heads)")
    try:
        lanes_for_mode(args.packet_mode)
    except ValueError as exc:
        raise UserError(f"--packet-mode: {exc}") from None


def _resume_point(args) -> dict | None:
    """With --resume: {"job_id", "version", "paths": {node: checkpoint dir}} of the newest version every
    node has a committed checkpoint of (UserError saying what is missing otherwise)."""
    import json

    from luwu.dataplane.optimizer.checkpoint_files import checkpoint_dirs

    if not args.resume:
        return None
    if args.no_controller:
        raise UserError("--resume needs the controller path (drop --no-controller)")
    found: dict[str, dict[int, tuple[str, Path]]] = {}
    for i in range(args.nodes):
        name, root = f"node{i}", args.out.resolve() / "checkpoints" / f"node{i}"
        for _, path in checkpoint_dirs(root) if root.is_dir() else []:
            try:
                job = json.loads((path / "manifest.json").read_text())["jobs"][0]
                versions = {int(layer["version"]) for layer in job["state"]}
            except (OSError, ValueError, KeyError, IndexError):
                continue  # interrupted or unreadable: not a resume point
            if len(versions) == 1:
                found.setdefault(name, {})[versions.pop()] = (job["spec"]["job_id"], path)
    common = set.intersection(*(set(found.get(f"node{i}", {})) for i in range(args.nodes)))
    if not common:
        raise UserError(f"--resume: no checkpoint version that every node has in {args.out / 'checkpoints'} "
                        "(run the demo with the same --out and --nodes first)")
    version = max(common)
    if version >= args.steps:
        raise UserError(f"--resume: the checkpoints are at step {version}; ask for more --steps than that")
    jobs = {found[name][version][0] for name in found if version in found[name]}
    return {"job_id": jobs.pop(), "version": version, "paths": {n: found[n][version][1] for n in found}}


def _spec(args, mode: str) -> dict:
    return {"mode": mode, "workers": args.workers, "steps": args.steps, "batch": args.batch, "lr": args.lr,
            "weight_decay": args.weight_decay, "seed": args.seed, "served_dtype": args.served_dtype,
            "grad_format": args.grad_format,
            "engine": args.engine, "corpus": str(args.corpus) if args.corpus else None,
            "model": args.model_spec}


def _model_info(args) -> dict:
    """Unit sizes for the job (layers the controller shards), from the same model the workers build."""
    from luwu.worker.model_in_network.units import split_units

    from .data import CharCorpus
    from .model import GPTConfig, build

    try:
        corpus = CharCorpus.load(args.corpus)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--corpus {args.corpus}: cannot read it as UTF-8 text ({exc})") from None
    if len(corpus.tokens) <= args.context + 1:
        raise UserError(f"--corpus has {len(corpus.tokens)} characters, fewer than --context {args.context} + 2")
    vocab = args.vocab or corpus.vocab
    if vocab < corpus.vocab:
        raise UserError(f"--vocab {vocab} is smaller than the corpus's {corpus.vocab} characters")
    if args.model == "tiny":
        cfg = GPTConfig(vocab=vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                        context=args.context)
        units = split_units(build(cfg, args.seed))
        config, how = cfg.to_dict(), {"family": "gpt", "luwu_build": "whole, seeded", "ddp_build": "whole, seeded",
                                      "initial_values": "the same in both runs (one generator seeded --seed)"}
        args.model_spec = {"kind": "gpt", "d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                           "context": args.context, **({"vocab": vocab} if args.vocab else {})}
    else:
        from . import hf_model

        config = hf_model.config_dict(args.model, vocab, args.context, args.d_model, args.layers, args.heads)
        units = split_units(hf_model.build(config, meta=True))  # shapes only: the demo never holds it either
        args.model_spec = {"kind": "opt", "config": config, "context": args.context,
                           "checkpointing": bool(args.checkpointing)}
        how = {"family": "opt", "luwu_build": "meta (ModelInNetwork initialises it unit by unit)",
               "ddp_build": "whole, then set to the network's initial values unit by unit",
               "initial_values": "the same in both runs: unit i by its modules' own init under seed --seed + i "
                                 "(worker/model_in_network/materialize.py)"}
    numel = sum(u.numel for u in units)
    return {"name": args.model, **how, "activation_checkpointing": bool(args.checkpointing), "config": config,
            "parameters": numel, "bytes_fp32": 4 * numel, "largest_unit_numel": max(u.numel for u in units),
            "served_itemsize": SERVED_DTYPES[args.served_dtype].itemsize,
            "units": [{"layer_id": u.index, "module": u.label(), "numel": u.numel} for u in units],
            "corpus_characters": len(corpus.tokens)}


def _train(name: str, spec: dict, workdir: Path, progress: DemoProgress, in_network: bool,
           console: Console | None = None, cpu: StepCpu | None = None) -> dict[int, dict]:
    on_step, _ = progress.run(name, spec["steps"] - spec.get("start_step", 0), spec["workers"], in_network)
    said: set[str | None] = set()

    def on_message(msg: dict) -> None:
        if msg.get("event") == "metrics" and console is not None:  # a worker's endpoint, once it is serving
            from .fabric import metrics_line

            who = f"worker {msg.get('rank')}"
            console.print(f"  {metrics_line(who, str(msg.get('address')))}", soft_wrap=True)
        if msg.get("event") == "warning" and console is not None and msg.get("state") not in said:
            said.add(msg.get("state"))  # one line per change, not one per worker
            console.print(f"[yellow]{msg.get('message')}[/]")
        if cpu is not None:
            cpu.on_message(msg)
        on_step(msg)

    group = WorkerGroup(spec, workdir, name.split()[0].lower(), on_message).start()
    try:
        return group.wait(RUN_TIMEOUT)
    finally:
        group.stop()


def run(args) -> int:
    _check(args)
    console = Console()
    out = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot create it ({exc.strerror})") from None
    info = _model_info(args)
    resume = _resume_point(args)  # before the run: a missing checkpoint is the user's mistake (exit 2)
    tokens_per_step = args.batch * args.context
    shape = (f"GPT ({args.layers} blocks, d_model {args.d_model}" if args.model == "tiny" else
             f"OPT {args.model} ({info['config']['num_hidden_layers']} blocks, hidden {info['config']['hidden_size']}, "
             f"vocab {info['config']['vocab_size']}, {'activation checkpointing, ' if args.checkpointing else ''}"
             "built on meta by the luwu workers")
    console.print(f"[bold]luwu demo[/]: a {info['parameters']:,}-parameter {shape}, context {args.context}) on "
                  f"{info['corpus_characters']:,} characters, {args.workers} workers, {args.steps} steps "
                  f"(--steps), node memory {human_bytes(args.node_memory)}"
                  + (f", {args.drop:.1%} simulated loss" if args.drop else ""))
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a terminated demo still stops what it started
    # and an interrupted one, even when started with SIGINT ignored (a shell's background job, nohup
    # from a script): Python then leaves it ignored, and a SIGINT sent to the demo did nothing at all
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with tempfile.TemporaryDirectory(prefix="luwu-demo-") as tmp:
            try:
                report = _run(args, console, Path(tmp), info, tokens_per_step, resume)
            except Exception as e:  # noqa: BLE001 - the logs outlive the run; the message points at the copies
                if type(e) not in (RuntimeError, TimeoutError):
                    raise
                raise type(e)(_keep_logs(str(e), Path(tmp), out)) from e
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every process the demo started has been stopped[/]")
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line; the logs say more
        console.print(f"[red]luwu demo failed:[/] {e}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    paths = report.pop("_paths")
    _summary(console, report, paths, out)
    return 0


def _keep_logs(message: str, workdir: Path, out: Path) -> str:
    """Copy the run's logs from the temporary workdir to OUT/logs; the message, pointing at them."""
    import re
    import shutil

    for log in workdir.rglob("*.log"):
        dest = out / "logs" / log.relative_to(workdir)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, dest)
        except OSError:
            continue
    return re.sub(re.escape(str(workdir)) + r"(/\S+?\.log)", lambda m: str(out / "logs") + m.group(1), message)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _start_fabric(args, console: Console, workdir: Path, info: dict, resume: dict | None = None):
    from .fabric import ControllerFabric, LocalFabric

    fabric: ControllerFabric | LocalFabric
    layers = [(u["layer_id"], u["numel"]) for u in info["units"]]
    optimizer = {"name": "adamw", "params": {"lr": args.lr, "weight_decay": args.weight_decay}}
    kw = dict(workers=args.workers, nodes=args.nodes, lanes=args.packet_mode, drop=args.drop, seed=args.seed,
              node_ram=args.node_memory, transport=args.transport)
    if not args.no_controller:
        fabric = ControllerFabric(workdir / "fabric", checkpoints=args.out.resolve() / "checkpoints",
                                  checkpoint_every=args.checkpoint_every, restore=resume, **kw)
        (workdir / "fabric").mkdir()
        try:
            return fabric.start(layers, optimizer, args.served_dtype), {"kind": "controller",
                                                                       "transport": args.transport}
        except BaseException as e:  # noqa: BLE001 - the demo still runs, and says why it fell back
            fabric.stop()
            if not isinstance(e, Exception):
                raise
            console.print(f"[yellow]the controller path failed ({e}); falling back to the embedded plan "
                          "(no controller)[/]")
            reason = str(e)
    else:
        reason = "--no-controller"
    fabric = LocalFabric(workdir, **kw)
    try:
        return fabric.start(layers, optimizer, args.served_dtype), {"kind": "embedded", "reason": reason,
                                                                   "transport": args.transport}
    except BaseException:
        fabric.stop()
        raise


def _run(args, console: Console, workdir: Path, info: dict, tokens_per_step: int, resume: dict | None) -> dict:
    from luwu.dataplane.observe import trace

    from . import prediction
    from . import report as rep

    # every process the demo starts (workers, switch, nodes) writes its timeline here (inherited)
    os.environ[trace.ENV] = str(workdir / "trace")
    t0 = time.perf_counter()
    if resume is not None:
        console.print(f"resuming job {resume['job_id']} at step {resume['version']} from "
                      + ", ".join(str(p) for p in resume["paths"].values()))
    fabric, control = _start_fabric(args, console, workdir, info, resume)
    if resume is not None and control["kind"] != "controller":
        fabric.stop()
        raise RuntimeError(f"--resume needs the controller path, which failed: {control.get('reason')}")
    try:
        console.print(f"network up in {time.perf_counter() - t0:.1f} s ({control['kind']} control plane, "
                      f"{control['transport']} ports, {args.packet_mode} packets); inspect "
                      f"it while it runs with:\n  {fabric.inspect_hint()}")
        cpu_luwu = StepCpu(args.steps)
        with DemoProgress(console, enabled=not args.quiet) as progress:
            start = resume["version"] if resume else 0
            mnn = _train("luwu (in-network)", dict(_spec(args, "mnn"), start_step=start, metrics="127.0.0.1:0",
                                                   **fabric.worker_spec()),
                         workdir, progress, True, console, cpu_luwu)
        # nothing below may lose the training run: a part that cannot be read is named in the report
        counters = fabric.counters()
        planned = prediction.capture(fabric, args.served_dtype)  # the plan and the nodes' rates, while they run
        try:
            nodes = fabric.node_stats()
        except (OSError, RuntimeError, ValueError) as exc:
            nodes = []
            fabric.notes.append(f"optimizer_nodes missing: their control channels did not answer ({exc})")
        node_rss = fabric.node_peak_rss()  # VmHWM of the nodes' processes, while they still run
    finally:
        fabric.stop()
    if hasattr(fabric, "checkpoint_summary"):
        control["checkpoints"] = fabric.checkpoint_summary()
    if resume is not None:
        control["resumed_from"] = {"step": resume["version"], "checkpoints": {n: str(p) for n, p in
                                                                           resume["paths"].items()}}
    control = dict(control, notes=list(getattr(fabric, "notes", [])), restart=list(getattr(fabric, "restart", [])),
                   controller_events={r: rep_.get("controller_events", []) for r, rep_ in sorted(mnn.items())
                                      if rep_.get("controller_events")})
    ddp = None
    cpu_ddp = StepCpu(args.steps)
    if not args.no_baseline:
        with DemoProgress(console, enabled=not args.quiet) as progress:
            # the ranks meet in a file, not on a TCP port picked free beforehand: such a port can be taken
            # between the pick and rank 0's listen, or a rank's own retried connect can land on it (a TCP
            # self-connect), and gloo's rendezvous then waited for ever (issue 26: one full-suite run in four)
            spec = dict(_spec(args, "ddp"), init_method=(workdir / "ddp-store").resolve().as_uri())
            ddp = _train("DDP + Gloo baseline", spec, workdir, progress, False, cpu=cpu_ddp)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("func", "model_spec")}
    report = rep.build(settings, control, mnn, ddp, info, counters, nodes, tokens_per_step)
    from .rss import block

    report["memory"] = block(mnn, ddp, node_rss, args.node_memory, args.engine)  # peak RSS of every process
    report["prediction"] = prediction.compare(planned, mnn)  # the plan's iteration time against the measured one
    # CPU seconds per steady step of every process, by role (luwu/demo/cpu.py); None: too few steps
    report["cpu_per_step"] = {"luwu": cpu_luwu.result(), "ddp": cpu_ddp.result() if ddp else None}
    # one Chrome trace (Perfetto) of the run, every process on one clock (docs/observability.md)
    trace_path = trace.merge(workdir / "trace", Path(args.out) / "trace.json")
    timeline_png = _critical_path(report, trace_path, Path(args.out))
    report["_paths"] = rep.write({k: v for k, v in report.items() if k != "_paths"}, args.out)
    report["_paths"] += [*timeline_png, trace_path]
    return report


def _critical_path(report: dict, trace_path: Path, out: Path) -> list[Path]:
    """report["critical_path"] and critical_path.png for one steady-state iteration of the trace
    (dataplane/observe/critical_path.py); a trace that cannot say is a note in the report, not a failure."""
    import json

    from luwu.dataplane.observe import critical_path

    from . import timeline

    events = json.loads(trace_path.read_text())["traceEvents"]
    try:
        report["critical_path"] = critical_path.analyse(events)
    except ValueError as exc:
        report["control_plane"].setdefault("notes", []).append(f"critical_path missing: {exc}")
        return []
    return [timeline.plot(events, report["critical_path"], out / "critical_path.png")]


def _summary(console: Console, report: dict, paths: list[Path], out: Path) -> None:
    luwu, ddp, t = report["luwu"], report.get("ddp"), report["traffic"]
    table = Table(title="luwu demo: summary", show_lines=False)
    table.add_column("")
    table.add_column("luwu (switch + optimizer node)", justify="right")
    table.add_column("DDP + Gloo + AdamW", justify="right")
    mem = luwu["memory"]
    table.add_row("transport", f"{report['control_plane'].get('transport', '?')} ports, "
                  f"{report['settings'].get('packet_mode')} packets, "
                  + ("engine daemons" if report["settings"].get("engine") == "process" else "engines in the workers"),
                  "Gloo over TCP" if ddp else "-")
    table.add_row("final loss", f"{luwu['final_loss']:.4f}", f"{ddp['final_loss']:.4f}" if ddp else "-")
    table.add_row("tokens/s (median)", f"{_median(luwu['tokens_per_second']):,.0f}",
                  f"{_median(ddp['tokens_per_second']):,.0f}" if ddp else "-")
    held = max(m["peak_bytes"] for m in mem.values())
    ddp_held = max(m["state_bytes"]["total"] for m in ddp["memory"].values()) if ddp else None
    table.add_row("worker model state held (peak)", human_bytes(held),
                  human_bytes(ddp_held) if ddp_held is not None else "-")
    rss = report["memory"]
    lw, dw = rss["luwu_worker_peak_rss_bytes"], rss["ddp_worker_peak_rss_bytes"]
    table.add_row("worker peak RSS, VmHWM" + (" (with its engine)" if report["settings"].get("engine") != "process"
                                              else ""),
                  human_bytes(lw) if lw is not None else "?", human_bytes(dw) if dw is not None else "-")
    for name, n in rss["nodes"].items():
        table.add_row(f"optimizer {name} peak RSS / --node-memory",
                      f"{human_bytes(n['peak_rss_bytes']) if n['peak_rss_bytes'] else '?'} / "
                      f"{human_bytes(n['budget_bytes'])}", "-")
    m, f = t["luwu_measured_per_step"], t["fsdp_per_step"]
    table.add_row("traffic per worker per step, in / out", f"{human_bytes(m['in'])} / {human_bytes(m['out'])}",
                  f"FSDP would: {human_bytes(f['in'])} / {human_bytes(f['out'])}")
    if "push_bytes_per_param" in t:
        table.add_row(f"bytes per parameter, pull / push ({report['settings'].get('grad_format') or DEFAULT_GRAD_FORMAT})",
                      f"{t['pull_bytes_per_param']:.2f} / {t['push_bytes_per_param']:.2f}", "-")
    cpu = report.get("cpu_per_step") or {}
    if cpu.get("luwu"):
        lc, dc = cpu["luwu"], cpu.get("ddp")
        parts = ", ".join(f"{k} {v * 1000:.0f}" for k, v in lc.items() if k not in ("total", "steps") and v >= 0.0005)
        table.add_row("CPU per step, all processes (ms)", f"{lc['total'] * 1000:.0f} ({parts})",
                      f"{dc['total'] * 1000:.0f}" if dc else "-")
    console.print(table)
    console.print(f"model: {human_bytes(report['model']['bytes_fp32'])} fp32 in {luwu['units']} units. A luwu worker "
                  f"held at most {human_bytes(held)} of it at once (parameters in flight, gradients, staging; no "
                  "optimizer state)" + (f"; a DDP worker {human_bytes(ddp_held)} (parameters, gradients, AdamW "
                                        "state)." if ddp_held is not None else "."))
    from .prediction import summary_line

    if summary_line(report):
        console.print(summary_line(report))
    for line in _anomalies(report):
        console.print(f"[bold red]{line}[/]")
    if report["control_plane"]["kind"] != "controller":
        console.print(f"[yellow]control plane: embedded StarPlan ({report['control_plane'].get('reason')})[/]")
    for note in report["control_plane"].get("notes", []):
        console.print(f"[yellow]report: {note}[/]")
    # restart[i] restarts the i-th node of checkpoints (both in the fabric's node order); a restore
    # command is printed only where there is a checkpoint to restore
    restart = report["control_plane"].get("restart", [])
    every = report["settings"]["checkpoint_every"]
    for i, (name, ck) in enumerate(report["control_plane"].get("checkpoints", {}).items()):
        if ck.get("newest") is None:
            console.print(f"optimizer node {name}: no checkpoint yet in {ck['dir']} (lazy checkpoints every {every} "
                          "steps; a longer run, or a smaller --checkpoint-every, writes one)")
            continue
        console.print(f"optimizer node {name}: lazy checkpoints every {every} steps in {ck['dir']} (newest: version "
                      f"{ck['version']}); a node restarted from it serves the job from that version on "
                      "(docs/optimizer.md):")
        if i < len(restart):
            console.print(f"  {restart[i]}", soft_wrap=True)
    cp = report.get("critical_path")
    if cp:
        top = sorted(cp["share"].items(), key=lambda kv: -kv[1])[:4]
        console.print(f"critical path of step {cp['iteration']} ({cp['seconds'] * 1000:.0f} ms): "
                      + ", ".join(f"{k} {v:.0%}" for k, v in top) + " (critical_path.png)")
    console.print(f"wrote {out / 'report.json'} and " + ", ".join(p.name for p in paths))


def _anomalies(report: dict) -> list[str]:
    """What makes this run's loss not the plain data-parallel one, said out loud (never silent):
    steps an optimizer node skipped for a unit (a non-finite or saturated summed gradient, as
    torch's GradScaler skips a step) and fixed-point sums the switch marked SATURATED."""
    luwu, out = report["luwu"], []
    skipped = luwu.get("skipped_steps") or {}
    if skipped:
        steps = sorted(int(s) for s in skipped)
        shown = ", ".join(f"{s} ({', '.join(skipped[s] if s in skipped else skipped[str(s)])})" for s in steps[:5])
        out.append(f"the optimizer nodes skipped {len(steps)} step(s) for some unit because its summed gradient was "
                   f"non-finite or saturated: {shown}{' ...' if len(steps) > 5 else ''}; the loss is not DDP's "
                   "(report.json luwu.skipped_steps; docs/protocol.md 5.1)")
    if luwu.get("saturated_sums"):
        out.append(f"the switch marked {luwu['saturated_sums']} fixed-point sum packet(s) SATURATED (a contributor "
                   "held inf/NaN or a value its chunk's exponent could not hold); those sums were not used as numbers")
    return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0
