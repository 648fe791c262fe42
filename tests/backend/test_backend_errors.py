"""Errors of the luwu backend say what failed and what to check: an unreachable switch (at group
creation and mid-training), a dead engine daemon, unsupported reduce ops and dtypes, bad settings,
and `import luwu` without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.loopback import StarPlan, free_udp_port
from luwu.dataplane.loopback import plan_to_json as star_plan_to_json
from luwu.worker.backend import LuwuError
from luwu.worker.backend.config import BackendConfig
from luwu.worker.backend.process_group import LuwuProcessGroup


def _group(tmp_path, **cfg) -> LuwuProcessGroup:
    config = BackendConfig(workdir=str(tmp_path / "luwu"), **cfg)
    config.validate()
    return LuwuProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=20), config=config)


@pytest.mark.parametrize("engine", ["embedded", "process"])
def test_unreachable_switch_is_reported_by_group_creation(tmp_path, engine):
    plan = StarPlan(workers=1, transport="udp")
    plan.switch_ports = {p: ("127.0.0.1", free_udp_port()) for p in plan.ports}  # nobody listens there
    plan.assign_endpoints()
    path = tmp_path / "plan.json"
    path.write_text(star_plan_to_json(plan))
    with pytest.raises(LuwuError) as err:
        _group(tmp_path, engine=engine, plan_file=str(path), connect_timeout=2.0)
    msg = str(err.value)
    host, port = plan.switch_ports[1]
    assert "unreachable" in msg and f"{host}:{port}" in msg, msg
    assert "LUWU_PLAN" in msg and str(path) in msg, msg


def switch_dies_on_rank(rank: int, world: int) -> dict:
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(10)
    dist.all_reduce(t)
    dist.barrier()
    # the barrier's result may reach rank 0 before rank 1 (or need one resend): the kill waits until every rank
    # says, through the store and not the switch, that its barrier is done
    store = dist.distributed_c10d._get_default_store()
    store.add("barrier-done", 1)
    if rank == 0:
        while store.add("barrier-done", 0) < world:
            time.sleep(0.01)
        pg._lease.switch.kill()
    errors = []
    for _ in range(2):
        try:
            dist.all_reduce(torch.ones(10))
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            errors.append(f"{type(e).__name__}: {e}")
    return {"first_sum": float(t[0]), "errors": errors}


@pytest.mark.parametrize("transport", ["shm", "udp"])
def test_switch_dying_mid_training_names_the_switch(tmp_path, transport):
    results = run_ranks(switch_dies_on_rank, 2, tmp_path, env={"LUWU_ENGINE": "embedded", "LUWU_TRANSPORT": transport},
                        pg_timeout=20.0)
    for rank, res in enumerate(results):
        assert res["first_sum"] == 2.0
        first, second = res["errors"]
        assert first is not None and "LuwuError" in first, first
        # named by the engine's peer watch (UDP: IP_RECVERR, port unreachable; shm: the switch's pid has exited),
        # not the 20 s process-group timeout
        where = "switch 127.0.0.1:" if transport == "udp" else f"switch port {rank + 1} over shared memory (/dev/shm/"
        assert "stopped answering" in first and where in first, first
        assert "timeout of 20 s" not in first, first
        assert "embedded software switch" in first and "switch.log" in first, first
        assert second is not None and "broken by an earlier failure" in second, second


def mismatched_moves_on_rank(rank: int, world: int) -> dict:
    """Rank 1 sends 3 elements where rank 0 expects 2: rank 0's all_to_all and gather fail naming
    both sizes; the group goes on (a later all_reduce still sums)."""
    errors = {}
    # rank 1's input has 3 rows split [2, 1]: 2 rows go to rank 0, whose output expects 1 from each rank
    out = torch.zeros(2)
    inp = torch.full((2 if rank == 0 else 3,), float(rank))
    in_splits = [1, 1] if rank == 0 else [2, 1]
    try:
        dist.all_to_all_single(out, inp, [1, 1], in_splits)
        errors["all_to_all"] = None
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        errors["all_to_all"] = str(e)
    outs = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    try:
        dist.gather(torch.ones(2 + rank), outs, dst=0)
        errors["gather"] = None
    except Exception as e:  # noqa: BLE001
        errors["gather"] = str(e)
    t = torch.ones(4)
    dist.all_reduce(t)
    return {"errors": errors, "after": t.tolist()}


def test_mismatched_point_to_point_moves_name_both_sizes(tmp_path):
    results = run_ranks(mismatched_moves_on_rank, 2, tmp_path, env={"LUWU_ENGINE": "embedded"})
    root = results[0]["errors"]
    assert "rank 1 sends 8 bytes to rank 0" in root["all_to_all"] and "holds 4 bytes" in root["all_to_all"], root
    assert "rank 1's block for the gather has 12 bytes" in root["gather"] and "holds 8" in root["gather"], root
    assert results[1]["errors"] == {"all_to_all": None, "gather": None}, results[1]
    assert [r["after"] for r in results] == [[2.0] * 4, [2.0] * 4]


def test_dead_engine_daemon_is_named_with_its_log(tmp_path):
    pg = _group(tmp_path, engine="process")
    try:
        t = torch.ones(5)
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        assert t.tolist() == [1.0] * 5
        pg._link.proc.kill()
        pg._link.proc.wait(10)
        with pytest.raises(LuwuError) as err:
            pg.allreduce([torch.ones(5)], dist.AllreduceOptions()).wait(timedelta(seconds=30))
        msg = str(err.value)
        assert "engine daemon" in msg and "exited with code -9" in msg, msg
        assert pg._link.log_path in msg, msg
    finally:
        pg.shutdown()


def _opts(op):
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


def test_unsupported_ops_and_dtypes_raise_at_the_call(tmp_path):
    pg = _group(tmp_path, engine="embedded")
    try:
        cases = [  # (PRODUCT, bitwise ops, float64 and int64 MAX/MIN take the exact host path: tested with Gloo)
            (torch.ones(3), dist.ReduceOp.BAND, ["BAND of torch.float32", "integer or bool"]),
            (torch.ones(3, dtype=torch.int32), dist.ReduceOp.AVG, ["AVG of torch.int32"]),
            (torch.ones(3, dtype=torch.complex64), dist.ReduceOp.SUM, ["torch.complex64", "bfloat16"]),
        ]
        for t, op, words in cases:
            with pytest.raises(TypeError) as err:
                pg.allreduce([t], _opts(op))
            for w in words:
                assert w in str(err.value), (w, str(err.value))
        with pytest.raises(TypeError, match="sparse tensors reduce with SUM only"):  # COO SUM: sparse.py
            pg.allreduce([torch.ones(3).to_sparse()], _opts(dist.ReduceOp.MAX))
        with pytest.raises(TypeError, match="dense tensors only"):
            pg.allreduce([torch.ones(3, 3).to_sparse_csr()], _opts(dist.ReduceOp.SUM))
        with pytest.raises(ValueError, match="one tensor per call"):
            pg.broadcast([torch.ones(1), torch.ones(1)], dist.BroadcastOptions())
        # the group still works after refusing those
        t = torch.full((4,), 3.0)
        pg.allreduce([t], _opts(dist.ReduceOp.MAX)).wait()
        assert t.tolist() == [3.0] * 4
        # a bytes-exact collective takes any dtype, float64 included
        b = torch.tensor([1.5, -2.25], dtype=torch.float64)
        pg.broadcast([b], dist.BroadcastOptions()).wait()
        assert b.tolist() == [1.5, -2.25]
    finally:
        pg.shutdown()


def test_bad_settings_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="LUWU_ENGINE='gpu'.*process, embedded"):
        BackendConfig.from_env({"LUWU_ENGINE": "gpu"})
    with pytest.raises(ValueError, match="unknown packet mode"):
        BackendConfig.from_env({"LUWU_MODE": "huge"})
    with pytest.raises(ValueError, match="LUWU_CONNECT_TIMEOUT"):
        BackendConfig.from_env({"LUWU_CONNECT_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="not both"):
        BackendConfig.from_env({"LUWU_CONTROLLER": "127.0.0.1:1", "LUWU_PLAN": "/x.json"})
    with pytest.raises(ValueError, match="LUWU_JOB is not"):
        _group(tmp_path, controller="127.0.0.1:1")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"workers": 1, "colour": "red"}))
    with pytest.raises(ValueError, match="LUWU_PLAN=.*unknown keys"):
        _group(tmp_path, plan_file=str(bad))


def test_import_luwu_works_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # makes `import torch` fail
            "import luwu, luwu.worker.backend\nprint('ok', luwu.__version__)")
    env = dict(os.environ)
    env.pop("LUWU_NO_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


@pytest.mark.parametrize("first", ["torch", "luwu"])
def test_import_luwu_registers_the_backend(first):
    """Whichever is imported first; `import luwu` alone does not import torch (daemons stay light).
    (torch's entry-point autoload is off here: tests/backend/test_backend_entry_point.py covers it.)"""
    code = {"torch": "import torch.distributed as dist\nassert 'luwu' not in dist.Backend.backend_list\nimport luwu\n",
            "luwu": "import sys, luwu\nassert 'torch' not in sys.modules\nimport torch.distributed as dist\n"}[first]
    code += "print(dist.Backend.backend_list, dist.Backend.backend_capability['luwu'])"
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("LUWU_NO_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "'luwu'" in out.stdout and "['cpu', 'cuda']" in out.stdout, out.stdout


def test_a_udp_plan_file_without_endpoint_addresses_is_refused(tmp_path):
    """The switch accepts a UDP port only from the address the plan gave its endpoint: a plan file
    without them could only make every packet UNKNOWN_PORT, so it is refused up front."""
    from luwu.worker.backend.plan_source import plan_from_file

    plan = StarPlan(workers=1, transport="udp")
    plan.switch_ports = dict.fromkeys(plan.ports, ("127.0.0.1", 9))
    path = tmp_path / "plan.json"
    path.write_text(star_plan_to_json(plan))
    with pytest.raises(ValueError, match=r"endpoints has no address for switch port\(s\) \[1\]"):
        plan_from_file(0, 1, str(path))
    plan.assign_endpoints()
    path.write_text(star_plan_to_json(plan))
    assert plan_from_file(0, 1, str(path)).plan.wiring.local == plan.endpoints[1]


def test_a_per_rank_endpoint_plan_file_must_be_this_ranks_and_span_the_group(tmp_path):
    from luwu.dataplane.session import EndpointPlan, SessionSpec, Wiring
    from luwu.worker.backend.plan_source import plan_from_file

    def write(rank: int, workers: int) -> None:
        plan = EndpointPlan(Wiring(rank, "ip", ("10.0.0.2", 19541), ("10.0.0.100", 19541)),
                            [SessionSpec(session=1, kind="collective", epoch=1, pool_base=0, pool_size=16,
                                         num_workers=workers, lanes=64)])
        (tmp_path / f"plan-{rank}.json").write_text(plan.to_json())

    write(0, 2)
    write(1, 2)
    lease = plan_from_file(1, 2, str(tmp_path / "plan-{rank}.json"))  # {rank}: one file per rank
    assert lease.plan.wiring.rank == 1 and str(tmp_path / "plan-1.json") in lease.source
    with pytest.raises(ValueError, match="is the plan of rank 0, not of rank 1"):
        plan_from_file(1, 2, str(tmp_path / "plan-0.json"))
    write(0, 1)  # a session of one rank in a group of two: a partial sum
    with pytest.raises(RuntimeError, match="sums 1 of the group's 2 ranks"):
        plan_from_file(0, 2, str(tmp_path / "plan-{rank}.json"))


def test_rail_hierarchy_refuses_ranks_not_numbered_server_by_server():
    """Rail-only plan, 2 servers x 2 GPUs: rank = server * 2 + rail. If the launcher numbered them
    otherwise, a rail session would sum shards of different positions; the group refuses instead."""
    import json

    from luwu.worker.backend.hierarchy import RAIL_KEY, check_rails

    def store_with(rails: list[list[int]]):
        store = dist.HashStore()
        for r, sessions in enumerate(rails):
            store.set(RAIL_KEY.format(rank=r), json.dumps(sessions))
        return store

    good = [[1], [2], [1], [2]]  # rail 0 = session 1, rail 1 = session 2
    check_rails(store_with(good), 3, 4, 2, good[3], timeout=5)
    swapped = [[1], [1], [2], [2]]  # ranks 0 and 1 on one rail: numbered rail by rail
    with pytest.raises(LuwuError, match="not numbered server by server"):
        check_rails(store_with(swapped), 2, 4, 2, swapped[2], timeout=5)
    same = [[1], [1], [1], [1]]  # one rail for all: LOCAL_WORLD_SIZE does not match the plan
    with pytest.raises(LuwuError, match="share a rail session"):
        check_rails(store_with(same), 0, 4, 2, same[0], timeout=5)
