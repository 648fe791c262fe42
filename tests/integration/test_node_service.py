"""The optimizer node on the network: a job handed over the control channel, workers pushing
gradients through the switch and pulling parameters back, compared with torch's AdamW run on
the averaged gradients in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from luwu.dataplane.engine import Engine
from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.dataplane.optimizer import JobSpec, LayerSpec, NodeConfig, OptimizerSpec
from luwu.dataplane.optimizer.control import ControlClient, ControlError
from luwu.dataplane.optimizer.service import OptimizerService

SHAPES = {0: {"w": (40, 30), "b": (30,)}, 1: {"w": (30, 7)}}


def _initial(seed=0):
    rng = np.random.default_rng(seed)
    return {lid: {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} for lid, shapes in SHAPES.items()}


def _grads(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return {lid: {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in shapes.items()}
            for lid, shapes in SHAPES.items()}


def _flat(named: dict, lid: int) -> np.ndarray:
    return np.concatenate([named[n].reshape(-1) for n in SHAPES[lid]])


@pytest.mark.parametrize("drop", [None, {"ingress": 0.03, "egress": 0.03}])
def test_workers_train_through_the_node_like_local_adamw(tmp_path, drop):
    workers, steps = 2, 3
    opt = OptimizerSpec("adamw", lr=0.01, weight_decay=0.1)
    job = JobSpec("svc", opt, [LayerSpec(lid, shapes, frozenset({"b"} & set(shapes))) for lid, shapes in SHAPES.items()],
                  served_dtype="fp32")
    init = _initial()
    plan = StarPlan(workers=workers, nodes=1, mode="tofino", node_pool=64, param_window=64)
    sid = plan.node_session(0)
    with LoopbackSwitch(plan, drop=drop, seed=9):
        service = OptimizerService(plan.node_plan(0), NodeConfig(state_dir=tmp_path / "state", ram_budget=64 << 20))
        service.start(control=f"unix:{tmp_path}/node.sock")
        engines = [Engine(plan.worker_plan(r)).start() for r in range(workers)]
        try:
            client = ControlClient(service.control.address)
            client.add_job(sid, workers, job.to_json(), initial=init)
            with pytest.raises(ControlError, match="already serves"):
                other = JobSpec("other", opt, job.layers, served_dtype="fp32")
                client.add_job(sid, workers, other.to_json(), initial=0)
            for step in range(steps):
                for lid in SHAPES:
                    for e in engines:
                        e.pull(sid, lid, step).wait(60)
                pushes = [e.push(sid, lid, _flat(_grads(r, step)[lid], lid))
                          for lid in reversed(list(SHAPES)) for r, e in enumerate(engines)]
                for h in pushes:
                    h.wait(60)
            final = {lid: [e.pull(sid, lid, steps).wait(60) for e in engines] for lid in SHAPES}
            stats = client.stats()
            client.close()
        finally:
            for e in engines:
                e.close()
            service.close()
    # the same training in one process: torch AdamW on the mean of the workers' gradients
    params = {(lid, n): torch.tensor(a, requires_grad=True) for lid, named in init.items() for n, a in named.items()}
    decay = [p for (lid, n), p in params.items() if n != "b"]
    no_decay = [p for (lid, n), p in params.items() if n == "b"]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01)
    for step in range(steps):
        for (lid, n), p in params.items():
            p.grad = torch.tensor(np.mean([_grads(r, step)[lid][n] for r in range(workers)], axis=0))
        ref.step()
    for lid in SHAPES:
        want = np.concatenate([params[(lid, n)].detach().numpy().reshape(-1) for n in SHAPES[lid]])
        for got in final[lid]:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert stats["engine"]["session 3"]["gradients"] == steps * len(SHAPES)
