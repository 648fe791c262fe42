"""The backend's loopback default over shared memory, end to end: `init_process_group("luwu")`
with no configuration wires every rank's engine (embedded thread or daemon process) to the
switch's shared-memory rings; sums are exact for int32 and within the documented fixed-point
bound for float32, and identical on every rank; `LUWU_TRANSPORT=udp` still selects UDP sockets;
a plan naming rings that do not exist is reported at group creation."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.loopback import StarPlan, plan_to_json
from luwu.dataplane.net.shm_ring import supported
from luwu.dataplane.protocol import Dtype
from luwu.dataplane.quantize import chunk_exponents, error_bound
from luwu.worker.backend import LuwuError
from luwu.worker.backend.config import BackendConfig
from luwu.worker.backend.process_group import LuwuProcessGroup

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")

NUMEL = 300_000  # several packets per rank in jumbo mode, and a partial last one


def _inputs(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    ints = rng.integers(-(2**31), 2**31, NUMEL, dtype=np.int64).astype(np.int32)
    floats = (rng.standard_normal(NUMEL, dtype=np.float32) * np.float32(10.0 ** rng.uniform(-3, 3))).astype(np.float32)
    return ints, floats


def sums_on_rank(rank: int, world: int) -> dict:
    pg = dist.distributed_c10d._get_default_group()
    wiring = pg._lease.plan.wiring
    ints, floats = _inputs(rank)
    ti, tf = torch.from_numpy(ints.copy()), torch.from_numpy(floats.copy())
    dist.all_reduce(ti)
    dist.all_reduce(tf)
    return {"transport": wiring.transport, "lanes": pg._lease.plan.sessions[0].lanes,
            "ints": ti.numpy(), "floats": tf.numpy()}


def _check(results: list, world: int, transport: str) -> None:
    xs = [_inputs(r) for r in range(world)]
    want_ints = xs[0][0].copy()
    for x, _ in xs[1:]:
        want_ints += x  # int32 wraps, like the switch's registers
    exact = np.sum([f.astype(np.float64) for _, f in xs], axis=0)
    lanes = data_lanes(results[0]["lanes"], Dtype.FIXED32)  # elements per packet (its last lanes: check words)
    exps = np.max([chunk_exponents(f, lanes) for _, f in xs], axis=0)
    for rank, res in enumerate(results):
        assert res["transport"] == transport, res["transport"]
        np.testing.assert_array_equal(res["ints"], want_ints, err_msg=f"rank {rank}: int32 sum not exact")
        err = np.abs(res["floats"].astype(np.float64) - exact)
        bound = error_bound(res["floats"], exps, lanes, world)
        assert (err <= bound).all(), f"rank {rank}: {int((err > bound).sum())} float sums outside the bound"
        np.testing.assert_array_equal(res["floats"], results[0]["floats"])  # one multicast sum for every rank


@pytest.mark.parametrize("engine", ["embedded", "process"])
def test_default_loopback_transport_is_shared_memory(tmp_path, engine):
    results = run_ranks(sums_on_rank, 3, tmp_path, env={"LUWU_ENGINE": engine})
    _check(results, 3, "shm")


def test_udp_stays_selectable(tmp_path):
    results = run_ranks(sums_on_rank, 2, tmp_path, env={"LUWU_ENGINE": "embedded", "LUWU_TRANSPORT": "udp"})
    _check(results, 2, "udp")


def test_missing_rings_are_reported_by_group_creation(tmp_path):
    plan = StarPlan(workers=1, transport="shm")
    prefix = f"/dev/shm/luwu-sw-test-missing-{tmp_path.name}"
    plan.switch_ports = dict.fromkeys(plan.ports, (prefix, 0))
    path = tmp_path / "plan.json"
    path.write_text(plan_to_json(plan))
    config = BackendConfig(workdir=str(tmp_path / "luwu"), engine="embedded", plan_file=str(path), connect_timeout=2.0)
    config.validate()
    with pytest.raises(LuwuError) as err:
        LuwuProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=20), config=config)
    msg = str(err.value)
    assert "unreachable" in msg and prefix in msg and str(path) in msg, msg
