"""Bad input is refused with a clear ValueError (counted in stats) and leaves the state untouched:
wrong size or dtype, unknown job or layer, steps out of order, NaN/Inf, bad specs and configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optimizer_reference import initial_values, model_layers, summed_grad

from luwu.dataplane.optimizer import (
    BadGradient,
    JobSpec,
    LayerSpec,
    NodeConfig,
    NonFiniteGradient,
    OptimizerInputError,
    OptimizerNode,
    OptimizerSpec,
    ScheduleSpec,
    StepOutOfOrder,
    UnknownJob,
    UnknownLayer,
)


@pytest.fixture
def node(tmp_path):
    layers = model_layers(3)
    n = OptimizerNode(NodeConfig(tmp_path / "state", ram_budget=16 << 20))
    n.add_job(JobSpec("job", OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1), layers, "bf16", initial_values(layers)))
    yield n
    n.close()


def _snapshot(node):
    return {lid: node.layer_state("job", lid) for lid in node.jobs["job"].layers}


def _same(a, b):
    for lid in a:
        for k, v in a[lid].items():
            assert np.array_equal(np.asarray(v), np.asarray(b[lid][k])), (lid, k)


def _good(node, lid, step=0):
    return summed_grad(node.jobs["job"].layers[lid].plan.spec, step, 1)


BAD_CASES = [
    ("wrong size", lambda n: ("job", 1, 0, np.zeros(7, np.float32)), BadGradient, "elements"),
    ("float64", lambda n: ("job", 1, 0, _good(n, 1).astype(np.float64)), BadGradient, "float32"),
    ("float16 tensor", lambda n: ("job", 1, 0, torch.zeros(n.jobs["job"].layers[1].plan.numel, dtype=torch.float16)),
     BadGradient, "float32"),
    ("not an array", lambda n: ("job", 1, 0, [0.0] * 10), BadGradient, "numpy array"),
    ("strided", lambda n: ("job", 1, 0, np.zeros(2 * n.jobs["job"].layers[1].plan.numel, np.float32)[::2]),
     BadGradient, "contiguous"),
    ("NaN", lambda n: ("job", 1, 0, np.where(np.arange(n.jobs["job"].layers[1].plan.numel) == 5, np.nan,
                                            _good(n, 1)).astype(np.float32)), NonFiniteGradient, "NaN"),
    ("Inf", lambda n: ("job", 1, 0, np.full(n.jobs["job"].layers[1].plan.numel, np.inf, np.float32)),
     NonFiniteGradient, "Inf"),
    ("unknown job", lambda n: ("nope", 1, 0, _good(n, 1)), UnknownJob, "unknown job"),
    ("unknown layer", lambda n: ("job", 99, 0, _good(n, 1)), UnknownLayer, "no layer 99"),
    ("step ahead", lambda n: ("job", 1, 1, _good(n, 1)), StepOutOfOrder, "expected step 0"),
    ("negative step", lambda n: ("job", 1, -1, _good(n, 1)), StepOutOfOrder, "expected step 0"),
]


@pytest.mark.parametrize("name,make,exc,words", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_gradient_is_refused_and_state_untouched(node, name, make, exc, words):
    before = _snapshot(node)
    with pytest.raises(exc, match=words) as info:
        node.submit_gradient(*make(node))
    assert isinstance(info.value, ValueError)
    assert node.wait_idle(30)
    _same(before, _snapshot(node))
    st = node.stats()["node"]
    assert sum(st["rejected"].values()) == 1 and st["submitted"] == 0
    # the layer still takes its real step 0 afterwards
    node.submit_gradient("job", 1, 0, _good(node, 1))
    assert node.params("job", 1, 1, timeout=30) is not None


def test_duplicate_and_out_of_order_steps(node):
    node.submit_gradient("job", 0, 0, _good(node, 0))
    with pytest.raises(StepOutOfOrder, match="got step 0, expected step 1"):
        node.submit_gradient("job", 0, 0, _good(node, 0))
    with pytest.raises(StepOutOfOrder, match="expected step 1"):
        node.submit_gradient("job", 0, 2, _good(node, 0, 2))
    node.params("job", 0, 1, timeout=30)
    assert node.version("job", 0) == 1
    assert node.stats()["node"]["rejected"] == {"step_out_of_order": 2}


def test_params_of_unknown_ids_and_timeouts(node):
    with pytest.raises(UnknownLayer):
        node.params("job", 42, 0)
    with pytest.raises(UnknownJob):
        node.params("other", 0, 0)
    with pytest.raises(TimeoutError, match="version 1 not reached"):
        node.params("job", 0, 1, timeout=0.2)
    assert node.provider("job").lookup(0, 1) is None
    with pytest.raises(KeyError):
        node.provider("job").lookup(42, 0)


def test_a_failing_listener_is_counted_not_fatal(node):
    seen = []
    node.add_listener(lambda *a: 1 / 0)
    node.add_listener(lambda *a: seen.append(a))
    node.submit_gradient("job", 2, 0, _good(node, 2))
    node.params("job", 2, 1, timeout=30)
    assert node.wait_idle(30)
    assert seen == [("job", 2, 1)]
    assert node.stats()["node"]["listener_errors"] == 1


@pytest.mark.parametrize("kwargs,words", [
    (dict(name="lamb"), "choose one of adamw, adam, sgd"),
    (dict(lr=float("nan")), "lr must be"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(name="adamw", momentum=0.9), "SGD settings"),
    (dict(name="sgd", nesterov=True), "nesterov needs momentum"),
    (dict(clip_grad_norm=0.0), "clip_grad_norm"),
    (dict(clip_scope="world"), "clip_scope"),
    (dict(schedule={"kind": "cosine", "warmup_steps": 10, "total_steps": 5}), "total_steps > warmup_steps"),
    (dict(schedule="exponential"), "schedule kind"),
])
def test_bad_optimizer_specs(kwargs, words):
    with pytest.raises(OptimizerInputError, match=words):
        OptimizerSpec(**kwargs)


def test_controller_style_optimizer_dict():
    spec = OptimizerSpec.from_dict({"name": "sgd", "params": {"lr": 0.1, "momentum": 0.9}, "param_dtype": "bf16"})
    assert (spec.name, spec.lr, spec.momentum) == ("sgd", 0.1, 0.9)
    with pytest.raises(OptimizerInputError, match="unknown optimizer setting"):
        OptimizerSpec.from_dict({"name": "adamw", "params": {"learning_rate": 1}})
    assert ScheduleSpec("linear", warmup_steps=2, total_steps=6).factor(4) == 0.5


def test_bad_jobs_and_configs(tmp_path):
    with pytest.raises(OptimizerInputError, match="job_id"):
        JobSpec("bad/id", OptimizerSpec(), [LayerSpec(0, {"w": (2,)})])
    with pytest.raises(OptimizerInputError, match="appears twice"):
        JobSpec("j", OptimizerSpec(), [LayerSpec(0, {"w": (2,)}), LayerSpec(0, {"w": (2,)})])
    with pytest.raises(OptimizerInputError, match="not in shapes"):
        LayerSpec(0, {"w": (2,)}, frozenset({"b"}))
    with pytest.raises(OptimizerInputError, match="served_dtype"):
        JobSpec("j", OptimizerSpec(), [LayerSpec(0, {"w": (2,)})], served_dtype="int8")
    with pytest.raises(OptimizerInputError, match="max_shard_elems"):
        NodeConfig(tmp_path, max_shard_elems=1000)
    with pytest.raises(OptimizerInputError, match="inline_elems"):
        NodeConfig(tmp_path, inline_elems=-1)
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=1 << 16, max_shard_elems=1 << 20)) as node:
        with pytest.raises(OptimizerInputError, match="ram_budget .* too small"):
            node.add_job(JobSpec("big", OptimizerSpec(), [LayerSpec(0, {"w": (1 << 20,)})]))
        with pytest.raises(OptimizerInputError, match="missing"):
            node.add_job(JobSpec("j", OptimizerSpec(), [LayerSpec(0, {"w": (4,)})], initial={0: {"x": np.zeros(4)}}))
        with pytest.raises(OptimizerInputError, match="NaN"):
            node.add_job(JobSpec("j", OptimizerSpec(), [LayerSpec(1, {"w": (4,)}), LayerSpec(0, {"w": (4,)})],
                                 initial={1: {"w": np.ones(4, np.float32)},
                                          0: {"w": np.array([1, np.nan, 0, 0], np.float32)}}))
        assert not list((tmp_path / "s" / "j").glob("*.state"))  # the half-registered job left nothing
        assert node.stats()["store"]["shards"] == 0
        with pytest.raises(OptimizerInputError, match="no checkpoint_dir"):
            node.checkpoint_now()
        node.add_job(JobSpec("j", OptimizerSpec(), [LayerSpec(0, {"w": (4,)})]))
        with pytest.raises(OptimizerInputError, match="already on this node"):
            node.add_job(JobSpec("j", OptimizerSpec(), [LayerSpec(0, {"w": (4,)})]))
    with OptimizerNode(NodeConfig(tmp_path / "t")), \
            pytest.raises(OptimizerInputError, match="in use by another optimizer node"):
        OptimizerNode(NodeConfig(tmp_path / "t"))


def test_the_engine_sink_counts_and_drops_bad_gradients(node):
    """The engine-facing sink never raises input errors into the engine's loop."""
    sink = node.gradient_sink("job", contributors=2)
    numel = node.jobs["job"].layers[1].plan.numel
    # a sum that may be non-finite comes flagged saturated by the engine (an unflagged one is finite
    # by construction and skips the check): checked, and its step skipped as GradScaler would
    before = node.params("job", 1, 0, timeout=30).copy()
    sink(1, np.full(numel, np.nan, np.float32), True)
    sink(77, np.zeros(numel, np.float32), False)  # unknown tensor: dropped
    np.testing.assert_array_equal(node.params("job", 1, 1, timeout=30), before)  # version 1 = version 0
    assert node.stats()["node"]["rejected"] == {"unknown_layer": 1}
    assert node.stats()["node"]["skipped_steps"] == 1 and node.skipped_steps("job") == {0: [1]}
    sink(1, _good(node, 1), True)  # the good one is step 1
    after = node.params("job", 1, 2, timeout=30)
    assert np.isfinite(after).all() and not np.array_equal(after, before)
    assert node.stats()["node"]["saturated_gradients"] == 2


def test_a_skipped_layer_does_not_hold_up_a_globally_clipped_step(tmp_path):
    """With clipping by the global norm the node waits for every layer of a step; a layer whose sum is
    non-finite is skipped (unchanged, its version advanced) and the others step, clipped by their norm."""
    layers = model_layers(3)
    with OptimizerNode(NodeConfig(tmp_path / "state", ram_budget=16 << 20)) as n:
        n.add_job(JobSpec("job", OptimizerSpec("adamw", lr=1e-2, clip_grad_norm=0.5), layers, "fp32",
                          initial_values(layers)))
        sink = n.gradient_sink("job", contributors=1)
        before = {lid: n.params("job", lid, 0, timeout=30).copy() for lid in range(3)}
        for lid in range(3):
            g = _good(n, lid)
            sink(lid, np.full_like(g, np.inf) if lid == 1 else g, lid == 1)
        after = {lid: n.params("job", lid, 1, timeout=30) for lid in range(3)}
        np.testing.assert_array_equal(after[1], before[1])
        assert all(not np.array_equal(after[lid], before[lid]) for lid in (0, 2))
        assert n.skipped_steps("job") == {0: [1]}
