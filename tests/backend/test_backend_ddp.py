"""Acceptance: DistributedDataParallel with backend="luwu" trains to the same parameters as with
backend="gloo", for 2 and 4 workers.

Every rank trains three copies of one model on its own data: DDP over the default luwu group, DDP
over a Gloo group of the same ranks, and (to show the test can fail) the same model without any
gradient exchange. Small DDP buckets make several allreduces per step, in flight together.

Tolerance. Per step, an element of luwu's averaged gradient differs from the exact sum by at most
N*u/2 + ulp/2 with u = 2^(e + c - 31) <= 2^(c - 30) * max|g| (docs/protocol.md 5; 2^e <= 2 max|g|),
and Gloo's float32 sum from the exact one by at most about (N - 1) ulp; so the two updates differ
by at most lr * (N * 2^(c - 30) + 2^-22) * max|g| per element per step. Over S steps that adds up
to S times that; the training dynamics can amplify a perturbation, which for these few small
steps is covered by a factor of 10. The luwu replicas themselves must be bit-identical (every rank
receives the same multicast sum), and the model without gradient exchange must end up farther
from the DDP result than the tolerance by a wide margin.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from luwu.dataplane.quantize import contributor_bits

STEPS, LR, SAFETY = 8, 0.05, 10.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 4))


def train_on_rank(rank: int, world: int) -> dict:
    gloo = dist.new_group(backend="gloo")
    models = {"luwu": DDP(_model(), bucket_cap_mb=0.004), "gloo": DDP(_model(), process_group=gloo, bucket_cap_mb=0.004),
              "local": _model()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in models.items()}
    gen = torch.Generator().manual_seed(1000 + rank)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    max_grad = 0.0
    for _ in range(STEPS):
        x = torch.randn(32, 16, generator=gen)
        y = x @ w
        for k, m in models.items():
            opts[k].zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if k == "gloo":
                max_grad = max(max_grad, max(p.grad.abs().max().item() for p in m.parameters()))
            opts[k].step()
    init = torch.cat([p.detach().reshape(-1) for p in _model().parameters()]).numpy()
    params = {k: torch.cat([p.detach().reshape(-1) for p in (m.module if k != "local" else m).parameters()]).numpy()
              for k, m in models.items()}
    return {"params": params, "init": init, "max_grad": max_grad}


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_luwu_trains_like_gloo(tmp_path, world):
    results = run_ranks(train_on_rank, world, tmp_path)
    max_grad = max(r["max_grad"] for r in results)
    c = contributor_bits(world)
    tol = SAFETY * STEPS * LR * (world * 2.0 ** (c - 30) + 2.0 ** -22) * max_grad
    luwu0 = results[0]["params"]["luwu"]
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["params"]["luwu"], luwu0, err_msg=f"luwu replica of rank {r} differs")
        diff = np.abs(res["params"]["luwu"] - res["params"]["gloo"]).max()
        assert diff <= tol, f"rank {r}: luwu and gloo parameters differ by {diff} > tolerance {tol}"
    moved = np.abs(luwu0 - results[0]["init"]).max()
    unsynced = max(np.abs(res["params"]["local"] - res["params"]["gloo"]).max() for res in results)
    assert moved > 100 * tol, f"training barely moved the parameters ({moved}), the comparison proves nothing"
    assert unsynced > 100 * tol, f"training without gradient exchange is within {unsynced} of DDP: the test is blind"
