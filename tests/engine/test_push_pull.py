"""Push and pull through a node session: workers' gradients summed by the switch into the node,
parameters multicast back; with loss; with the switch's pool missing (software fallback at the
node); bf16 parameters."""

from __future__ import annotations

import numpy as np
import pytest
from node_star import node_star

from luwu.dataplane.engine.node_worker import as_float32
from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.loopback import StarPlan
from luwu.dataplane.protocol import Dtype
from luwu.dataplane.quantize import chunk_exponents, error_bound
from luwu.mininet.paramstore import SgdParamStore

DATA = data_lanes(64, Dtype.FIXED32)  # gradient elements per packet in tofino mode (2 lanes are check words)


def _run(workers: int, layers: dict[int, np.ndarray], grads, drop=None, runtime_edit=None, bf16=False, pull_out=True):
    plan = StarPlan(workers=workers, nodes=1, mode="tofino", node_pool=32, param_window=64)
    runtime = plan.runtime()
    if runtime_edit:
        runtime_edit(runtime)
    server = SgdParamStore(layers, lr=0.5, bf16=bf16)
    sid = plan.node_session(0)
    with node_star(plan, server, drop=drop, seed=5, runtime=runtime) as star:
        engines = star.engines
        first = {t: [e.pull(sid, t, 0).wait(60) for e in engines] for t in layers}
        pushes = [e.push(sid, t, grads[r][t]) for t in layers for r, e in enumerate(engines)]
        for h in pushes:
            h.wait(60)
        outs = {t: [np.empty(layers[t].size, np.float32) for _ in engines] for t in layers}
        second = {t: [e.pull(sid, t, 1, out=o if pull_out else None).wait(60) for e, o in zip(engines, outs[t])]
                  for t in layers}
        stats = star.node.session_stats()
    return first, second, server, stats, star.counters


def _expected(layers, grads, t, lr=0.5):
    n = len(grads)
    exact = layers[t].astype(np.float64) - lr * np.sum([g[t].astype(np.float64) for g in grads], axis=0)
    exps = np.max([chunk_exponents(g[t], DATA) for g in grads], axis=0)
    gsum = np.sum([g[t].astype(np.float64) for g in grads], axis=0)
    bound = lr * error_bound(gsum.astype(np.float32), exps, DATA, n) + np.spacing(np.abs(exact).astype(np.float32))
    return exact, bound


def _layers_and_grads(workers, seed=0):
    rng = np.random.default_rng(seed)
    layers = {7: rng.standard_normal(1000).astype(np.float32), 3: rng.standard_normal(70).astype(np.float32),
              9: rng.standard_normal(1).astype(np.float32)}
    grads = [{t: (rng.standard_normal(p.size) * 0.01).astype(np.float32) for t, p in layers.items()}
             for _ in range(workers)]
    return layers, grads


@pytest.mark.parametrize("drop", [None, {"ingress": 0.05, "egress": 0.05, "duplicate": 0.02, "reorder": 0.02}])
def test_push_then_pull_applies_the_summed_gradient(drop):
    layers, grads = _layers_and_grads(3)
    first, second, _server, stats, _counters = _run(3, layers, grads, drop=drop)
    for t, p in layers.items():
        for got in first[t]:
            np.testing.assert_array_equal(got, p)
        exact, bound = _expected(layers, grads, t)
        for got in second[t]:
            assert (np.abs(got - exact) <= bound).all()
    assert stats["session 3"]["gradients"] == len(layers)


def test_fallback_when_the_switch_has_no_pool_for_the_session():
    """The switch does not own the session's slots: it forwards every GRAD to the node (ATP-style),
    which aggregates in software; results are the same."""
    def no_pool(runtime):
        for e in runtime["table_entries"]:
            if e["table"] == "sessions" and e["match"]["session"] == 3:
                e["action_params"]["pool_base"] = 4000
                e["action_params"]["pool_size"] = 1

    layers, grads = _layers_and_grads(2, seed=1)
    _, second, _, stats, _ = _run(2, layers, grads, runtime_edit=no_pool)
    for t in layers:
        exact, bound = _expected(layers, grads, t)
        for got in second[t]:
            assert (np.abs(got - exact) <= bound).all()
    assert stats["session 3"]["fallback_packets"] > 0


def test_bf16_parameters_arrive_as_bf16():
    layers, grads = _layers_and_grads(2, seed=2)
    first, _, _, _, _ = _run(2, layers, grads, bf16=True)
    for t, p in layers.items():
        want = ((p.view(np.uint32) >> 16).astype(np.uint16))
        for got in first[t]:
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bf16", [False, True])
def test_pulls_into_a_buffer_are_the_staged_bits(bf16):
    """A pull with `out` decodes the PARAM packets straight into it (node_worker.py `_decode_run`:
    whole chunks, the short last one, bf16 widened to float32): every bit equals the staged pull's
    (no `out`) converted as `_complete` converts it, for layers of 1, 70 and 1000 elements."""
    layers, grads = _layers_and_grads(2, seed=4)
    _, second, _, _, _ = _run(2, layers, grads, bf16=bf16)
    _, second_staged, _, _, _ = _run(2, layers, grads, bf16=bf16, pull_out=False)
    for t in layers:
        for direct, staged in zip(second[t], second_staged[t]):
            want = as_float32(staged, Dtype.BF16) if bf16 else staged
            assert direct.dtype == np.float32 and staged.dtype == (np.uint16 if bf16 else np.float32)
            np.testing.assert_array_equal(direct.view(np.uint32), want.view(np.uint32))
