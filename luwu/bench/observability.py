"""`luwu bench observability`: what tracing and metrics cost, measured in one run.

The same allreduce as `luwu bench allreduce` (N worker processes through the software switch in
its own process) runs in four configurations, interleaved round by round so that drift on a
shared machine falls on all of them alike:

* `off`: neither LUWU_TRACE_DIR nor LUWU_METRICS (the instrumentation is still in the code: this
  is what every untraced run pays);
* `trace`: LUWU_TRACE_DIR set, so the switch writes one event per pipeline turn (the hottest span
  there is) and the workers trace;
* `metrics`: LUWU_METRICS set, every worker serves /metrics and this process scrapes each one
  every --scrape-interval (default 0.5 s, thirty times Prometheus's default rate; `scrape_ms`
  is a scrape's round trip, `scrape_failures` those before a worker's server was up);
* `both`.

CPU seconds of every process (workers and switch) per GB reduced is the measure, as in the
allreduce bench (wall time on a shared machine is noise); `*_cpu_ratio` is a configuration's
over `off`'s. The cost of the disabled instrumentation cannot be switched off at run time, so
it is computed: `disabled_span_ns` (a `with trace.span(...)` that records nothing, measured here)
times the spans a traced run records per GB, over `off`'s CPU per GB (`disabled_fraction`);
`enabled_fraction` is the same with a recorded span's price (`enabled_span_ns`), a figure free of
the run-to-run noise that the measured `trace_cpu_ratio` carries on a shared machine.

Prints grep-able `key: value` lines; `--json` prints one JSON object; `--out DIR` writes
observability.json and observability.png.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from luwu.bench.sizes import format_size, parse_size
from luwu.dataplane.process.usage import UserError, positive_float, positive_int, size

CONFIGS = ("off", "trace", "metrics", "both")
SCRAPE_INTERVAL = 0.5  # s between scrapes of every worker's /metrics


def add_arguments(p) -> None:
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--size", type=size, default="16MiB", help="bytes per worker buffer (float32; default 16MiB)")
    p.add_argument("--iters", type=positive_int, default=5, help="timed allreduces per run (after one warm-up)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds of the four configurations (default 3)")
    p.add_argument("--mode", default="jumbo", help="packet mode: tofino, jumbo (the default, as the demo) or loopback")
    p.add_argument("--transport", choices=["shm", "udp"], default="shm",
                   help="between the engines and the switch: shared memory (the loopback default) or UDP")
    p.add_argument("--scrape-interval", type=positive_float, default=SCRAPE_INTERVAL, metavar="S",
                   help=f"seconds between scrapes of each worker's /metrics (default {SCRAPE_INTERVAL})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key: value lines")
    p.add_argument("--out", type=Path, help="directory for observability.json and observability.png")


def disabled_span_ns(n: int = 200_000) -> float:
    """CPU nanoseconds (this thread's: robust when the machine is busy) one `with trace.span(...)`
    costs while tracing is off, over an empty loop."""
    from luwu.dataplane.observe import trace

    if trace._tracer is not None:  # this process traces: the measure would be the enabled cost
        raise RuntimeError("disabled_span_ns must run in a process that does not trace")

    def spans() -> float:
        t0 = time.thread_time_ns()
        for _ in range(n):
            with trace.span("pipeline turn", "switch", packets=1):
                pass
        return time.thread_time_ns() - t0

    def empty() -> float:
        t0 = time.thread_time_ns()
        for _ in range(n):
            pass
        return time.thread_time_ns() - t0

    return max(0.0, min(spans() for _ in range(3)) - min(empty() for _ in range(3))) / n


def enabled_span_ns(n: int = 50_000) -> float:
    """CPU nanoseconds one recorded span costs (clock reads, the event's JSON, the buffered write), on
    a tracer of its own in a temporary directory: this process's tracing stays off."""
    from luwu.dataplane.observe import trace

    with tempfile.TemporaryDirectory(prefix="luwu-bench-span-") as tmp:
        tracer = trace._Tracer(tmp, "bench")
        best = float("inf")
        for _ in range(3):
            t0 = time.thread_time_ns()
            for _ in range(n):
                with trace._Span(tracer, "pipeline turn", "switch", {"packets": 1}):
                    pass
            best = min(best, time.thread_time_ns() - t0)
        tracer.flush()
    return best / n


def _free_port_run(count: int) -> int:
    """A TCP port p with p .. p+count-1 free on 127.0.0.1 now (the workers serve at PORT + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for p in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free TCP ports on 127.0.0.1 for the workers' /metrics")


class _Scraper:
    """Scrapes http://127.0.0.1:PORT+r/metrics for every rank r every `interval` s, in a thread."""

    def __init__(self, base: int, workers: int, interval: float):
        self.urls = [f"http://127.0.0.1:{base + r}/metrics" for r in range(workers)]
        self.interval, self.ok, self.failed, self.seconds = interval, 0, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for url in self.urls:
                try:
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - our own loopback URL
                        r.read()
                    self.seconds += time.perf_counter() - t0
                    self.ok += 1
                except OSError:
                    self.failed += 1  # not up yet (the workers start their servers with their engines)

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _one(config: str, args, numel: int) -> dict:
    """One allreduce run in `config`; its CPU per GB, median time, scrapes and trace events."""
    from luwu.bench.allreduce import run_luwu

    saved = {k: os.environ.get(k) for k in ("LUWU_TRACE_DIR", "LUWU_METRICS")}
    trace_dir = tempfile.mkdtemp(prefix="luwu-bench-trace-") if config in ("trace", "both") else None
    scraper = None
    try:
        for k in saved:
            os.environ.pop(k, None)
        if trace_dir:
            os.environ["LUWU_TRACE_DIR"] = trace_dir
        if config in ("metrics", "both"):
            base = _free_port_run(args.workers)
            os.environ["LUWU_METRICS"] = f"127.0.0.1:{base}"
            scraper = _Scraper(base, args.workers, args.scrape_interval)
        if scraper is not None:
            with scraper:
                r = run_luwu(args.workers, numel, "float32", args.mode, args.iters, False, 0.0, args.transport)
        else:
            r = run_luwu(args.workers, numel, "float32", args.mode, args.iters, False, 0.0, args.transport)
        events = 0
        if trace_dir:
            events = sum(1 for f in Path(trace_dir).glob("trace-*.jsonl") for line in f.read_text().splitlines()
                         if '"ph":"X"' in line)
        return {"cpu_s": r["cpu_s"]["workers"] + r["cpu_s"]["switch"], "median_s": r["median_s"],
                "gb": args.iters * numel * 4 / 1e9, "events": events,
                "scrapes": scraper.ok if scraper else 0, "scrape_failures": scraper.failed if scraper else 0,
                "scrape_seconds": scraper.seconds if scraper else 0.0}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if trace_dir:
            shutil.rmtree(trace_dir, ignore_errors=True)


def run(args) -> int:
    numel = parse_size(args.size) // 4
    if numel < 1:
        raise UserError(f"--size {args.size}: at least 4 bytes (one float32)")
    if not 1 <= args.workers <= 32:
        raise UserError("--workers must be 1..32 (one switch bitmap)")
    from luwu.dataplane.protocol import lanes_for_mode

    try:
        lanes_for_mode(args.mode)
    except ValueError as exc:
        raise UserError(f"--mode: {exc}") from None
    from rich.console import Console

    console = Console(stderr=True)
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    with console.status("observability") as status:
        res: dict = {"workers": args.workers, "bytes": numel * 4, "iters": args.iters, "rounds": args.rounds,
                     "transport": args.transport, "mode": args.mode, "scrape_interval_s": args.scrape_interval,
                     "disabled_span_ns": disabled_span_ns(), "enabled_span_ns": enabled_span_ns()}
        for i in range(args.rounds):
            for config in CONFIGS if i % 2 == 0 else CONFIGS[::-1]:  # alternate the order: drift hits all alike
                status.update(f"round {i + 1}/{args.rounds}: allreduce with {config} "
                              f"({args.workers} workers, {format_size(numel * 4)})")
                runs[config].append(_one(config, args, numel))
    for c in CONFIGS:
        gb = sum(r["gb"] for r in runs[c])
        res[f"{c}_cpu_s_per_gb"] = sum(r["cpu_s"] for r in runs[c]) / gb
        res[f"{c}_goodput_gbps"] = numel * 4 / float(np.median([r["median_s"] for r in runs[c]])) / 1e9
        if c != "off":
            res[f"{c}_cpu_ratio"] = res[f"{c}_cpu_s_per_gb"] / res["off_cpu_s_per_gb"]
            res[f"{c}_time_ratio"] = res["off_goodput_gbps"] / res[f"{c}_goodput_gbps"]
    traced = runs["trace"] + runs["both"]
    res["trace_events_per_gb"] = sum(r["events"] for r in traced) / sum(r["gb"] for r in traced)
    res["scrapes"] = sum(r["scrapes"] for r in runs["metrics"] + runs["both"])
    res["scrape_failures"] = sum(r["scrape_failures"] for r in runs["metrics"] + runs["both"])
    # a scrape's round trip: an upper bound on the worker time it takes (read at scrape time only)
    res["scrape_ms"] = 1e3 * sum(r["scrape_seconds"] for r in runs["metrics"] + runs["both"]) / max(res["scrapes"], 1)
    # the instrumentation's price when off: spans it passes over per GB, at the measured cost each
    res["disabled_fraction"] = res["disabled_span_ns"] * 1e-9 * res["trace_events_per_gb"] / res["off_cpu_s_per_gb"]
    # and on: the same count at the recorded price (the measured ratio carries the machine's noise too)
    res["enabled_fraction"] = res["enabled_span_ns"] * 1e-9 * res["trace_events_per_gb"] / res["off_cpu_s_per_gb"]
    res["runs"] = runs
    if args.out:
        _write(args.out, res)
    if args.json:
        print(json.dumps(res, default=float))
    else:
        for k, v in res.items():
            if k != "runs":
                print(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def _write(out: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "observability.json").write_text(json.dumps(res, indent=2, default=float))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(CONFIGS, [res[f"{c}_cpu_s_per_gb"] for c in CONFIGS], color=["tab:gray", "tab:blue", "tab:orange",
                                                                          "tab:green"])
    ax.set(ylabel="CPU s per GB reduced (all processes)",
           title=f"tracing and metrics, {res['workers']} workers, {format_size(res['bytes'])}")
    fig.tight_layout()
    fig.savefig(out / "observability.png", dpi=120)
    plt.close(fig)
