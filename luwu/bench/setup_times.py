"""How long a job waits for its process groups: `init_process_group` and one `new_group` of every
rank, for the luwu backend and for Gloo in the same run (`luwu bench allreduce` prints them).

Each rank is a spawned process; the ranks meet at a barrier after their imports (torch, luwu) and
the clock starts there, so the figures are what a training script waits for in the backend: without
the barrier a rank whose imports finished first would count the others' imports (0.0-0.9 s for Gloo
as for luwu on a busy 2-core machine) as init time. A rank's time is its wall time; the job's is the
slowest rank's (every rank waits for it). A one-element allreduce in the new group checks that it works.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

SETUP_TIMEOUT = 300.0  # s for a whole measurement (bounded; the machine is shared)


def _rank(rank: int, workers: int, store: str, backend: str, out_q, ready) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import luwu  # noqa: F401 - registers the luwu backend
    from luwu.bench import rendezvous

    ready.wait(SETUP_TIMEOUT)  # every rank has imported: the clock measures the backend, not import skew
    t0 = time.perf_counter()
    rendezvous.init_group(backend, store, rank, workers)
    t1 = time.perf_counter()
    w = torch.ones(1)
    dist.all_reduce(w)
    t2 = time.perf_counter()
    group = dist.new_group(list(range(workers)))
    t3 = time.perf_counter()
    x = torch.ones(1)
    dist.all_reduce(x, group=group)
    dist.destroy_process_group()
    out_q.put((rank, t1 - t0, t3 - t2, float(x[0]) + float(w[0]) - workers, t2 - t1))


def measure(workers: int, backend: str) -> dict:
    """{"init_s", "first_allreduce_s", "new_group_s"} (the slowest rank's) for `workers` ranks of
    `backend` on loopback."""
    from luwu.bench.rendezvous import host_store
    from luwu.dataplane.process.children import join_or_kill

    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    ready = ctx.Barrier(workers)
    with host_store() as store:  # rendezvous.py: the store binds port 0, no race
        procs = [ctx.Process(target=_rank, args=(r, workers, store, backend, out_q, ready), daemon=True)
                 for r in range(workers)]
        for p in procs:
            p.start()
        try:
            got = [out_q.get(timeout=SETUP_TIMEOUT) for _ in procs]
        finally:
            join_or_kill(procs)
    bad = [g[0] for g in got if g[3] != workers]
    if bad:
        raise RuntimeError(f"{backend}: the first or the new group's allreduce gave a wrong sum on ranks {bad}")
    return {"init_s": max(g[1] for g in got), "new_group_s": max(g[2] for g in got),
            "first_allreduce_s": max(g[4] for g in got), "first_allreduce_s_per_rank": [g[4] for g in sorted(got)],
            "init_s_per_rank": [g[1] for g in sorted(got)], "new_group_s_per_rank": [g[2] for g in sorted(got)]}
