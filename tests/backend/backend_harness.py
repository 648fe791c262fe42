"""Runs a function on N real rank processes (multiprocessing spawn) under torch.distributed and
collects what each returns; used by the backend tests. Every rank gets a FileStore rendezvous in
the test's tmp dir, OMP_NUM_THREADS=1, and the environment the test asks for (LUWU_*)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from datetime import timedelta

from luwu.dataplane.process.children import join_or_kill

RUN_TIMEOUT = 150.0  # s for a whole multi-rank run (bounded; the machine is shared)


def _entry(rank: int, world: int, init: str, backend: str, fn, env: dict, pg_timeout: float, q) -> None:
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import luwu  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        result = fn(rank, world)
        q.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn, world: int, tmp_path, backend: str = "luwu", env: dict | None = None, pg_timeout: float = 60.0,
              timeout: float = RUN_TIMEOUT) -> list:
    """fn(rank, world) on every rank; returns the per-rank results (picklable: use numpy, not tensors)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path}/store-{backend}-{os.urandom(4).hex()}"
    env = {"LUWU_WORKDIR": str(tmp_path / "luwu"), **(env or {})}
    procs = [ctx.Process(target=_entry, args=(r, world, init, backend, fn, env, pg_timeout, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world):
            try:
                rank, status, value = q.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(results) - set(errors))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s; errors so far: {errors}") from None
            (results if status == "ok" else errors)[rank] = value
    finally:
        join_or_kill(procs)
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world)]
