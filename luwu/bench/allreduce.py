"""`luwu bench allreduce`: what `dist.all_reduce` costs through the luwu backend against Gloo, and
(`--engine`) what the engine alone costs, as a diagnostic.

By default it measures through torch (`torch_sweep.py`): spawned ranks calling `dist.all_reduce`
on tensors of a sweep of sizes (`--sizes`, default 1 KiB to 64 MiB in powers of 4: what DDP's
buckets see), the `luwu` backend and Gloo in the same run; per size it prints
`allreduce_<size>_luwu_ms`, `allreduce_<size>_gloo_ms` and `allreduce_<size>_ratio_to_gloo`
(Gloo's time over luwu's), plus the init times below; `--out DIR` writes allreduce.json and a PNG
of time against size. `--mode` and `--transport shm|udp` set the backend's LUWU_MODE and
LUWU_TRANSPORT.

`--engine`: N workers sum a tensor (`--size`) through the software switch with the engine itself
(no torch), next to the baselines a user would compare with, all measured in the same run:

* Gloo allreduce (torch.distributed) on the same sizes and worker counts;
* the raw UDP ceiling of a Python datapath here (`udp_ceiling.py`): a do-nothing relay with the
  same packet size, batching and window;
* how long the ranks wait for `init_process_group` and a `new_group` (`init_s`, `new_group_s`,
  the slowest rank's; `setup_times.py`), and for the first one-element all_reduce after it
  (`first_allreduce_s`: luwu's init returns before its start-up, which that call waits for), with
  the luwu backend and with Gloo (`gloo_init_s`, `gloo_first_allreduce_s`, `gloo_new_group_s`);
  `--no-setup` skips it.

luwu runs twice: over the loopback default transport (shared-memory rings between the workers'
engines and the switch, `luwu` / `ratio_to_gloo`) and over UDP sockets (`luwu_udp` /
`ratio_to_gloo_udp`, `fraction_of_udp_ceiling`). CPU cost is `*cpu_s_per_gb`: CPU seconds of
every process involved (workers with their engines, and the switch) during the timed
iterations, per GB of one worker's buffer reduced -- robust on a shared machine, where wall
time is not; the relay's (`udp_ceiling_cpu_s_per_gb`, senders and relay alike) is what moving
the bytes over UDP costs before any aggregation (`cpu_ratio_to_udp_ceiling` for the UDP run).
`cores_busy` (and `gloo_cores_busy`) is those CPU seconds over the timed iterations' wall time:
how many of the machine's `cores` the run kept busy on average. With as much CPU per GB as Gloo,
a run that keeps fewer cores busy (waiting on the switch process, or on wake-ups the scheduler
places behind busy processes) is that much slower. `retransmit_fraction` is the share of the
workers' packets sent more than once: with no simulated loss, every resend is a timeout that fired
early. Each worker's results are
decoded into one reused buffer (`Engine.allreduce(out=)`), as the torch backend's engine daemon
decodes into the rank's buffer and as Gloo reduces in place.

Prints grep-able `key: value` lines (goodput in GB/s of the reduced buffer, ratio to Gloo,
fraction of the UDP ceiling, CPU per GB), `--json` prints one JSON object, `--verify` checks every element
(int32: bit-exact; float32: within the documented fixed-point bound), `--out DIR` writes JSON and
a PNG.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from luwu.bench import allreduce_check, rendezvous
from luwu.bench.sizes import format_size, parse_size
from luwu.bench.udp_ceiling import measure as measure_ceiling
from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.process.children import cpu_seconds as proc_cpu
from luwu.dataplane.process.usage import UserError, positive_int, probability, size
from luwu.dataplane.protocol import Dtype, aggregation_packet_len, lanes_for_mode


def add_arguments(p) -> None:
    p.add_argument("--workers", type=positive_int, default=4, help="number of workers (1..32)")
    p.add_argument("--engine", action="store_true",
                   help="measure the engine alone (no torch; a diagnostic) instead of dist.all_reduce")
    p.add_argument("--sizes", type=_size_list, default=None,
                   help="through torch: comma-separated bytes per rank, e.g. 1KiB,1MiB,16MiB "
                        "(default 1KiB to 64MiB in powers of 4)")
    p.add_argument("--size", type=size, default=None,
                   help="bytes per worker buffer (float32), e.g. 4MiB, 64MiB (--engine: default 16MiB; "
                        "through torch: the one size of the sweep)")
    p.add_argument("--mode", default="loopback",
                   help="packet mode: tofino (64 lanes), jumbo (2048), loopback (16000, 64 KiB datagrams; the default)")
    p.add_argument("--iters", type=positive_int, default=20,
                   help="timed allreduces per size (after one warm-up; a 16 MiB one lasts tens of ms, so a few are noise)")
    p.add_argument("--dtype", choices=["float32", "int32"], default="float32")
    p.add_argument("--warmup", type=_seconds, default=3.0,
                   help="through torch: seconds of all_reduce calls before the sweep (the engine and switch "
                        "load their compiled kernels in the background after start-up)")
    p.add_argument("--drop", type=probability, default=0.0,
                   help="--engine: simulated loss probability on every switch port")
    p.add_argument("--verify", action="store_true", help="check every element of every result")
    p.add_argument("--no-gloo", action="store_true", help="skip the Gloo baseline")
    p.add_argument("--no-ceiling", action="store_true", help="--engine: skip the raw UDP ceiling")
    p.add_argument("--no-setup", action="store_true",
                   help="skip timing init_process_group and new_group (luwu and Gloo, setup_times.py)")
    p.add_argument("--transport", choices=["both", "shm", "udp"], default="both",
                   help="luwu transports to measure: shared memory (the loopback default), UDP, or both "
                        "(through torch: the backend's LUWU_TRANSPORT; both = its default)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key: value lines")
    p.add_argument("--out", type=Path, help="directory for allreduce.json and allreduce.png")
    p.add_argument("--grad-format", choices=["fixed16", "fixed32", "both"], default=None,
                   help="compare float-sum wire formats through torch: ms and CPU ms per call of every "
                        "process of the job, per format in one run, and the encode/decode kernels' s/GB "
                        "(grad_format.py)")


def _size_list(text: str) -> list[int]:
    """`--sizes`: comma-separated sizes (argparse type: a bad one is one line and exit 2)."""
    import argparse

    try:
        out = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not out or min(out) < 4:
        raise argparse.ArgumentTypeError(f"{text!r}: needs sizes of at least 4 bytes (one float32)")
    return out


def _seconds(text: str) -> float:
    """`--warmup`: seconds, zero or more."""
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= v <= 600:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 to 600 seconds")
    return v


def _luwu_worker(plan, rank, numel, dtype, iters, verify, barrier, out_q, switch_pid=0) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from luwu.dataplane.engine import Engine

    x = allreduce_check.inputs(rank, numel, dtype)
    y = np.empty_like(x)  # results are decoded into it, as the torch backend's engine daemon does (in place)
    times, result = [], None
    from luwu.dataplane import kernels

    with Engine(plan.worker_plan(rank)) as eng:
        kernels.wait_loaded(120)  # the steady state: compiled kernels, not the reference they start on
        _observe(eng, rank)
        for i in range(iters + 1):
            barrier.wait()
            if i == 1:  # CPU of the timed iterations only (the warm-up maps pages, fills caches)
                cpu0, sw0 = time.process_time(), proc_cpu(switch_pid) if rank == 0 and switch_pid else 0.0
            t0 = time.perf_counter()
            result = eng.allreduce(x, "sum", out=y).wait(300)
            if i:
                times.append(time.perf_counter() - t0)
        barrier.wait()
        report = {"rank": rank, "times": times, "stats": eng.session_stats(), "cpu_s": time.process_time() - cpu0}
        if rank == 0 and switch_pid:
            report["switch_cpu_s"] = proc_cpu(switch_pid) - sw0
    if verify and rank == 0:
        if result is None:  # iters + 1 >= 1 allreduces ran
            raise AssertionError("no allreduce result to verify")
        # elements per packet: its last lanes are check words (docs/protocol.md 3.6)
        report["verify"] = allreduce_check.verify(result, plan.workers, numel, dtype, data_lanes(plan.lanes, Dtype.FIXED32))
    out_q.put(report)


def _observe(engine, rank: int) -> None:
    """With LUWU_METRICS (`luwu bench observability` sets it), serve the engine's statistics as a
    torch worker's do (worker/metrics.py); with LUWU_TRACE_DIR, trace this worker."""
    from luwu.dataplane.observe import trace

    trace.start(f"worker {rank} (bench)")
    if os.environ.get("LUWU_METRICS"):
        from luwu.worker import metrics

        class _Link:  # what worker/metrics.py reads: the engine's statistics at scrape time
            def stats(self) -> dict:
                return engine.session_stats()

        _observe.link = _Link()  # type: ignore[attr-defined] # held for the process's life (tracked weakly)
        metrics.track(f"rank{rank}-bench", _observe.link, rank)  # type: ignore[attr-defined]


def retransmits(engine_stats: dict) -> dict:
    """Packets the workers' engines sent and resent (every session's send stream), and the
    fraction resent: on a loss-free loopback, every resend is a spurious timeout."""
    streams = [v["send_stream"] for st in engine_stats.values() for k, v in st.items()
               if k.startswith("session") and "send_stream" in v]
    tot = {k: sum(s.get(k, 0) for s in streams) for k in ("packets", "retransmitted", "timeouts", "fast_retransmits")}
    tot["fraction"] = tot["retransmitted"] / tot["packets"] if tot["packets"] else 0.0
    return tot


def run_luwu(workers: int, numel: int, dtype: str, mode: str, iters: int, verify: bool, drop: float,
             transport: str | None = None) -> dict:
    from luwu.dataplane.loopback import LoopbackSwitch, StarPlan

    plan = StarPlan(workers=workers, mode=mode, transport=transport) if transport else StarPlan(workers=workers, mode=mode)
    ctx = mp.get_context("spawn")
    drops = {"ingress": drop, "egress": drop} if drop else None
    with LoopbackSwitch(plan, process=True, drop=drops, seed=7) as sw:
        sw.wait_kernels()
        barrier, out_q = ctx.Barrier(workers), ctx.Queue()
        procs = [ctx.Process(target=_luwu_worker, args=(plan, r, numel, dtype, iters, verify, barrier, out_q, sw.pid))
                 for r in range(workers)]
        for p in procs:
            p.start()
        reports = [out_q.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(30)
        counters = sw.counters()
    per_iter = np.max([r["times"] for r in reports], axis=0)
    cpu = {"workers": sum(r["cpu_s"] for r in reports), "switch": sum(r.get("switch_cpu_s", 0.0) for r in reports)}
    gb = iters * numel * 4 / 1e9
    out = {"transport": plan.transport, "seconds": per_iter.tolist(), "best_s": float(per_iter.min()),
           "median_s": float(np.median(per_iter)), "cpu_s": cpu, "cpu_s_per_gb": (cpu["workers"] + cpu["switch"]) / gb,
           "cores_busy": (cpu["workers"] + cpu["switch"]) / float(per_iter.sum()),
           "counters": counters, "engine_stats": {r["rank"]: r["stats"] for r in reports}}
    out["retransmits"] = retransmits(out["engine_stats"])
    for r in reports:
        if "verify" in r:
            out["verify"] = r["verify"]
    return out


def _gloo_worker(rank, workers, store, numel, iters, barrier, out_q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rendezvous.init_group("gloo", store, rank, workers)
    t = torch.from_numpy(allreduce_check.inputs(rank, numel, "float32"))
    times = []
    for i in range(iters + 1):
        dist.barrier()
        if i == 1:
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    cpu = time.process_time() - cpu0
    dist.destroy_process_group()
    out_q.put((times, cpu))


def run_gloo(workers: int, numel: int, iters: int) -> dict:
    from luwu.bench.rendezvous import host_store

    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with host_store() as store:  # rendezvous.py: the store binds port 0, no race
        procs = [ctx.Process(target=_gloo_worker, args=(r, workers, store, numel, iters, None, out_q))
                 for r in range(workers)]
        for p in procs:
            p.start()
        got = [out_q.get(timeout=900) for _ in procs]
        times = np.max([t for t, _ in got], axis=0)
        for p in procs:
            p.join(30)
    cpu = sum(c for _, c in got)
    return {"seconds": times.tolist(), "best_s": float(times.min()), "median_s": float(np.median(times)),
            "cpu_s": cpu, "cpu_s_per_gb": cpu / (iters * numel * 4 / 1e9), "cores_busy": cpu / float(times.sum())}


def run(args) -> int:
    if args.grad_format:
        from luwu.bench import grad_format

        return grad_format.run(args)
    if not args.engine:
        return run_torch(args)
    if args.sizes is not None:
        raise UserError("--sizes is for the sweep through torch; --engine measures one --size")
    nbytes = parse_size(args.size or "16MiB")
    numel = nbytes // 4
    try:
        lanes = lanes_for_mode(args.mode)
    except ValueError as exc:
        raise UserError(f"--mode: {exc}") from None
    if not 1 <= args.workers <= 32:
        raise UserError("--workers must be 1..32 (one switch bitmap)")
    from luwu.dataplane.kernels import mode as kernel_mode

    kernel_mode()  # a bad LUWU_KERNELS: one line here, not a traceback from every worker process
    if numel < 1:
        raise UserError(f"--size {args.size}: at least 4 bytes (one float32)")
    from luwu.dataplane.loopback import default_transport

    try:
        default_transport()  # LUWU_TRANSPORT picks the default run's ports
    except ValueError as exc:
        raise UserError(str(exc)) from None
    from rich.console import Console

    console = Console(stderr=True)
    res: dict = {"workers": args.workers, "cores": len(os.sched_getaffinity(0)), "bytes": numel * 4,
                 "dtype": args.dtype, "mode": args.mode,
                 "lanes": lanes, "packet_bytes": aggregation_packet_len(lanes), "iters": args.iters, "drop": args.drop}
    with console.status("raw UDP ceiling") as status:
        if not args.no_ceiling:
            from luwu.dataplane.loopback import StarPlan

            # the window of luwu's UDP path (the relay is UDP; shm ports get a bigger one)
            window = StarPlan(workers=args.workers, mode=args.mode, transport="udp").data_pool
            res["udp_ceiling"] = measure_ceiling(args.workers, numel * 4, aggregation_packet_len(lanes), window=window)
        what = f"({args.workers} workers, {format_size(numel * 4)})"
        if args.transport in ("both", "shm"):
            status.update(f"luwu allreduce through the software switch over shared memory {what}")
            res["luwu"] = run_luwu(args.workers, numel, args.dtype, args.mode, args.iters, args.verify, args.drop,
                                   None if args.transport == "both" else "shm")
        if args.transport in ("both", "udp"):
            status.update(f"luwu allreduce through the software switch over UDP {what}")
            res["luwu_udp" if "luwu" in res else "luwu"] = run_luwu(args.workers, numel, args.dtype, args.mode,
                                                                    args.iters, args.verify, args.drop, "udp")
        if not args.no_gloo and args.dtype == "float32":
            status.update("Gloo allreduce")
            res["gloo"] = run_gloo(args.workers, numel, args.iters)
        if not args.no_setup:
            from luwu.bench.setup_times import measure as measure_setup

            for backend, prefix in (("luwu", ""), ("gloo", "gloo_")):
                status.update(f"{backend}: init_process_group and new_group ({args.workers} ranks)")
                res[prefix + "setup"] = setup = measure_setup(args.workers, backend)
                res[prefix + "init_s"], res[prefix + "new_group_s"] = setup["init_s"], setup["new_group_s"]
                res[prefix + "first_allreduce_s"] = setup["first_allreduce_s"]
    runs = [(k, res[k]) for k in ("luwu", "luwu_udp") if k in res]
    if "gloo" in res:
        res["gloo_goodput_gbps"] = numel * 4 / res["gloo"]["median_s"] / 1e9
        res["gloo_cpu_s_per_gb"] = res["gloo"]["cpu_s_per_gb"]
        res["gloo_cores_busy"] = res["gloo"]["cores_busy"]
    if "udp_ceiling" in res:
        res["udp_ceiling_gbps"] = res["udp_ceiling"]["goodput_gbps"]
        res["udp_ceiling_cpu_s_per_gb"] = res["udp_ceiling"]["cpu_s_per_gb"]
    for key, run_ in runs:
        sfx = "" if key == "luwu" else "_udp"
        g = numel * 4 / run_["median_s"] / 1e9
        res["transport" + sfx] = run_["transport"]
        res["goodput_gbps" + sfx] = g
        res["cpu_s_per_gb" + sfx] = run_["cpu_s_per_gb"]
        res["cores_busy" + sfx] = run_["cores_busy"]
        res["retransmit_fraction" + sfx] = run_["retransmits"]["fraction"]
        if "gloo" in res:
            res["ratio_to_gloo" + sfx] = g / res["gloo_goodput_gbps"]
            res["cpu_ratio_to_gloo" + sfx] = run_["cpu_s_per_gb"] / res["gloo_cpu_s_per_gb"]
        if "udp_ceiling" in res and run_["transport"] == "udp":
            res["fraction_of_udp_ceiling"] = g / res["udp_ceiling_gbps"]
            res["cpu_ratio_to_udp_ceiling"] = run_["cpu_s_per_gb"] / res["udp_ceiling_cpu_s_per_gb"]
    checked = [r["verify"] for _, r in runs if "verify" in r]
    ok = all(v["mismatches"] == 0 for v in checked)
    res["verified"] = ok if checked else None
    if args.out:
        _write(args.out, res)
    if args.json:
        print(json.dumps(res, default=float))
    else:
        _print(res)
    return 0 if ok else 1


def run_torch(args) -> int:
    """The default: `dist.all_reduce` through the luwu backend against Gloo (torch_sweep.py)."""
    from luwu.bench import torch_sweep
    from luwu.worker.backend.config import BackendConfig

    if args.drop or args.no_ceiling:
        raise UserError("--drop and --no-ceiling are for --engine (the sweep through torch has no simulated loss "
                        "and no relay ceiling)")
    if not 1 <= args.workers <= 32:
        raise UserError("--workers must be 1..32 (one switch bitmap)")
    sizes = args.sizes or ([parse_size(args.size)] if args.size else list(torch_sweep.DEFAULT_SIZES))
    try:
        lanes_for_mode(int(args.mode) if args.mode.isdigit() else args.mode)
    except ValueError as exc:
        raise UserError(f"--mode: {exc}") from None
    os.environ["LUWU_MODE"] = args.mode  # the spawned ranks' backend reads them (worker/backend/config.py)
    if args.transport != "both":
        os.environ["LUWU_TRANSPORT"] = args.transport
    from rich.console import Console

    console = Console(stderr=True)
    res: dict = {"workers": args.workers, "cores": len(os.sched_getaffinity(0)), "dtype": args.dtype,
                 "iters": args.iters, "warmup_s": args.warmup, "mode": args.mode, "through": "torch.distributed",
                 "transport": os.environ.get("LUWU_TRANSPORT", "default"),
                 "engine": os.environ.get("LUWU_ENGINE", BackendConfig.engine)}
    with console.status(f"dist.all_reduce, luwu and Gloo, {len(sizes)} sizes, {args.workers} ranks") as status:
        res.update(torch_sweep.sweep(args.workers, sizes, args.iters, args.dtype, args.verify,
                                     gloo=not args.no_gloo and args.dtype == "float32", warmup=args.warmup))
        if not args.no_setup:
            from luwu.bench.setup_times import measure as measure_setup

            for backend, prefix in (("luwu", ""), ("gloo", "gloo_")):
                status.update(f"{backend}: init_process_group and new_group ({args.workers} ranks)")
                res[prefix + "setup"] = setup = measure_setup(args.workers, backend)
                res[prefix + "init_s"], res[prefix + "new_group_s"] = setup["init_s"], setup["new_group_s"]
                res[prefix + "first_allreduce_s"] = setup["first_allreduce_s"]
    checked = [r["verify"] for r in res["sweep"] if "verify" in r]
    ok = all(v["mismatches"] == 0 for v in checked)
    res["verified"] = ok if checked else None
    for key in ("luwu", "gloo"):  # JSON object keys are strings
        if key in res:
            res[key] = {str(k): v for k, v in res[key].items()}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "allreduce.json").write_text(json.dumps(res, indent=2, default=float))
        torch_sweep.plot(args.out / "allreduce.png", res)
    if args.json:
        print(json.dumps(res, default=float))
    else:
        for k in ("workers", "cores", "dtype", "iters", "mode", "transport", "engine"):
            print(f"{k}: {res[k]}")
        torch_sweep.print_lines(res)
        for k in ("init_s", "gloo_init_s", "first_allreduce_s", "gloo_first_allreduce_s", "new_group_s",
                  "gloo_new_group_s", "verified"):
            if k in res:
                v = res[k]
                print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0 if ok else 1


def _print(res: dict) -> None:
    keys = ["workers", "cores", "bytes", "dtype", "mode", "packet_bytes", "transport", "goodput_gbps", "cpu_s_per_gb",
            "cores_busy", "ratio_to_gloo", "cpu_ratio_to_gloo", "retransmit_fraction", "transport_udp", "goodput_gbps_udp",
            "cpu_s_per_gb_udp", "cores_busy_udp", "ratio_to_gloo_udp", "cpu_ratio_to_gloo_udp", "retransmit_fraction_udp",
            "gloo_goodput_gbps", "gloo_cpu_s_per_gb", "gloo_cores_busy",
            "udp_ceiling_gbps", "udp_ceiling_cpu_s_per_gb", "fraction_of_udp_ceiling", "cpu_ratio_to_udp_ceiling",
            "init_s", "gloo_init_s", "first_allreduce_s", "gloo_first_allreduce_s", "new_group_s",
            "gloo_new_group_s", "verified"]
    for k in keys:
        if k in res:
            v = res[k]
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    for key, sfx in (("luwu", ""), ("luwu_udp", "_udp")):
        v = res.get(key, {}).get("verify")
        if v:
            print(f"verify_checked{sfx}: {v['checked']}\nverify_mismatches{sfx}: {v['mismatches']}\n"
                  f"verify_max_error_over_bound{sfx}: {v['max_error_over_bound']:.3f}")


def _write(out: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "allreduce.json").write_text(json.dumps(res, indent=2, default=float))
    bars = [(f"luwu ({res['transport']})", "goodput_gbps", "cpu_s_per_gb", "tab:blue"),
            ("luwu (udp)", "goodput_gbps_udp", "cpu_s_per_gb_udp", "tab:cyan"),
            ("gloo", "gloo_goodput_gbps", "gloo_cpu_s_per_gb", "tab:gray"),
            ("UDP relay", "udp_ceiling_gbps", "udp_ceiling_cpu_s_per_gb", "tab:green")]
    bars = [b for b in bars if b[1] in res]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for a, col, label in ((ax[0], 1, "goodput (GB/s, higher is better)"),
                          (ax[1], 2, "CPU s per GB reduced (lower is better)")):
        a.bar([b[0] for b in bars], [res.get(b[col], 0.0) for b in bars], color=[b[3] for b in bars])
        a.set_ylabel(label)
        a.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"allreduce, {res['workers']} workers, {format_size(res['bytes'])}, {res['mode']} packets")
    fig.tight_layout()
    fig.savefig(out / "allreduce.png", dpi=120)
    plt.close(fig)
