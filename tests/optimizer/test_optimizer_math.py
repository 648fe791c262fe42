"""The node's optimizer math equals torch.optim run in one process on the same summed gradients:
AdamW, Adam, SGD (momentum, nesterov), weight-decay groups, LR schedules, global and per-layer
clipping; in RAM and out of core (RAM budget far below the state)."""

from __future__ import annotations

import pytest
import torch
from optimizer_reference import assert_matches, drive, initial_values, model_layers, reference_run

from luwu.dataplane.optimizer import JobSpec, NodeConfig, OptimizerNode, OptimizerSpec, ScheduleSpec
from luwu.dataplane.optimizer.errors import OptimizerInputError

STEPS = 6

CASES = {
    "adamw": OptimizerSpec("adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    "adam_l2": OptimizerSpec("adam", lr=2e-3, weight_decay=0.01),
    "sgd_momentum": OptimizerSpec("sgd", lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": OptimizerSpec("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd_dampening": OptimizerSpec("sgd", lr=0.05, momentum=0.8, dampening=0.1),
    "sgd_plain": OptimizerSpec("sgd", lr=0.05),
    "adamw_cosine_clip_global": OptimizerSpec("adamw", lr=1e-2, weight_decay=0.05, clip_grad_norm=1.0,
                                              schedule=ScheduleSpec("cosine", warmup_steps=2, total_steps=5,
                                                                    min_lr_ratio=0.1)),
    "adamw_linear_clip_layer": OptimizerSpec("adamw", lr=1e-2, weight_decay=0.05, clip_grad_norm=0.5,
                                             clip_scope="layer",
                                             schedule=ScheduleSpec("linear", warmup_steps=1, total_steps=8)),
    "sgd_clip_global": OptimizerSpec("sgd", lr=0.1, momentum=0.9, clip_grad_norm=2.0),
}


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _job(opt: OptimizerSpec, n_layers: int = 5, served: str = "bf16", rows: int = 48, cols: int = 40) -> JobSpec:
    layers = model_layers(n_layers, rows, cols)
    return JobSpec("ref", opt, layers, served, initial_values(layers))


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optim_in_ram(tmp_path, case):
    spec = _job(CASES[case])
    contributors = 4
    with OptimizerNode(NodeConfig(tmp_path / "state", ram_budget=64 << 20)) as node:
        node.add_job(spec)
        drive(node, spec, STEPS, contributors)
        # the same fused kernels torch.optim(fused=True) runs: bit for bit, unless the schedule's
        # lr is computed by the test's own formula (last-bit differences in lr)
        fused = reference_run(spec, STEPS, contributors, fused=True)
        exact = spec.optimizer.schedule.kind == "constant"
        assert_matches(node, spec, fused, rtol=0 if exact else 1e-6)
        # torch's default (foreach) implementation: to 1e-6 relative
        assert_matches(node, spec, reference_run(spec, STEPS, contributors, fused=None), rtol=1e-6)
        assert node.stats()["io"]["reads"] == 0


@pytest.mark.parametrize("case", ["adamw", "sgd_nesterov", "adamw_cosine_clip_global", "adamw_linear_clip_layer"])
@pytest.mark.parametrize("pipeline", ["step", "layer"])
def test_matches_torch_optim_out_of_core(tmp_path, case, pipeline):
    """Shards of 4096 elements, a budget of a fraction of the state: every step streams state
    through RAM, and the result is still torch's."""
    spec = _job(CASES[case], n_layers=8, rows=96, cols=80)  # weights of ~8K elements: 2 shards per layer
    cfg = NodeConfig(tmp_path / "state", ram_budget=180_000, max_shard_elems=4096, pipeline=pipeline)
    with OptimizerNode(cfg) as node:
        node.add_job(spec)
        drive(node, spec, STEPS, 2)
        st = node.stats()
        state_bytes = sum(s.entry_bytes for j in node.jobs.values() for lr in j.layers.values()
                          for s in lr.plan.shards)
        assert state_bytes > 3 * cfg.ram_budget
        assert st["io"]["reads"] > 0 and st["io"]["writes"] > 0
        assert st["store"]["peak_bytes"] <= st["store"]["budget"]
        assert st["store"]["over_budget_loads"] == 0
        assert_matches(node, spec, reference_run(spec, STEPS, 2, fused=True),
                       rtol=0 if spec.optimizer.schedule.kind == "constant" else 1e-6)


def test_served_copy_is_the_rounded_master(tmp_path):
    for served, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        spec = _job(CASES["adamw"], n_layers=2, served=served)
        with OptimizerNode(NodeConfig(tmp_path / served, ram_budget=16 << 20)) as node:
            node.add_job(spec)
            drive(node, spec, 2, 1)
            st = node.layer_state("ref", 1)
            arr = node.params("ref", 1, 2)
            assert not arr.flags.writeable
            want = torch.from_numpy(st["master"]).to(dtype)
            got = torch.from_numpy(arr.copy())
            got = got.view(torch.bfloat16) if served == "bf16" else got
            assert torch.equal(got, want)


def test_many_shards_per_layer_match_one_shard(tmp_path):
    """Splitting a layer into shards (weight-decay runs cut at shard edges) changes nothing."""
    spec = _job(CASES["adamw_cosine_clip_global"], n_layers=3, rows=96, cols=80)
    states = []
    for shard in (4096, 1 << 22):
        with OptimizerNode(NodeConfig(tmp_path / str(shard), ram_budget=32 << 20, max_shard_elems=shard)) as node:
            node.add_job(spec)
            drive(node, spec, 4, 3)
            states.append([node.layer_state("ref", ly.layer_id) for ly in spec.layers])
    for a, b in zip(*states):
        for k in ("master", "exp_avg", "exp_avg_sq", "served"):
            assert (a[k] == b[k]).all(), k


def test_tensors_larger_than_a_cache_chunk_stay_bit_exact(tmp_path):
    """A weight of 3 cache chunks (stepped and rounded chunk by chunk) and one cut across shards:
    still torch's result bit for bit, and the served copy is the rounded master."""
    from luwu.dataplane.optimizer import LayerSpec
    from luwu.dataplane.optimizer.kernels import CACHE_CHUNK

    rows = 3 * CACHE_CHUNK // 256 + 5
    layers = [LayerSpec(0, {"w": (rows, 256), "b": (rows,)}, frozenset({"b"})),
              LayerSpec(1, {"w": (64, 256), "b": (64,)}, frozenset({"b"}))]
    spec = JobSpec("ref", CASES["adamw"], layers, "bf16", initial_values(layers))
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=256 << 20, max_shard_elems=2 * CACHE_CHUNK)) as node:
        node.add_job(spec)
        assert len(node.jobs["ref"].layers[0].plan.shards) == 2
        drive(node, spec, 3, 2)
        assert_matches(node, spec, reference_run(spec, 3, 2, fused=True), rtol=0)
        st = node.layer_state("ref", 0)
        served = torch.from_numpy(st["served"].view("int16")).view(torch.bfloat16)
        assert torch.equal(served, torch.from_numpy(st["master"]).to(torch.bfloat16))


def test_a_budget_below_a_default_shard_cuts_smaller_shards_with_the_same_bits(tmp_path):
    """Layers of 768 x 256 + 256 elements (one shard each at the 4M-element default: a 2.4 MB AdamW
    record) on a 4 MiB budget: the node used to refuse the job (twice the largest record within
    the state's share); now it cuts the job's shards smaller until two records and two served
    copies fit, streams them, and the result is still torch.optim(fused=True)'s bit for bit."""
    from luwu.dataplane.optimizer import LayerSpec
    from luwu.dataplane.optimizer.budget import MIN_SHARD_ELEMS

    layers = [LayerSpec(i, {"w": (3 * 256, 256), "b": (256,)}, frozenset({"b"})) for i in range(4)]
    spec = JobSpec("ref", CASES["adamw"], layers, "bf16", initial_values(layers))
    cfg = NodeConfig(tmp_path / "s", ram_budget=4 << 20)
    with OptimizerNode(cfg) as node:
        node.add_job(spec)
        job = node.jobs["ref"]
        assert MIN_SHARD_ELEMS <= job.max_shard_elems < layers[0].numel  # cut below the layer
        assert all(len(lr.plan.shards) > 1 for lr in job.layers.values())
        drive(node, spec, 3, 2)
        st = node.stats()
        assert st["io"]["writes"] > 0 and st["store"]["over_budget_loads"] == 0
        assert st["store"]["budget"] + st["served"]["budget"] == cfg.ram_budget
        assert_matches(node, spec, reference_run(spec, 3, 2, fused=True), rtol=0)
    # the floor that cannot be cut: two served copies of the largest layer (one array each)
    with OptimizerNode(NodeConfig(tmp_path / "t", ram_budget=2 << 20)) as node, \
            pytest.raises(OptimizerInputError, match="twice the largest served copy"):
        node.add_job(JobSpec("big", CASES["adamw"], [LayerSpec(0, {"w": (1 << 20,)})], "bf16"))


@pytest.mark.parametrize("first", [None, 7], ids=["zeros", "seeded"])
def test_starting_values_set_layer_by_layer_after_the_job_train_the_same_bits(tmp_path, first):
    """`set_initial` after an `add_job` at zeros (how the workers' hand-over now sends a model, one
    layer per control message) or seeded: out of core, the same bits as the values given to
    add_job; a layer that has had its first gradient refuses new starting values and keeps its
    state."""
    spec = _job(CASES["adamw"], n_layers=6, rows=96, cols=80)
    seeded = JobSpec(spec.job_id, spec.optimizer, spec.layers, spec.served_dtype, first)
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=180_000, max_shard_elems=4096)) as node:
        node.add_job(seeded)
        for ly in spec.layers:
            node.set_initial(spec.job_id, ly.layer_id, spec.initial[ly.layer_id])
        assert node.stats()["io"]["writes"] > 0  # the state is out of core
        drive(node, spec, STEPS, 2)
        assert_matches(node, spec, reference_run(spec, STEPS, 2, fused=True), rtol=0)
        before = node.layer_state(spec.job_id, 0)
        with pytest.raises(OptimizerInputError, match="before its first gradient"):
            node.set_initial(spec.job_id, 0, spec.initial[0])
        with pytest.raises(OptimizerInputError, match="missing"):
            node.set_initial(spec.job_id, 1, {"weight": spec.initial[1]["weight"]})
        after = node.layer_state(spec.job_id, 0)
        assert all((before[k] == after[k]).all() for k in ("master", "exp_avg", "served"))
