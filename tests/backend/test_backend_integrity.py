"""No silent wrong result and no crash (issue 27, the backend's side): a switch that dies during
DDP's backward fails `loss.backward()` with the backend's named error on every rank (it used to
kill both ranks with SIGSEGV: worker/backend/work.py says why)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from backend_harness import run_ranks


def ddp_switch_dies_on_rank(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    store = dist.distributed_c10d._get_default_store()
    gen = torch.Generator().manual_seed(rank)
    steps_ok = 0
    for step in range(40):
        if step == 3:  # every rank has trained 3 steps: rank 0 kills the switch (SIGKILL), as an operator's mistake would
            store.add("trained", 1)
            if rank == 0:
                deadline = time.monotonic() + 60
                while store.add("trained", 0) < world and time.monotonic() < deadline:
                    time.sleep(0.01)
                pg = dist.distributed_c10d._get_default_group()
                os.kill(pg._lease.switch.pid, signal.SIGKILL)
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            return {"steps_ok": steps_ok, "error": f"{type(e).__name__}: {e}"}
        opt.step()
        steps_ok += 1
    return {"steps_ok": steps_ok, "error": None}


def test_switch_dying_in_ddp_backward_names_the_switch(tmp_path):
    results = run_ranks(ddp_switch_dies_on_rank, 2, tmp_path, env={"LUWU_TRANSPORT": "shm"}, pg_timeout=30.0)
    for rank, res in enumerate(results):
        err = res["error"]
        assert res["steps_ok"] >= 3, res
        assert err is not None, f"rank {rank} trained on after the switch died: {res}"
        assert err.startswith("RuntimeError") and "LuwuError" in err, err
        assert f"switch port {rank + 1} over shared memory" in err and "stopped answering" in err, err
