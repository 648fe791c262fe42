"""What a user of the torch backend gets: `dist.all_reduce` on tensors, for a sweep of sizes (what
DDP's buckets see), the `luwu` backend against Gloo in the same run (`luwu bench allreduce`, its
default; `--engine` measures the engine alone instead, allreduce.py).

Each backend is one job of spawned ranks (`init_process_group` over a TCP store on loopback). For
every size a rank makes one float32 (or int32) tensor of its own values, then `iters + 1` times:
restores its input (outside the clock), `dist.barrier()`, and times `dist.all_reduce`; the first
call is a warm-up. Before the sweep every job warms up for `warmup` seconds (256 KiB all_reduces,
rank 0's clock, at most WARMUP_CALLS): the engine and switch processes load their compiled kernels
in the background after start-up and run the numpy reference until then, which is not the steady
state a training job sees. An iteration's time is its slowest rank's; a size's figure is the median over
the iterations. `ratio_to_gloo` is Gloo's time over luwu's (above 1: luwu is faster).
CPU per call (`luwu_cpu_s`, `gloo_cpu_s`, `cpu_ratio_to_gloo`; by role in `cpu_s_per_call_by_role`)
is the CPU seconds of every process of the job -- the ranks (all their threads: an embedded engine,
Gloo's), the engine daemons and rank 0's loopback switch, which are the ranks' descendants -- from
the end of a call's barrier to the start of the next one's, less the main thread's restoring of the
input, summed over the ranks and averaged over the timed calls (JobClock). On a machine with fewer
cores than processes it is what decides the wall time.
`--verify` checks every element of luwu's last result on rank 0 (int32: bit-exact; float32:
within the fixed-point bound of the backend's packet mode, as the engine bench does).
"""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

SWEEP_TIMEOUT = 900.0  # s a job's ranks may take for the whole sweep (bounded; the machine may be shared)
WARMUP_CALLS = 2000  # bound of the warm-up loop, whatever the clock says
DEFAULT_SIZES = tuple(1024 * 4**k for k in range(9))  # 1 KiB, 4 KiB, ..., 64 MiB


def size_label(nbytes: int) -> str:
    """`1KiB`, `64MiB`, `1000B`: a size as a key of the printed lines."""
    from luwu.bench.sizes import format_size

    return format_size(nbytes).replace(" ", "")


def _lanes() -> int:
    from luwu.dataplane.protocol import lanes_for_mode
    from luwu.worker.backend.config import BackendConfig

    return lanes_for_mode(BackendConfig.from_env().packet_mode)


ROLES = (("engine", "luwu.dataplane.engine.daemon"), ("switch", "luwu.dataplane.loopback.daemon"))


class JobClock:
    """CPU seconds, over windows `start()` .. `stop()`, of this rank's process (every thread: an
    embedded engine, Gloo's) and of every process it started (its engine daemon; rank 0's loopback
    switch), as {"rank", "engine", "switch", "other"}. The processes are found once, when the clock
    is made (one walk of /proc), and read through their CPU-time clocks (a system call each), so a
    window costs microseconds; a process that exits mid-window counts what it had used before."""

    def __init__(self) -> None:
        from luwu.dataplane.process.children import descendants

        self.roles: dict[int, str] = {}
        for pid, cmd in descendants(os.getpid()).items():
            self.roles[pid] = next((role for role, module in ROLES if module in cmd), "other")
        self.sums = {"rank": 0.0, "engine": 0.0, "switch": 0.0, "other": 0.0}
        self._at: tuple[float, dict[int, float]] | None = None

    def _read(self) -> tuple[float, dict[int, float]]:
        from luwu.dataplane.process.children import cpu_seconds

        return time.process_time(), {pid: cpu_seconds(pid) for pid in self.roles}

    def start(self) -> None:
        self._at = self._read()

    def stop(self) -> None:
        if self._at is None:
            return
        (own0, kids0), (own1, kids1) = self._at, self._read()
        self._at = None
        self.sums["rank"] += own1 - own0
        for pid, role in self.roles.items():
            self.sums[role] += max(0.0, kids1[pid] - kids0[pid])  # gone: its clock reads 0

    def exclude(self, seconds: float) -> None:
        """Leave out `seconds` of this thread's work done inside the open window (none open: no-op)."""
        if self._at is not None:
            self.sums["rank"] -= seconds

    def totals(self) -> dict[str, float]:
        return dict(self.sums)


def _warm_up(rank: int, seconds: float) -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 16)
    t0 = time.perf_counter()
    for _ in range(WARMUP_CALLS):
        dist.all_reduce(t.fill_(1.0))
        go = torch.tensor([0.0 if rank == 0 and time.perf_counter() - t0 >= seconds else 1.0])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)  # rank 0's clock decides for every rank
        if go.item() == 0.0:
            return


def _rank(rank: int, workers: int, store: str, backend: str, sizes: list[int], iters: int, dtype: str,
          verify: bool, warmup: float, out_q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        import luwu  # noqa: F401 - registers the luwu backend
        from luwu.bench import allreduce_check, rendezvous

        torch.set_num_threads(1)
        rendezvous.init_group(backend, store, rank, workers)
        out: dict = {}
        try:
            _warm_up(rank, warmup)
            for nbytes in sizes:
                numel = max(1, nbytes // 4)
                x = torch.from_numpy(allreduce_check.inputs(rank, numel, dtype))
                t = torch.empty_like(x)
                times = []
                clock = JobClock()
                for i in range(iters + 1):
                    c0 = time.thread_time()
                    t.copy_(x)
                    clock.exclude(time.thread_time() - c0)  # restoring the input is not the call's work
                    if i > 1:
                        clock.stop()  # call i - 1's window ends where the next barrier starts
                    dist.barrier()
                    if i:
                        clock.start()
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    if i:
                        times.append(time.perf_counter() - t0)
                dist.barrier()  # every rank is done: what the daemons did for the last call is in
                clock.stop()
                out[nbytes] = {"seconds": times, "cpu_s": clock.totals()}
                if verify and rank == 0 and backend == "luwu":
                    out[nbytes]["verify"] = allreduce_check.verify(t.numpy(), workers, numel, dtype, _lanes())
        finally:
            dist.destroy_process_group()
        out_q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported by the parent, which would otherwise wait out its timeout
        out_q.put((rank, "error", traceback.format_exc()))


def run_backend(backend: str, workers: int, sizes: list[int], iters: int, dtype: str = "float32",
                verify: bool = False, warmup: float = 0.0) -> dict:
    """The sweep on `workers` spawned ranks of `backend`: {bytes: {"seconds" (slowest rank per
    iteration), "median_s", "cpu_s_per_call" (every process of the job), "cpu_s_per_call_by_role"
    (rank, engine, switch, other), "verify"?}}.

    Args:
        backend (str): "luwu" or "gloo" (any registered torch.distributed backend).
        workers (int): ranks.
        sizes (list[int]): bytes per rank's tensor.
        iters (int): timed all_reduce calls per size (after one warm-up).
        dtype (str): "float32" or "int32".
        verify (bool): check luwu's last result of every size on rank 0.
        warmup (float): seconds of all_reduce calls before the sweep.

    Returns:
        dict: per size, the per-iteration times, their median and the CPU seconds per call.

    Example:
        >>> run_backend("gloo", 2, [1024], 3)[1024]["median_s"] > 0
        True
    """
    from luwu.bench.rendezvous import spawn_ranks

    # rendezvous.py: the parent's store binds port 0, no race
    got: dict = spawn_ranks(_rank, workers, (backend, sizes, iters, dtype, verify, warmup), backend, SWEEP_TIMEOUT)
    res: dict = {}
    for nbytes in sizes:
        per_iter = np.max([got[r][nbytes]["seconds"] for r in range(workers)], axis=0)
        cpu = {role: sum(got[r][nbytes]["cpu_s"][role] for r in range(workers)) / iters
               for role in got[0][nbytes]["cpu_s"]}
        res[nbytes] = {"seconds": per_iter.tolist(), "median_s": float(np.median(per_iter)),
                       "cpu_s_per_call": sum(cpu.values()), "cpu_s_per_call_by_role": cpu}
        if "verify" in got[0][nbytes]:
            res[nbytes]["verify"] = got[0][nbytes]["verify"]
    return res


def sweep(workers: int, sizes: list[int], iters: int, dtype: str, verify: bool, gloo: bool,
          warmup: float = 0.0) -> dict:
    """luwu's sweep and Gloo's (float32 only: Gloo's int32 sums wrap as luwu's do, but the
    comparison users make is on gradients), and one row per size with the ratio."""
    res: dict = {"luwu": run_backend("luwu", workers, sizes, iters, dtype, verify, warmup)}
    if gloo:
        res["gloo"] = run_backend("gloo", workers, sizes, iters, dtype, warmup=warmup)
    rows = []
    for nbytes in sizes:
        row = {"bytes": nbytes, "luwu_s": res["luwu"][nbytes]["median_s"],
               "luwu_gbps": nbytes / res["luwu"][nbytes]["median_s"] / 1e9,
               "luwu_cpu_s": res["luwu"][nbytes]["cpu_s_per_call"]}
        if gloo:
            row["gloo_s"] = res["gloo"][nbytes]["median_s"]
            row["gloo_gbps"] = nbytes / row["gloo_s"] / 1e9
            row["ratio_to_gloo"] = row["gloo_s"] / row["luwu_s"]
            row["gloo_cpu_s"] = res["gloo"][nbytes]["cpu_s_per_call"]
            row["cpu_ratio_to_gloo"] = row["luwu_cpu_s"] / row["gloo_cpu_s"]
        if "verify" in res["luwu"][nbytes]:
            row["verify"] = res["luwu"][nbytes]["verify"]
        rows.append(row)
    res["sweep"] = rows
    return res


def print_lines(res: dict) -> None:
    """Per size `allreduce_<size>_luwu_ms`, `_gloo_ms`, `_ratio_to_gloo`, `_luwu_cpu_ms`, `_gloo_cpu_ms`,
    `_cpu_ratio_to_gloo` (grep-able `key: value`)."""
    for row in res["sweep"]:
        label = size_label(row["bytes"])
        print(f"allreduce_{label}_luwu_ms: {row['luwu_s'] * 1e3:.4f}")
        print(f"allreduce_{label}_luwu_cpu_ms: {row['luwu_cpu_s'] * 1e3:.4f}")
        if "gloo_s" in row:
            print(f"allreduce_{label}_gloo_ms: {row['gloo_s'] * 1e3:.4f}")
            print(f"allreduce_{label}_gloo_cpu_ms: {row['gloo_cpu_s'] * 1e3:.4f}")
            print(f"allreduce_{label}_ratio_to_gloo: {row['ratio_to_gloo']:.4f}")
            print(f"allreduce_{label}_cpu_ratio_to_gloo: {row['cpu_ratio_to_gloo']:.4f}")
        if "verify" in row:
            print(f"allreduce_{label}_verify_mismatches: {row['verify']['mismatches']}")


def plot(path, res: dict) -> None:
    """Time against size (log-log), luwu and Gloo, and the ratio below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["sweep"]
    x = [r["bytes"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot(x, [r["luwu_s"] * 1e3 for r in rows], "o-", color="tab:blue", label="luwu")
    if rows and "gloo_s" in rows[0]:
        top.plot(x, [r["gloo_s"] * 1e3 for r in rows], "s-", color="tab:gray", label="gloo")
        bottom.plot(x, [r["ratio_to_gloo"] for r in rows], "o-", color="tab:blue")
    bottom.axhline(1.0, color="k", lw=0.8, ls="--")
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    top.set_ylabel("dist.all_reduce time (ms, median)")
    top.legend()
    bottom.set_ylabel("Gloo time / luwu time")
    bottom.set_xlabel("bytes per rank")
    top.set_title(f"dist.all_reduce, {res['workers']} ranks, {res['dtype']} (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
