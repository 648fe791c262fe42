"""torch's own tools see the luwu backend as a registered backend for cpu and cuda: the device
table (`_device_types`, `_get_backend`), the default device, `is_backend_available`, the group's
timeout, and `torch.distributed.checkpoint.async_save` (which needs a CPU backend) on 2 ranks."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from backend_harness import run_ranks

import luwu  # noqa: F401 - registers the backend


def test_registered_like_a_third_party_backend():
    assert dist.is_backend_available("luwu")
    assert dist.Backend.backend_capability["luwu"] == ["cpu", "cuda"]
    assert dist.Backend("luwu") == "luwu"


def _device_table(rank, world):
    pg = dist.group.WORLD
    out = {"types": [d.type for d in pg._device_types]}
    be = pg._get_backend(torch.device("cpu"))
    out["name"] = be.name()
    out["rank_size"] = (be.rank(), be.size())
    out["cuda_name"] = pg._get_backend(torch.device("cuda")).name()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the helper's deprecation notice
        out["default"] = dist.distributed_c10d._get_pg_default_device().type
    out["object_device"] = dist.distributed_c10d._get_object_coll_device()
    try:
        pg._get_backend(torch.device("meta"))
        out["meta"] = "no error"
    except RuntimeError as e:
        out["meta"] = str(e)
    # torch's helper only changes Gloo/NCCL backends (it warns for others); set_timeout changes luwu's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=77))
    pg.set_timeout(timedelta(seconds=41))
    out["timeout"] = pg._timeout.total_seconds()
    be.set_timeout(timedelta(seconds=42))
    out["timeout_backend"] = pg._timeout.total_seconds()
    x = torch.full((5,), float(rank + 1))
    be.allreduce([x]).wait()  # the backend's collectives are the group's
    out["sum"] = x.numpy()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    out["objects"] = objs
    return out


def test_device_table_default_device_and_timeout(tmp_path):
    for r, out in enumerate(run_ranks(_device_table, 2, tmp_path)):
        assert out["types"] == ["cpu", "cuda"]
        assert out["name"] == "luwu" and out["cuda_name"] == "luwu"
        assert out["rank_size"] == (r, 2)
        assert out["default"] == "cpu" and out["object_device"] == "cpu"
        assert "meta" in out["meta"] and "luwu" in out["meta"], out["meta"]
        assert out["timeout"] == 41 and out["timeout_backend"] == 42
        np.testing.assert_array_equal(out["sum"], np.full(5, 3.0, np.float32))
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]


def _async_save_and_load(rank, world):
    import torch.distributed.checkpoint as dcp

    path = os.environ["DCP_PATH"]
    g = torch.Generator().manual_seed(7)
    # replicated (as DDP's state dict): DCP writes each entry once and every rank loads it back
    state = {"w": torch.randn(64, 8, generator=g), "b": torch.arange(10, dtype=torch.int64) * 3,
             "step": torch.tensor(3)}
    fut = dcp.async_save(state, checkpoint_id=path)
    fut.result(timeout=120)
    dist.barrier()
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=path)
    return {k: (state[k].numpy(), back[k].numpy()) for k in state}


def test_dcp_async_save_and_load(tmp_path):
    path = tmp_path / "ckpt"
    results = run_ranks(_async_save_and_load, 2, tmp_path, env={"DCP_PATH": str(path)})
    assert (path / ".metadata").exists()
    for out in results:
        for saved, loaded in out.values():
            np.testing.assert_array_equal(saved, loaded)
        assert np.abs(out["w"][1]).sum() > 0  # loaded from the files, not the zeros it started from
