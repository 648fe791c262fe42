"""`luwu-ctl`: read and steer a running controller (status, switches, nodes, jobs, plans, counters, drain).

Human-readable rich tables by default, one JSON document with `--json` (the proto3 JSON mapping:
field names as in controller.proto, 64-bit integers as strings). The controller comes
from `--controller HOST:PORT` or $LUWU_CONTROLLER, the token from `--token` or $LUWU_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from luwu.dataplane.process.usage import USAGE_EXIT, OneLineParser, UserError, positive_float
from luwu.proto import controller_pb2 as pb

from .client import ControllerClient, ControllerRefused, ControllerUnreachable

STATES = {v: k for k, v in pb.JobState.items()}
ROLES = {v: k for k, v in pb.SwitchRole.items()}


def _global_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """The flags every command takes, before or after the command's name (`luwu-ctl --json top` and
    `luwu-ctl top --json`); after it they default to SUPPRESS, so that they do not reset a value
    given before it."""
    def d(value):
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--controller", default=d(None), help="HOST:PORT of the controller (default $LUWU_CONTROLLER)")
    p.add_argument("--token", default=d(None), help="admin or job token (default $LUWU_TOKEN)")
    p.add_argument("--tls-ca", default=d(None), help="CA certificate (PEM) when the controller serves TLS")
    p.add_argument("--json", action="store_true", default=d(False),
                   help="print one JSON document instead of tables")


class _Version(argparse.Action):
    """--version: read only when asked (importlib.metadata costs ~60 ms), as luwu.__version__ does
    (that package is the application layer, above this one)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(f"luwu-ctl {version('luwu')}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="luwu-ctl", description="talk to a running luwu controller")
    p.add_argument("--version", action=_Version)
    _global_flags(p, defaults=True)
    common = OneLineParser(add_help=False)
    _global_flags(common, defaults=False)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, parents=[common])

    command("status", "controller summary")
    command("switches", "registered switches")
    command("nodes", "registered optimizer nodes")
    jobs = command("jobs", "jobs")
    jobs.add_argument("--all", action="store_true", help="include ended jobs")
    plan = command("plan", "a job's plan")
    plan.add_argument("job")
    plan.add_argument("--explain", action="store_true", help="say why: pools, tree, shard balance, and the "
                                                             "predicted iteration time and bottleneck")
    plan.add_argument("--link-gbps", type=positive_float, default=100.0,
                      help="each worker's and node's link for the prediction, Gbit/s each way (default 100)")
    plan.add_argument("--compute-s", type=positive_float, default=None,
                      help="the worker GPU's forward + backward seconds per iteration for the prediction "
                           "(e.g. from `luwu simulate`; default: network and optimizer nodes only)")
    plan.add_argument("--runtime-dir", default="", help="also write each switch's p4lang/tutorials runtime JSON "
                                                        "(SWITCH-runtime.json) into this folder")
    counters = command("counters", "switch counters read over P4Runtime")
    counters.add_argument("switch", nargs="?", default="")
    drain = command("drain", "stop placing new jobs on an optimizer node")
    drain.add_argument("node")
    end = command("end", "end a job and free its switch resources")
    end.add_argument("job")
    top = command("top", "live per-worker lag, throughput and drops; names a straggler "
                         "(controller/top_view.py)")
    top.add_argument("job", nargs="?", default="", help="one job (default: every live job; needs the admin token)")
    top.add_argument("--interval", type=positive_float, default=2.0,
                     help="seconds each frame covers (default 2.0)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    return p


def _dump(messages) -> object:
    if isinstance(messages, list):
        return [_dump(m) for m in messages]
    return json_format.MessageToDict(messages, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _prediction(args, client: ControllerClient, plan_json: str) -> dict | None:
    """planner.predict_iteration for the job's plan, with the nodes' registered params/s and the
    job's served dtype; {"unavailable": why} when the token may not read them."""
    from .plan import JobPlan
    from .planner import predict_iteration

    try:
        capacities = {n.name: n.capacity.params_per_second for n in client.nodes()}
        job = next((j for j in client.jobs(include_ended=True) if j.job_id == args.job), None)
    except ControllerRefused as exc:
        return {"unavailable": f"node capacities need the admin token ({exc})"}
    dtype = (job.optimizer.param_dtype if job is not None else "") or "bf16"
    out = predict_iteration(JobPlan.from_json(plan_json), capacities, args.link_gbps * 1e9 / 8,
                            param_bytes=4 if dtype == "fp32" else 2, compute_s=args.compute_s or 0.0)
    out["param_dtype"], out["compute_s"] = dtype, args.compute_s or 0.0
    return out


def _prediction_lines(p: dict | None) -> list[str]:
    if not p:
        return []
    if "unavailable" in p:
        return [p["unavailable"]]
    if not p["layers"]:
        return ["no layers are sharded to optimizer nodes (an allreduce-only job): nothing to predict"]
    gpu = (f"worker GPU {p['compute_s']:.3g} s" if p["compute_s"] > 0
           else "no GPU time given (--compute-s): network and optimizer nodes only")
    lines = [f"{p['iteration_s']:.4g} s per iteration, bottleneck: {p['bottleneck']} "
             f"({p['layers']} layers, {p['param_dtype']} pulls, {p['link_gbps']:.4g} Gbit/s links at "
             f"{100 * p['wire_efficiency']:.1f}% wire efficiency; {gpu})",
             "busy per iteration: " + ", ".join(f"{k} {v:.3g} s" for k, v in p["busy_s"].items())]
    if p["unknown_nodes"]:
        lines.append(f"no params/s registered for {', '.join(p['unknown_nodes'])}: their steps are not counted")
    return lines


def _ago(t: float) -> str:
    return f"{time.time() - t:.0f}s ago" if t else "-"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    try:
        client = ControllerClient(args.controller, args.token, args.tls_ca)
    except UserError as exc:
        print(f"luwu-ctl: {exc}", file=sys.stderr)
        return USAGE_EXIT
    try:
        return _run(args, client, console)
    except UserError as exc:
        print(f"luwu-ctl: {exc}", file=sys.stderr)
        return USAGE_EXIT
    except ControllerUnreachable as exc:
        print(f"luwu-ctl: {exc}", file=sys.stderr)
        return 3
    except ControllerRefused as exc:
        print(f"luwu-ctl: the controller refused: {exc}", file=sys.stderr)
        return 4
    finally:
        client.close()


def _run(args, client: ControllerClient, console: Console) -> int:
    cmd = args.command
    if cmd == "status":
        st = client.status()
        if args.json:
            print(json.dumps(_dump(st)))
            return 0
        t = Table(title="luwu controller", show_header=False)
        for k, v in (("version", st.version), ("switches up", f"{st.switches_up}/{st.switches}"),
                     ("nodes up", f"{st.nodes_up}/{st.nodes}"), ("active jobs", st.jobs_active),
                     ("uptime", f"{st.uptime:.0f} s"), ("database", st.db_path), ("epochs issued", st.epoch_counter)):
            t.add_row(k, str(v))
        console.print(t)
    elif cmd == "switches":
        switches = client.switches()
        if args.json:
            print(json.dumps(_dump(switches)))
            return 0
        t = Table(title="switches")
        for col in ("name", "role", "target", "p4runtime", "lanes", "slots", "ports", "health", "last seen", "jobs",
                    "programmed", "drift"):
            t.add_column(col)
        for s in switches:
            t.add_row(s.name, ROLES.get(s.role, "?").lower(), s.target, f"{s.p4runtime_address} dev {s.device_id}",
                      str(s.lanes), str(s.slots), str(len(s.ports)), s.health, _ago(s.last_seen), ", ".join(s.jobs),
                      s.programmed, s.drift or "none")
        console.print(t)
    elif cmd == "nodes":
        nodes = client.nodes()
        if args.json:
            print(json.dumps(_dump(nodes)))
            return 0
        t = Table(title="optimizer nodes")
        for col in ("name", "data address", "params/s", "RAM GiB", "disk GiB", "health", "last seen", "drained",
                    "jobs"):
            t.add_column(col)
        for n in nodes:
            c = n.capacity
            t.add_row(n.name, n.data_address, f"{c.params_per_second:.3g}", f"{c.ram_bytes / 2**30:.1f}",
                      f"{c.disk_bytes / 2**30:.1f}", n.health, _ago(n.last_seen), "yes" if n.drained else "no",
                      ", ".join(n.jobs))
        console.print(t)
    elif cmd == "jobs":
        jobs = client.jobs(include_ended=args.all)
        if args.json:
            print(json.dumps(_dump(jobs)))
            return 0
        t = Table(title="jobs")
        for col in ("job", "state", "workers", "joined", "mode", "switches", "nodes", "created"):
            t.add_column(col)
        for j in jobs:
            t.add_row(j.job_id, STATES.get(j.state, "?").lower(), str(j.num_workers), str(len(j.joined_ranks)),
                      j.packet_mode, ", ".join(j.switches), ", ".join(j.nodes), _ago(j.created))
        console.print(t)
    elif cmd == "plan":
        resp = client.plan(args.job)
        plan = json.loads(resp.plan_json)
        if args.runtime_dir:
            from .plan import JobPlan

            folder = Path(args.runtime_dir)
            folder.mkdir(parents=True, exist_ok=True)
            for name, program in JobPlan.from_json(resp.plan_json).programs.items():
                (folder / f"{name}-runtime.json").write_text(json.dumps(program.runtime_json(), indent=2) + "\n")
        prediction = _prediction(args, client, resp.plan_json) if args.explain or args.json else None
        if args.json:
            print(json.dumps({"plan": plan, "explanation": resp.explanation.splitlines(), "prediction": prediction}))
            return 0
        t = Table(title=f"plan of {args.job}")
        for col in ("session", "kind", "purpose", "group", "tree", "pool", "epoch", "node"):
            t.add_column(col)
        for s in plan["sessions"]:
            spec = s["spec"]
            pool = "fallback" if s["fallback"] else f"[{spec['pool_base']}, {spec['pool_base'] + spec['pool_size']})"
            t.add_row(str(spec["session"]), spec["kind"], spec["purpose"], str(s["group"]), " ".join(s["switches"]),
                      pool, str(spec["epoch"]), s["node"] or "-")
        console.print(t)
        if args.explain:
            console.print("[bold]why[/bold]")
            for line in resp.explanation.splitlines():
                console.print(f"  {line}")
            console.print("[bold]predicted iteration[/bold]")
            for line in _prediction_lines(prediction):
                console.print(f"  {line}")
    elif cmd == "counters":
        switches = client.counters(args.switch)
        if args.json:
            print(json.dumps(_dump(switches)))
            return 0
        for s in switches:
            if s.error:
                console.print(f"[red]{s.switch}: {s.error}[/red]")
                continue
            t = Table(title=f"counters of {s.switch} (non-zero)")
            for col in ("counter", "index", "meaning", "packets", "bytes"):
                t.add_column(col)
            for v in s.values:
                t.add_row(v.counter, str(v.index), v.label, str(v.packets), str(v.bytes))
            console.print(t)
    elif cmd == "drain":
        resp = client.drain(args.node)
        if args.json:
            print(json.dumps(_dump(resp)))
            return 0
        console.print(f"node {args.node} drained; jobs still using it: {', '.join(resp.affected_jobs) or 'none'}")
    elif cmd == "top":
        return _top(args, client, console)
    elif cmd == "end":
        job = client.end_job(args.job)
        if args.json:
            print(json.dumps(_dump(job)))
            return 0
        console.print(f"job {job.job_id} is {STATES.get(job.state, '?').lower()}")
    return 0


def _top(args, client: ControllerClient, console: Console) -> int:
    """Frames of `--interval` seconds each (two GetTop snapshots apart) until Ctrl-C, or one with --once."""
    from .top_view import frame, render

    def snap() -> dict:
        return json.loads(client.call("GetTop", pb.GetTopRequest(job_id=args.job)).top_json)

    before = snap()
    try:
        while True:
            time.sleep(args.interval)
            after = snap()
            view = frame(before, after)
            if args.json:
                print(json.dumps(view), flush=True)
            else:
                if not args.once and console.is_terminal:
                    console.clear()
                render(view, console)
            if args.once:
                return 0
            before = after
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
