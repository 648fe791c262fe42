"""The search of `luwu bench capacity` and its summary: per system, the layers double from 1 until a
size does not fit (or the most layers), then bisect between the largest size that fit and the
smallest that did not (to within an eighth of the size, or one layer), while the system's share of the time budget lasts (the time left over
the systems still to search: one that finishes early leaves its time to the next). Each trial runs
in fresh processes (capacity_run.py). A trial that fails for a reason other than memory (`error`,
`timeout`) ends that system's search: a larger size would not tell more.
"""

from __future__ import annotations

import time
from pathlib import Path

from luwu.bench.capacity_model import count_params
from luwu.bench.capacity_run import trial
from luwu.bench.memcap import MemoryCap

SYSTEMS = ("luwu", "ddp", "fsdp")
RESOLUTION = 8  # bisect until the largest fitting size is known within 1/8 of itself (or 1 layer)
MIN_TRIAL_S = 60.0  # a trial gets at least this long, even when the budget is nearly spent


def _next_layers(lo: int, hi: int | None, max_layers: int) -> int | None:
    """The next size to try: double past the largest fit `lo` until one fails (`hi`), then bisect; None
    when done (the most layers fit, or `hi` is within max(1, lo / RESOLUTION) of `lo`)."""
    if hi is None:
        if lo >= max_layers:
            return None
        return min(max(1, 2 * lo), max_layers)
    if hi - lo <= max(1, lo // RESOLUTION):
        return None
    return (lo + hi) // 2


def search(base: dict, cap: MemoryCap, work: Path, max_layers: int, budget: float, console,
           layers: int | None = None) -> list[dict]:
    """Every trial of every system of `base["systems"]`, in order, within `budget` seconds; with
    `layers`, one trial of that size per system instead of a search (a fixed model compared)."""
    fixed = layers
    from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

    ckpt = dict.fromkeys(base["systems"], True)  # every system recomputes (ModelInNetwork pulls again)
    t_end = time.monotonic() + budget
    trials: list[dict] = []
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        tasks = {s: progress.add_task(s, info="waiting", total=None) for s in base["systems"]}
        for i, system in enumerate(base["systems"]):
            share_end = time.monotonic() + (t_end - time.monotonic()) / (len(base["systems"]) - i)
            lo, hi, task = 0, None, tasks[system]
            sys_base = dict(base, model=dict(base["model"], checkpointing=ckpt[system]))
            tried = 0
            while True:
                layers = (fixed if not tried else None) if fixed is not None else _next_layers(lo, hi, max_layers)
                tried += 1
                left = share_end - time.monotonic()
                if layers is None or left <= 0:
                    break
                params = count_params(dict(sys_base["model"], layers=layers))
                head = f"{system}: {layers} layers, {params / 1e6:.2f}M params (fits so far: {lo})"

                def show(info: str, head: str = head, task: TaskID = task) -> None:
                    progress.update(task, description=head, info=info)

                show("starting")
                rec = trial(system, layers, params, sys_base, cap, work, max(left, MIN_TRIAL_S), show)
                rec["checkpointing"] = ckpt[system]
                rec["init"] = rec.get("init") or ("meta" if system == "fsdp" and base.get("fsdp_init") == "meta" else "eager")
                trials.append(rec)
                if rec["fits"]:
                    lo = layers
                else:
                    hi = layers
                    if rec["reason"] in ("error", "timeout"):
                        break
            progress.update(task, description=f"{system}: largest {lo} layers", info="done")
    return trials


def summarise(base: dict, cap: MemoryCap, trials: list[dict]) -> dict:
    """The bench's result from its trials: each system's largest fitting size, the ratios, tokens/s
    and memory there, the optimizer node's disk traffic and peak RSS over luwu's trials."""
    systems = base["systems"]
    best: dict[str, dict | None] = {}
    for s in systems:
        fits = [t for t in trials if t["system"] == s and t["fits"]]
        best[s] = max(fits, key=lambda t: t["params"]) if fits else None
    largest = {s: (best[s]["params"] if best[s] else None) for s in systems}  # type: ignore[index]
    res: dict = {
        "systems": systems, "enforced": cap.kind, "cap": cap.describe(), "worker_memory_bytes": cap.limit,
        "worker_memory": f"{cap.limit / 2**30:.3f} GiB", "model_kind": base["model"]["backend"], "config": base,
        "largest_params": largest,
        "largest_layers": {s: (best[s]["layers"] if best[s] else 0) for s in systems},  # type: ignore[index]
        "tokens_per_s": {s: (best[s].get("tokens_per_s") if best[s] else None) for s in systems},  # type: ignore[union-attr]
        "worker_peak_rss_bytes": {s: (max(best[s]["worker_capped_peak_bytes"]) if best[s] else None)  # type: ignore[index]
                                  for s in systems},
        "worker_tree_peak_rss_bytes": {s: (max(best[s]["worker_tree_peak_rss_bytes"]) if best[s] else None)  # type: ignore[index]
                                       for s in systems},
        "worker_cgroup_peak_bytes": {s: (max(best[s]["cgroup_peak_bytes"]) if best[s] and best[s]["cgroup_peak_bytes"]  # type: ignore[index]
                                         else None) for s in systems},
        "peak_held_to_cap": ("each worker with the processes it started, summed peak RSS" if cap.kind == "measured"
                             else "each worker process's peak RSS (VmHWM)"
                             + (", and each worker with what it started within the cgroup" if cap.kind.startswith("cgroup")
                                else "")),
        "checkpointing": {s: next((t["checkpointing"] for t in trials if t["system"] == s), None) for s in systems},
        "init": {s: next((t["init"] for t in trials if t["system"] == s), None) for s in systems},
        "trials": trials, "trials_run": len(trials),
        "errors": [f"{t['system']} L{t['layers']}: {t['reason']}: {str(t.get('detail', ''))[:300]}"
                   for t in trials if t["reason"] in ("error", "timeout")],
    }
    lu = largest.get("luwu")
    for other in ("ddp", "fsdp"):
        if "luwu" in systems and other in systems:
            o = largest.get(other)
            res[f"ratio_to_{other}"] = (lu or 0) / o if o else None
    luwu_best = best.get("luwu")
    if luwu_best is not None and "node" in luwu_best:
        node = luwu_best["node"]
        res["node_peak_rss_bytes"] = node.get("peak_rss_bytes")
        node_io = node.get("node_io") or []
        if node_io and all("read_bytes" in n for n in node_io):  # the node's own counters of its state files
            res["node_disk_read_bytes"] = sum(int(n["read_bytes"]) for n in node_io)
            res["node_disk_write_bytes"] = sum(int(n["write_bytes"]) for n in node_io)
            res["node_disk_source"] = "node stats (io)"
        else:
            io = node.get("proc_io") or {}
            res["node_disk_read_bytes"], res["node_disk_write_bytes"] = io.get("read_bytes"), io.get("write_bytes")
            res["node_disk_source"] = "/proc/PID/io of the node process"
        res["node_proc_io"] = node.get("proc_io")
    return res
