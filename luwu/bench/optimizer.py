"""`luwu bench optimizer`: the optimizer node's step against what a user would compare it with,
all in the same run, on the same parameters and gradients:

* in RAM: the node's step throughput (params/s, summed gradient in, bf16 copy out) against
  `torch.optim.AdamW(fused=True)` (`ratio_to_fused_adamw`), and against fused AdamW plus the
  bf16 cast a worker would need anyway; and the same node with `LUWU_KERNELS=reference` (torch's
  fused AdamW, then the cast) against its default, the compiled one-pass AdamW + cast
  (`kernels`, `compiled_kernels_speedup`);
* the memory-bandwidth bound: `memory_gbps` is `p += g` on the same tensors (one thread); fused
  AdamW moves 28 bytes a parameter and runs at about that bandwidth
  (`fused_adamw_fraction_of_memory_bandwidth`), so it is memory-bound; the node also writes the
  served copy (bf16: 2 bytes, plus the 2 the CPU reads first to allocate the line), so a
  memory-bound node reaches at most `bandwidth_ceiling_ratio` (28/32 = 0.875 for bf16) of fused
  AdamW; `ratio_to_bandwidth_ceiling` is how close the node comes;
* out of core (RAM budget well below the state): the node's file bandwidth against the disk's
  read+write bandwidth on the same files and access pattern (`fraction_of_disk_bandwidth`);
  O_DIRECT on both sides where the file system has it (else buffered I/O with
  posix_fadvise(DONTNEED)), so the page cache flatters neither;
* lazy checkpoints: step time with a checkpoint every N steps against none (`checkpoint_overhead`);
* the step-centric pipeline against the layer-centric one, in RAM and out of core.

Every process uses one torch thread (OMP_NUM_THREADS=1); the node's pipeline threads share the
machine's cores. The headline ratio is the node's default (one thread per pipeline step);
`ratio_2threads_to_fused_adamw` gives each step two threads (two optimizer kernels at once), and
`cpu_ratio_to_fused_adamw` compares process CPU time per step, which the machine's load moves
least. The wall-clock ratios are medians over rounds of the ratio within a round (runners
alternate in short blocks), so a slow spell of the shared machine skews one round, not the
figure. `ratio_to_fused_adamw_fp32_serving` is the same node serving fp32 (whatever `--served`
says): no rounding, but the fp32 copy of the master is still written. Prints grep-able
`key: value` lines; `--json` one JSON object; `--out DIR` writes optimizer.json and optimizer.png.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from luwu.bench.sizes import parse_size
from luwu.dataplane.process.usage import UserError, positive_float, positive_int, size


def add_arguments(p) -> None:
    p.add_argument("--params", type=size, default="24M", help="parameters of the in-RAM model (e.g. 24M)")
    p.add_argument("--layers", type=positive_int, default=12, help="layers (each a weight, a bias and a norm scale)")
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per measurement block (after a warm-up)")
    p.add_argument("--ooc-params", type=size, default="8M", help="parameters of the out-of-core model")
    p.add_argument("--ooc-ratio", type=positive_float, default=8.0, help="out-of-core state size / RAM budget")
    p.add_argument("--checkpoint-every", type=positive_int, default=50, help="steps between checkpoints")
    p.add_argument("--served", choices=["bf16", "fp16", "fp32"], default="bf16", help="served parameter dtype")
    p.add_argument("--dir", type=Path, default=None, help="where state files and checkpoints go (a real disk; "
                                                           "default: the system temp directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key: value lines")
    p.add_argument("--out", type=Path, help="directory for optimizer.json and optimizer.png")


def _layers(total: int, n: int):
    from luwu.dataplane.optimizer import LayerSpec

    cols = 1024
    rows = max(1, total // n // cols)
    return [LayerSpec(i, {"weight": (rows, cols), "bias": (rows,), "norm": (cols,)}, frozenset({"bias", "norm"}))
            for i in range(n)]


def _grads(layers, seed: int = 7) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {ly.layer_id: rng.standard_normal(ly.numel, dtype=np.float32) * np.float32(1e-3) for ly in layers}


def _opt():
    from luwu.dataplane.optimizer import OptimizerSpec

    return OptimizerSpec("adamw", lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class NodeRun:
    """A node with one job, driven like workers drive it: every layer's gradient in backward
    order, through the gradient sink the engine uses (a summed fixed-point gradient nobody
    saturated, so finite by construction: no NaN/Inf pass), then wait until every layer's new
    version is published."""

    def __init__(self, root: Path, name: str, layers, grads, served: str, kernels: str | None = None, **cfg):
        from luwu.dataplane.optimizer import JobSpec, NodeConfig, OptimizerNode

        self.kernels = kernels  # LUWU_KERNELS while this node steps (None: as the environment says)
        self.node = OptimizerNode(NodeConfig(root / name, **cfg))
        self.node.add_job(JobSpec("bench", _opt(), layers, served, initial=1))
        self.layers, self.grads, self.step = layers, grads, 0
        self.sink = self.node.gradient_sink("bench", 1)

    def run(self, steps: int) -> list[float]:
        from luwu.dataplane import kernels

        saved = os.environ.get(kernels.ENV)
        if self.kernels is not None:  # read on every step; only this node steps until run returns
            os.environ[kernels.ENV] = self.kernels
        try:
            return self._run(steps)
        finally:
            if self.kernels is not None:
                if saved is None:
                    os.environ.pop(kernels.ENV, None)
                else:
                    os.environ[kernels.ENV] = saved

    def _run(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            for ly in reversed(self.layers):
                self.sink(ly.layer_id, self.grads[ly.layer_id], False)
            for ly in self.layers:
                self.node.wait_version("bench", ly.layer_id, self.step + 1, timeout=600)
            self.step += 1
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.node.close()


class FusedAdamW:
    """torch.optim.AdamW(fused=True) on the same parameters and gradients; optionally followed by
    the bf16 cast of every parameter into preallocated buffers."""

    def __init__(self, layers, grads, cast: bool):
        import torch

        from luwu.dataplane.optimizer import JobSpec
        from luwu.dataplane.optimizer.initial import initial_master
        from luwu.dataplane.optimizer.layout import plan_layer

        spec = JobSpec("bench", _opt(), layers, "bf16", initial=1)
        self.params, self.casts = [], []
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for ly in layers:
            flat = initial_master(plan_layer(spec, ly, 1 << 22), 1)
            g = torch.from_numpy(grads[ly.layer_id])
            for name, lo, hi, dec in plan_layer(spec, ly, 1 << 22).segments:
                p = torch.nn.Parameter(torch.from_numpy(flat[lo:hi].copy()).reshape(ly.shapes[name]))
                p.grad = g[lo:hi].reshape(ly.shapes[name]).clone()
                (decay if dec else no_decay).append(p)
                self.params.append(p)
                if cast:
                    self.casts.append(torch.empty(p.shape, dtype=torch.bfloat16))
        o = _opt()
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=o.lr, betas=o.betas, eps=o.eps, fused=True)

    def run(self, steps: int) -> list[float]:
        import torch

        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.opt.step()
            if self.casts:
                torch._foreach_copy_(self.casts, [p.detach() for p in self.params])
            times.append(time.perf_counter() - t0)
        return times


class MemoryStream:
    """The machine's memory bandwidth on the same tensors: `p += g` over every parameter in place
    (reads p and g, writes p: 12 bytes a parameter, no write-allocate since p's line is read
    anyway), torch's vectorized loop on one thread, as fused AdamW runs."""

    BYTES_PER_PARAM = 12

    def __init__(self, fused: FusedAdamW):
        self.params = [p.detach() for p in fused.params]
        self.grads = [p.grad if p.grad is not None else p.detach() for p in fused.params]  # FusedAdamW sets every grad

    def run(self, steps: int) -> list[float]:
        import torch

        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            torch._foreach_add_(self.params, self.grads, alpha=0.0)  # alpha 0: the values stay put
            times.append(time.perf_counter() - t0)
        return times


# Bytes an AdamW step moves per parameter in RAM: fused AdamW reads p, g, m, v and writes p, m, v
# (fp32: 28 B, all lines it writes it has read). The node also writes the served copy: 2 B of bf16
# (or fp16, 4 B of fp32) per parameter, into lines it has not read, which the CPU reads first
# (write-allocate), so twice that. A step bound by memory bandwidth, as both are here (see
# `fused_adamw_fraction_of_memory_bandwidth`), cannot beat fused AdamW by more than this ratio.
ADAMW_BYTES = 28
SERVED_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def bandwidth_ceiling(served: str) -> float:
    """The highest ratio_to_fused_adamw a memory-bound node serving `served` can reach."""
    return ADAMW_BYTES / (ADAMW_BYTES + 2 * SERVED_BYTES[served])


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _blocks(runners: dict, steps: int, rounds: int) -> tuple[dict[str, float], dict[str, float], dict[str, list]]:
    """Median wall time and mean process CPU time per step of each runner, measured in short
    alternating blocks (the machine is shared: a slow spell then hits every runner alike), and
    each runner's median step time per round (for ratios of neighbouring blocks, `_paired`)."""
    for r in runners.values():
        r.run(1)  # warm-up: first-touch allocations, lazy state
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for k, r in runners.items():
            c0 = _cpu_seconds()
            wall[k] += r.run(steps)
            cpu[k].append((_cpu_seconds() - c0) / steps)
    per_round = {k: [statistics.median(v[i * steps:(i + 1) * steps]) for i in range(rounds)] for k, v in wall.items()}
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.fmean(v) for k, v in cpu.items()},
            per_round)


def _paired(per_round: dict[str, list], a: str, b: str) -> float:
    """Speed of runner a over runner b: the median over rounds of the ratio within a round. A
    slow spell of the shared machine that spans one runner's blocks (seconds, while one block
    lasts ~0.1 s) then skews one round's ratio, not the median of the pooled steps."""
    return statistics.median(tb / ta for ta, tb in zip(per_round[a], per_round[b]))


def bench_ram(root: Path, args, status) -> dict:
    total = parse_size(args.params)
    layers = _layers(total, args.layers)
    grads = _grads(layers)
    n = sum(ly.numel for ly in layers)
    budget = 3 * 16 * n  # everything fits
    status.update(f"in RAM: node (step- and layer-centric, compiled and reference kernels) vs torch fused AdamW, "
                  f"{n / 1e6:.1f}M params")
    nodes = {"node": NodeRun(root, "ram-step", layers, grads, args.served, ram_budget=budget),
             "node_layer": NodeRun(root, "ram-layer", layers, grads, args.served, ram_budget=budget,
                                   pipeline="layer"),
             "node_ref": NodeRun(root, "ram-ref", layers, grads, args.served, kernels="reference",
                                 ram_budget=budget),
             "node_2": NodeRun(root, "ram-step2", layers, grads, args.served, ram_budget=budget,
                               threads_per_step=2),
             # fp32 served: no rounding, but still a copy of the master (a published version is
             # never written again, while the master is stepped in place)
             "node_fp32": NodeRun(root, "ram-fp32", layers, grads, "fp32", ram_budget=budget)}
    # the runners a ratio compares run in neighbouring blocks (node, fused AdamW, ...)
    fused = FusedAdamW(layers, grads, cast=False)
    runners: dict[str, NodeRun | FusedAdamW | MemoryStream] = {"node": nodes["node"], "fused": fused,
                                                "node_fp32": nodes["node_fp32"], "node_2": nodes["node_2"],
                                                "fused_cast": FusedAdamW(layers, grads, cast=True),
                                                "node_layer": nodes["node_layer"], "node_ref": nodes["node_ref"],
                                                "memory": MemoryStream(fused)}
    try:
        med, cpu, per_round = _blocks(runners, max(1, args.steps // 2), rounds=5)
        io = nodes["node"].node.stats()["io"]
    finally:
        for node_run in nodes.values():
            node_run.close()
    rate = {k: n / v for k, v in med.items()}
    memory_gbps = rate["memory"] * MemoryStream.BYTES_PER_PARAM / 1e9
    ceiling = bandwidth_ceiling(args.served)
    ratio = _paired(per_round, "node", "fused")
    return {"params": n, "layers": len(layers), "node_params_per_s": rate["node"],
            "layer_centric_params_per_s": rate["node_layer"], "fused_adamw_params_per_s": rate["fused"],
            "fused_adamw_cast_params_per_s": rate["fused_cast"],
            "ratio_to_fused_adamw": ratio,
            "memory_gbps": memory_gbps,
            "fused_adamw_fraction_of_memory_bandwidth": rate["fused"] * ADAMW_BYTES / 1e9 / memory_gbps,
            "node_fraction_of_memory_bandwidth":
                rate["node"] * (ADAMW_BYTES + 2 * SERVED_BYTES[args.served]) / 1e9 / memory_gbps,
            "bandwidth_ceiling_ratio": ceiling, "ratio_to_bandwidth_ceiling": ratio / ceiling,
            "ratio_to_fused_adamw_plus_cast": _paired(per_round, "node", "fused_cast"),
            "node_fp32_serving_params_per_s": rate["node_fp32"],
            "ratio_to_fused_adamw_fp32_serving": _paired(per_round, "node_fp32", "fused"),
            "node_fp32_serving_cpu_s_per_step": cpu["node_fp32"],
            "cpu_ratio_to_fused_adamw_fp32_serving": cpu["fused"] / cpu["node_fp32"],
            "step_centric_speedup_ram": rate["node"] / rate["node_layer"],
            "node_2threads_params_per_s": rate["node_2"],
            "ratio_2threads_to_fused_adamw": _paired(per_round, "node_2", "fused"),
            "kernels": _kernels(args.served), "node_reference_kernels_params_per_s": rate["node_ref"],
            "compiled_kernels_speedup": rate["node"] / rate["node_ref"],
            "ratio_reference_kernels_to_fused_adamw": rate["node_ref"] / rate["fused"],
            "node_cpu_s_per_step": cpu["node"], "fused_adamw_cpu_s_per_step": cpu["fused"],
            "node_reference_kernels_cpu_s_per_step": cpu["node_ref"],
            "cpu_ratio_to_fused_adamw": cpu["fused"] / cpu["node"],
            "ram_file_reads": io["reads"], "ram_file_writes": io["writes"],
            "step_seconds": dict(med)}


def _kernels(served: str) -> str:
    """Which optimizer kernel the node's AdamW step ran: the compiled one-pass AdamW + cast, or
    torch's fused AdamW then the cast (the reference path)."""
    import torch

    from luwu.dataplane.optimizer import OptimizerSpec, fused

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[served]
    return "numba" if fused.usable(OptimizerSpec("adamw"), torch.empty(1, dtype=dtype)) else "reference"


def bench_checkpoint(root: Path, args, status) -> dict:
    """One node; blocks of `every` steps, alternately plain and with a checkpoint requested at
    the block's first step (lazily written while the block runs). The first checkpoint is a
    warm-up (it allocates the copy-on-write staging buffers) and is not timed."""
    total = parse_size(args.params)
    layers = _layers(total, args.layers)
    grads = _grads(layers)
    n = sum(ly.numel for ly in layers)
    every = max(1, args.checkpoint_every)
    status.update(f"lazy checkpoints every {every} steps vs none ({n / 1e6:.1f}M params)")
    run = NodeRun(root, "ck", layers, grads, args.served, ram_budget=3 * 16 * n, checkpoint_dir=root / "ckpts",
                  checkpoint_staging=16 * n)
    commits: list[float] = []
    fits: list[bool] = []
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    try:
        run.run(1)
        run.node.request_checkpoint(run.step)
        run.run(every)
        run.node.checkpoint_now(timeout=600)  # drains the warm-up checkpoint too
        for with_ck in (False, True, True, False, False, True):  # ABBA order cancels slow drifts
            c0 = _cpu_seconds()
            t0 = time.perf_counter()
            handle = run.node.request_checkpoint(run.step) if with_ck else None
            wall[with_ck] += run.run(every)
            if handle is not None:
                fits.append(handle.done())
                handle.wait(600)
                commits.append(time.perf_counter() - t0)
            cpu[with_ck].append(_cpu_seconds() - c0)
        st = run.node.stats()["checkpoint"]
    finally:
        run.close()
    mean_plain, mean_ck = statistics.fmean(wall[False]), statistics.fmean(wall[True])
    return {"checkpoint_every": every, "checkpoint_overhead": (mean_ck - mean_plain) / mean_plain,
            "checkpoint_bytes": st["bytes"] // max(1, st["committed"]), "checkpoint_commit_s": max(commits),
            "checkpoint_done_within_interval": all(fits), "checkpoint_cow_copies": st["cow_copies"],
            "checkpoint_cow_waits": st["cow_waits"], "step_s_plain": mean_plain, "step_s_checkpointing": mean_ck,
            "checkpoint_cpu_s": statistics.fmean(cpu[True]) - statistics.fmean(cpu[False])}


def bench_out_of_core(root: Path, args, status) -> dict:
    """Node steps and disk passes alternate (the machine and its disk are shared, so both are
    measured under the same conditions); the ratio is the median of per-round ratios."""
    from luwu.bench.disk import measure as disk_measure

    total = parse_size(args.ooc_params)
    layers = _layers(total, args.layers)
    grads = _grads(layers, seed=8)
    n = sum(ly.numel for ly in layers)
    state = 12 * n + 2 * n
    budget = int(state / args.ooc_ratio)
    shard = max(4096, (budget // 6 // 12) // 4096 * 4096)  # a handful of shards fit in the budget
    biggest_served = 2 * max(ly.numel for ly in layers)
    served_fraction = min(0.75, max(0.1, 3 * biggest_served / budget))  # room for a few served copies
    out = {"ooc_params": n, "ooc_state_bytes": state, "ooc_budget_bytes": budget, "ooc_shard_elems": shard}
    rounds = max(3, args.steps // 2)
    for mode in ("step", "layer"):
        status.update(f"out of core ({mode}-centric): {state / 2**20:.0f} MiB of state through "
                      f"{budget / 2**20:.0f} MiB, against the disk")
        run = NodeRun(root, f"ooc-{mode}", layers, grads, args.served, ram_budget=budget, max_shard_elems=shard,
                      pipeline=mode, served_fraction=served_fraction)
        try:
            run.run(1)
            order = sorted(layers, key=lambda ly: -ly.layer_id)
            files = [(run.node._state_path(s), s.entry_bytes, s.served_offset, s.served_bytes)
                     for ly in order for s in run.node.jobs["bench"].layers[ly.layer_id].plan.shards]
            node_gbps, disk_gbps, step_s = [], [], []
            for _ in range(rounds):
                before = run.node.stats()["io"]
                dt = run.run(1)[0]
                after = run.node.stats()["io"]
                moved = sum(after[k] - before[k] for k in ("read_bytes", "write_bytes"))
                node_gbps.append(moved / dt / 1e9)
                step_s.append(dt)
                if mode == "step":
                    disk_gbps.append(disk_measure(files, bool(after["direct"]), repeat=1)["gbps"])
            out[f"ooc_{mode}_params_per_s"] = n / statistics.median(step_s)
            out[f"ooc_{mode}_io_gbps"] = statistics.median(node_gbps)
            if mode == "step":
                out["io_mode"] = "O_DIRECT" if after["direct"] else "buffered + posix_fadvise(DONTNEED)"
                out["ooc_bytes_per_step"] = moved
                out["disk_rw_gbps"] = statistics.median(disk_gbps)
                out["fraction_of_disk_bandwidth"] = statistics.median(
                    [a / b for a, b in zip(node_gbps, disk_gbps)])
                out["store"] = run.node.stats()["store"]
        finally:
            run.close()
    out["step_centric_speedup_ooc"] = out["ooc_step_params_per_s"] / out["ooc_layer_params_per_s"]
    return out


def run(args) -> int:
    if args.dir is not None and not args.dir.is_dir():
        raise UserError(f"--dir {args.dir}: no such directory")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from rich.console import Console

    torch.set_num_threads(1)
    console = Console(stderr=True)
    root = Path(tempfile.mkdtemp(prefix="luwu-bench-opt-", dir=args.dir))
    res: dict = {"served_dtype": args.served, "torch_threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    try:
        with console.status("optimizer benchmark") as status:
            res.update(bench_ram(root, args, status))
            res.update(bench_out_of_core(root, args, status))
            res.update(bench_checkpoint(root, args, status))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t0
    if args.out:
        _write(args.out, res)
    if args.json:
        print(json.dumps(res, default=float))
    else:
        _print(res)
    return 0


KEYS = ["params", "layers", "served_dtype", "kernels", "node_params_per_s", "fused_adamw_params_per_s",
        "ratio_to_fused_adamw", "memory_gbps", "fused_adamw_fraction_of_memory_bandwidth",
        "node_fraction_of_memory_bandwidth", "bandwidth_ceiling_ratio", "ratio_to_bandwidth_ceiling",
        "node_reference_kernels_params_per_s", "ratio_reference_kernels_to_fused_adamw",
        "compiled_kernels_speedup", "node_reference_kernels_cpu_s_per_step",
        "fused_adamw_cast_params_per_s", "ratio_to_fused_adamw_plus_cast", "node_fp32_serving_params_per_s",
        "ratio_to_fused_adamw_fp32_serving", "node_fp32_serving_cpu_s_per_step", "cpu_ratio_to_fused_adamw_fp32_serving",
        "layer_centric_params_per_s",
        "step_centric_speedup_ram", "node_2threads_params_per_s", "ratio_2threads_to_fused_adamw",
        "node_cpu_s_per_step", "fused_adamw_cpu_s_per_step", "cpu_ratio_to_fused_adamw",
        "ram_file_reads", "ram_file_writes", "ooc_params", "ooc_state_bytes", "ooc_budget_bytes", "io_mode",
        "ooc_step_params_per_s", "ooc_step_io_gbps", "disk_rw_gbps", "fraction_of_disk_bandwidth",
        "ooc_layer_params_per_s", "step_centric_speedup_ooc", "checkpoint_every", "checkpoint_bytes",
        "checkpoint_overhead", "checkpoint_cpu_s", "checkpoint_commit_s", "checkpoint_done_within_interval", "seconds"]


def _print(res: dict) -> None:
    for k in KEYS:
        if k in res:
            v = res[k]
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")


def _write(out: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer.json").write_text(json.dumps(res, indent=2, default=float))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    names = ["node\n(step-centric)", "node\n(layer-centric)", "fused AdamW", "fused AdamW\n+ bf16 cast"]
    vals = [res[k] / 1e6 for k in ("node_params_per_s", "layer_centric_params_per_s", "fused_adamw_params_per_s",
                                   "fused_adamw_cast_params_per_s")]
    axes[0].bar(names, vals, color=["tab:blue", "tab:cyan", "tab:gray", "tab:olive"])
    axes[0].set_ylabel("Mparams / s")
    axes[0].set_title(f"in RAM, {res['params'] / 1e6:.0f}M params ({res['ratio_to_fused_adamw']:.2f}x fused AdamW)")
    axes[1].bar(["node step-centric", "node layer-centric", "disk (same pattern)"],
                [res["ooc_step_io_gbps"], res["ooc_layer_io_gbps"], res["disk_rw_gbps"]],
                color=["tab:blue", "tab:cyan", "tab:green"])
    axes[1].set_ylabel("GB/s read + write")
    axes[1].set_title(f"out of core, state {res['ooc_state_bytes'] / res['ooc_budget_bytes']:.0f}x budget "
                      f"({res['fraction_of_disk_bandwidth']:.2f} of disk)")
    axes[2].bar(["no checkpoint", f"every {res['checkpoint_every']} steps"],
                [res["step_s_plain"] * 1e3, res["step_s_checkpointing"] * 1e3], color=["tab:gray", "tab:orange"])
    axes[2].set_ylabel("ms / step")
    axes[2].set_title(f"lazy checkpoints: {100 * res['checkpoint_overhead']:+.1f}% step time")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out / "optimizer.png", dpi=120)
    plt.close(fig)
