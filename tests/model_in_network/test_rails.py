"""Hierarchical push/pull on a rail-only job, on loopback: 2 servers x 2 GPUs, each rail a switch
with its own optimizer node (a LocalNetwork per rail), the server's NVLink a point-to-point channel.

Rank r is GPU r % 2 of server r // 2 and sits on rail r % 2 only, so its node session sums one
rank per server; the rail's node owns rail shard r % 2 of every unit. The test proves the sums are
over every rank of the job: after a few SGD steps every rank's parameters equal the single-process
reference stepped with the mean gradient of all four ranks, and differ from what one rail's ranks
alone would give (so a per-rail sum could not pass).

Tolerance. SGD's step is lr times the mean gradient; the switch sums each rail's two server
partials in 32-bit fixed point (an error of a quantum, 2^-30 of a chunk's largest magnitude) and
the server partials are float64 sums rounded once: a few 1e-8 per step at these magnitudes. The
test allows 1e-5; one rail's mean alone is off by about 1e-1.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
from mnn_reference import run_ranks_in_threads
from torch import nn

from luwu.worker.model_in_network import SGD, ModelInNetwork
from luwu.worker.model_in_network.local import LocalNetwork
from luwu.worker.model_in_network.network import Slice
from luwu.worker.model_in_network.routes import PlanError
from luwu.worker.model_in_network.units import split_units
from luwu.worker.rails import shard_bounds

GPUS, SERVERS, STEPS, LR = 2, 2, 3, 0.5
WORLD = GPUS * SERVERS
WAIT = float(__import__("os").environ.get("R12A_WAIT", 300.0))  # s the ranks may take on a loaded 2-core machine


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))  # units of 25 and 18: 25 cuts unevenly


torch.manual_seed(7)
INITIAL = _build().state_dict()  # drawn once: the ranks' threads must not share torch's global generator


def _model() -> nn.Module:
    model = _build()
    model.load_state_dict(INITIAL)
    return model


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g) * (1 + rank)  # ranks differ a lot


def _reference(ranks: list[int]) -> dict[str, torch.Tensor]:
    """SGD on the mean gradient of `ranks`, in one process."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in ranks:
            x, y = _data(r, step)
            nn.functional.mse_loss(model(x), y).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad
                p.grad = None
        for g, p in zip(grads, model.parameters()):
            p.grad = g / len(ranks)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _rail_network(rail: LocalNetwork, rank: int):
    """Rank `rank`'s view of the rail-only job: rail r % GPUS's star (where it is rank r // GPUS),
    its node owning rail shard r % GPUS of every unit (the controller's cut), the job's size and
    this rank's rail group."""
    k = rank % GPUS
    net = rail.network(rank // GPUS)
    session = net.node_sessions[0]
    net.slices = {}
    for u in split_units(_model()):
        lo, hi = shard_bounds(u.numel, GPUS)[k]
        net.slices[u.index] = [Slice(lo, hi - lo, 0, session)]
    net.world, net.group_ranks, net.job_rank = WORLD, list(range(k, WORLD, GPUS)), rank
    return net


def test_rail_only_push_pull_sums_across_every_rank_not_one_rail(tmp_path):
    store = torch.distributed.HashStore()
    store.set_timeout(datetime.timedelta(seconds=WAIT))
    results: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []
    with LocalNetwork(SERVERS, 1, state_dir=tmp_path / "rail0") as rail0, \
            LocalNetwork(SERVERS, 1, state_dir=tmp_path / "rail1") as rail1:
        rails = [rail0, rail1]

        def work(rank: int) -> None:
            try:
                model = _model()
                mnn = ModelInNetwork(model, SGD(lr=LR), _rail_network(rails[rank % GPUS], rank), engine="embedded",
                                     served_dtype="fp32", store=store, timeout=WAIT)
                try:
                    for step in range(STEPS):
                        x, y = _data(rank, step)
                        nn.functional.mse_loss(mnn(x), y).backward()
                        mnn.step()
                    results[rank] = mnn.gather()
                    report = mnn.report()
                    assert report["counters"]["pushed_bytes"] < 4 * sum(u.numel for u in mnn.units) * STEPS
                finally:
                    mnn.close()
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        run_ranks_in_threads(work, WORLD, WAIT)
        published = [s["node"]["node"]["published"] for s in rail0.node_stats() + rail1.node_stats()]
    assert not errors, errors
    assert published == [STEPS * 2, STEPS * 2]  # each rail's node stepped its shard of both units every step
    everyone, one_rail = _reference(list(range(WORLD))), _reference([0, 2])
    off_by_one_rail = 0.0
    for rank in range(WORLD):
        assert set(results[rank]) == set(everyone)
        for name, want in everyone.items():
            got = results[rank][name]
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5, err_msg=f"rank {rank} {name}")
            off_by_one_rail = max(off_by_one_rail, float((got - one_rail[name]).abs().max()))
    assert off_by_one_rail > 1e-2  # the reference of one rail's ranks is far away: the test would see a per-rail sum


def test_a_rail_only_job_without_a_store_or_with_another_cut_fails_at_join(tmp_path):
    with LocalNetwork(SERVERS, 1, state_dir=tmp_path / "rail0") as rail0:
        net = _rail_network(rail0, 0)
        with pytest.raises(PlanError, match="pass store="):
            ModelInNetwork(_model(), SGD(lr=LR), net, engine="embedded")
        net.slices[0] = [Slice(0, 10, 0, net.node_sessions[0])]  # rank 0 reduces shard [0, 12) of unit 0
        with pytest.raises(PlanError, match="do not cover"):
            ModelInNetwork(_model(), SGD(lr=LR), net, engine="embedded", store=torch.distributed.HashStore())
