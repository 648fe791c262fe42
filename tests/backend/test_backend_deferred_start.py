"""The deferred start-up (docs/backend.md "Start-up"): `init_process_group("luwu")` returns before the
plan, the engine and the start barrier; the group's first operation waits for them. Checked here:
collectives right after init give Gloo's results, a `new_group` made before the world group has
started works, a group destroyed before it started leaves nothing behind, a start-up error is
raised (named) by the first operation, and LUWU_EAGER_START=1 starts the group inside init."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.loopback import StarPlan, free_udp_port
from luwu.dataplane.loopback import plan_to_json as star_plan_to_json
from luwu.worker.backend import LuwuError
from luwu.worker.backend.config import BackendConfig
from luwu.worker.backend.process_group import LuwuProcessGroup

DEADLINE = 30.0  # s for a child process to be gone (a bound, never an assertion on speed)


def first_ops_on_rank(rank: int, world: int) -> dict:
    pg = dist.distributed_c10d._get_default_group()
    out = {"started_inside_init": pg._started.is_set()}
    pair = dist.new_group(list(range(world)))  # created while the world group may still be starting
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    out["sum"] = t.numpy().copy()
    p = torch.full((257,), float(rank + 1), dtype=torch.float32)
    dist.all_reduce(p, group=pair)
    out["pair"] = p.numpy().copy()
    b = torch.full((5,), float(rank), dtype=torch.float32)
    dist.broadcast(b, src=1)
    out["bcast"] = b.numpy().copy()
    return out


@pytest.mark.parametrize("eager", ["", "1"])
def test_collectives_right_after_init_and_a_new_group_before_start_up(tmp_path, eager):
    world = 2
    res = run_ranks(first_ops_on_rank, world, tmp_path, env={"LUWU_EAGER_START": eager})
    scale = sum(r + 1 for r in range(world))
    for r, out in enumerate(res):
        np.testing.assert_array_equal(out["sum"], np.arange(1000, dtype=np.float32) * scale)
        np.testing.assert_array_equal(out["pair"], np.full(257, float(scale), np.float32))
        np.testing.assert_array_equal(out["bcast"], np.ones(5, np.float32))
        if eager:
            assert out["started_inside_init"], f"rank {r}: LUWU_EAGER_START=1 returned before the start-up"


def destroy_at_once_on_rank(rank: int, world: int) -> dict:
    pg = dist.distributed_c10d._get_default_group()
    workdir = pg.workdir
    dist.destroy_process_group()  # no operation: the start-up is finished (or failed) and undone
    return {"workdir": workdir, "exists": os.path.exists(workdir), "error": repr(pg._start_error)}


def test_destroy_before_any_operation_waits_for_the_start_up_and_cleans_up(tmp_path):
    res = run_ranks(destroy_at_once_on_rank, 2, tmp_path, env={"LUWU_WORKDIR": ""})
    for r, out in enumerate(res):
        assert out["error"] == "None", f"rank {r}: {out['error']}"
        assert not out["exists"], f"rank {r} left its work directory {out['workdir']}"


def _children(pid: int) -> set[int]:
    kids = set()
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.add(int(p))
        except (OSError, ValueError):
            continue
    return kids


@pytest.mark.parametrize("engine", ["embedded", "process"])
def test_a_start_up_error_is_raised_by_the_first_operation(tmp_path, engine):
    plan = StarPlan(workers=1, transport="udp")
    plan.switch_ports = {p: ("127.0.0.1", free_udp_port()) for p in plan.ports}  # nobody listens there
    plan.assign_endpoints()
    path = tmp_path / "plan.json"
    path.write_text(star_plan_to_json(plan))
    before = _children(os.getpid())
    config = BackendConfig(workdir=str(tmp_path / "luwu"), engine=engine, plan_file=str(path), connect_timeout=2.0)
    pg = LuwuProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=20), config=config, deferred=True)
    for _ in range(2):  # every later operation says the same
        with pytest.raises(LuwuError) as err:
            pg.allreduce([torch.ones(4)]).wait()
        msg = str(err.value)
        assert "could not start" in msg and "unreachable" in msg and str(path) in msg, msg
    with pytest.raises(LuwuError, match="could not start"):
        pg.send([torch.ones(2)], 0, 0)
    deadline = time.monotonic() + DEADLINE
    while _children(os.getpid()) - before:  # the engine process it launched is stopped
        assert time.monotonic() < deadline, f"left running: {_children(os.getpid()) - before}"
        time.sleep(0.05)
    pg.shutdown()  # idempotent after the failed start-up


def test_the_creator_defers_unless_eager_start_is_set(monkeypatch):
    monkeypatch.delenv("LUWU_EAGER_START", raising=False)
    assert BackendConfig.from_env().eager_start is False
    monkeypatch.setenv("LUWU_EAGER_START", "1")
    assert BackendConfig.from_env().eager_start is True
