"""Several luwu process groups in one job: new_group runs its switch in the process of the first
group's switch and its engines in each rank's existing engine process (no new process), the groups'
sums stay apart, and destroying a subgroup leaves the world group working.

Real rank processes, engine processes (LUWU_ENGINE=process: the embedded default has none) and the embedded switch; timings are not asserted
(`luwu bench allreduce` prints them)."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from backend_harness import run_ranks


def groups_on_rank(rank: int, world: int) -> dict:
    from luwu.worker.backend import plan_source
    from luwu.worker.engine_link import EngineHost

    world_pg = dist.distributed_c10d._get_default_group()
    engine_pid = world_pg._link.proc.pid
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    everyone = dist.new_group(list(range(world)))
    mine = evens if rank % 2 == 0 else odds
    out = {}
    for step in range(3):  # interleaved: a sum never leaks into another group's
        t = torch.full((1000,), float(rank + 1 + 10 * step))
        dist.all_reduce(t, group=mine)
        out[f"pair{step}"] = t.numpy().copy()
        w = torch.arange(500, dtype=torch.int32) * (rank + 1)
        dist.all_reduce(w)
        out[f"world{step}"] = w.numpy().copy()
        e = torch.full((300,), float(rank))
        dist.all_reduce(e, group=everyone)
        out[f"everyone{step}"] = e.numpy().copy()
    backends = [mine, everyone]
    out["same_engine_process"] = all(b._link.proc.pid == engine_pid for b in backends)
    out["engine_users"] = EngineHost._current.users
    host = plan_source._switch_process
    out["switch_pid"] = host.pid if host is not None else None
    out["group_switch_pids"] = [b._lease.switch.pid for b in backends if b._lease.switch is not None]
    dist.destroy_process_group(mine)
    dist.destroy_process_group(everyone)
    w = torch.ones(100)
    dist.all_reduce(w)  # the world group outlives its subgroups
    out["after"] = w.numpy().copy()
    out["engine_users_after"] = EngineHost._current.users
    out["engine_alive"] = os.path.exists(f"/proc/{engine_pid}")
    return out


def test_subgroups_share_the_processes_and_stay_apart(tmp_path):
    world = 4
    results = run_ranks(groups_on_rank, world, tmp_path, env={"LUWU_ENGINE": "process"})
    for rank, res in enumerate(results):
        partner = rank ^ 2  # 0-2, 1-3
        for step in range(3):
            want = float(rank + 1 + 10 * step) + float(partner + 1 + 10 * step)
            np.testing.assert_array_equal(res[f"pair{step}"], np.full(1000, want, np.float32))
            np.testing.assert_array_equal(res[f"world{step}"], np.arange(500, dtype=np.int32) * 10)
            np.testing.assert_array_equal(res[f"everyone{step}"], np.full(300, 6.0, np.float32))
        np.testing.assert_array_equal(res["after"], np.full(100, 4.0, np.float32))
        assert res["same_engine_process"] and res["engine_users"] == 3 and res["engine_users_after"] == 1
        assert res["engine_alive"]
    # ranks 0 and 1 are rank 0 of a group: rank 0's groups run in the world switch's process; rank 1
    # started one switch process (for the odd pair), whose own group holds it
    assert results[0]["group_switch_pids"] == [results[0]["switch_pid"]] * 2
    assert results[1]["group_switch_pids"] == [results[1]["switch_pid"]]


def test_the_setup_bench_times_every_rank_of_a_working_group():
    """`luwu bench allreduce`'s init/new_group figures come from ranks whose new group really sums
    (measure raises otherwise); values are reported, never asserted on."""
    from luwu.bench.setup_times import measure

    res = measure(2, "luwu")
    assert len(res["init_s_per_rank"]) == 2 and len(res["new_group_s_per_rank"]) == 2
    assert res["init_s"] == max(res["init_s_per_rank"]) > 0 and res["new_group_s"] == max(res["new_group_s_per_rank"]) > 0
    assert res["first_allreduce_s"] == max(res["first_allreduce_s_per_rank"]) > 0
