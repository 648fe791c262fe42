"""The compiled one-pass AdamW + bf16 kernel (dataplane/optimizer/fused.py) equals torch bit for
bit: `torch._fused_adamw_` on each tensor followed by the cast to bf16 (or the fp32 copy), and the node's reference
path (`LUWU_KERNELS=reference`), on random shapes and values (zeros, signed zeros, denormals,
values large enough to overflow to inf and NaN), both forms of torch's lerp, weight decay on and
off, a gradient scale, and the step counts of a long run."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from optimizer_reference import drive, initial_values, model_layers

from luwu.dataplane import kernels as kernel_mode
from luwu.dataplane.optimizer import JobSpec, LayerSpec, NodeConfig, OptimizerNode, OptimizerSpec, fused, kernels
from luwu.dataplane.optimizer.layout import plan_layer
from luwu.dataplane.process.usage import UserError

pytestmark = pytest.mark.skipif(not (kernel_mode.numba_available() and fused.vector_lanes()),
                                reason="numba or a CPU with torch AVX2/AVX512 kernels is missing: "
                                       "the compiled AdamW kernel does not run here")

F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
# mostly values of training's magnitudes, plus every special float32 the strategy likes to find
VALUES = st.one_of(F32, st.floats(-1.0, 1.0, width=32), st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1e-39, 3e38]))


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy().copy()


def _torch_step(opt, plan, states, grad, step, scale, served):
    """What torch.optim.AdamW(fused=True) does to these tensors, then the cast: one kernel call
    per tensor (run), each with its own weight decay, then `.to(torch.bfloat16)`."""
    step_t = torch.tensor(float(step + 1))
    for lo, hi, decay in plan.runs:
        torch._fused_adamw_([states[0][lo:hi]], [grad[lo:hi]], [states[1][lo:hi]], [states[2][lo:hi]], [], [step_t],
                            lr=opt.lr_at(step), beta1=opt.betas[0], beta2=opt.betas[1],
                            weight_decay=opt.weight_decay if decay else 0.0, eps=opt.eps, amsgrad=False,
                            maximize=False, grad_scale=scale, found_inf=None)
    served.copy_(states[0].to(served.dtype))


def _case(data, sizes, opt):
    layer = LayerSpec(0, {f"t{i}": (n,) for i, n in enumerate(sizes)}, frozenset({"t0"}) if len(sizes) > 1 else ())
    plan = plan_layer(JobSpec("j", opt, [layer], "bf16"), layer, 1 << 22)
    (shard,) = plan.shards
    n = shard.numel
    arrays = [data.draw(hnp.arrays(np.float32, n, elements=VALUES)) for _ in range(4)]
    arrays[2] = np.abs(arrays[2])  # exp_avg_sq is never negative
    return shard, arrays


def _run(fn, opt, shard, arrays, step, scale, served_dtype=torch.bfloat16):
    states = [torch.from_numpy(a.copy()) for a in arrays[:3]]
    grad = torch.from_numpy(arrays[3].copy())
    served = torch.empty(shard.numel, dtype=served_dtype)
    with np.errstate(all="ignore"):
        fn(opt, shard, states, grad, step, None if scale is None else torch.tensor(float(scale)), served)
    return [_bits(t) for t in (*states, grad, served)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), sizes=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       lr=st.floats(1e-6, 1.0), beta1=st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99]),
       beta2=st.sampled_from([0.4, 0.95, 0.999]), wd=st.sampled_from([0.0, 0.01, 0.1]),
       step=st.integers(0, 5000), scale=st.sampled_from([None, 2, 3, 7]))
def test_bit_identical_to_torch_fused_adamw_and_cast(data, sizes, lr, beta1, beta2, wd, step, scale):
    opt = OptimizerSpec("adamw", lr=lr, betas=(beta1, beta2), eps=1e-8, weight_decay=wd)
    shard, arrays = _case(data, sizes, opt)
    got = _run(fused.step_shard, opt, shard, arrays, step, scale)
    want = _run(_torch_step, opt, shard, arrays, step, scale)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "grad", "served"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), sizes=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       lr=st.floats(1e-6, 1.0), beta1=st.sampled_from([0.0, 0.9]), wd=st.sampled_from([0.0, 0.1]),
       step=st.integers(0, 5000), scale=st.sampled_from([None, 3]))
def test_fp32_served_copy_bit_identical_to_torch_fused_adamw(data, sizes, lr, beta1, wd, step, scale):
    """The fp32-serving kernel (`fused_numba.shard32`): the same step, the new master as the copy."""
    opt = OptimizerSpec("adamw", lr=lr, betas=(beta1, 0.95), eps=1e-8, weight_decay=wd)
    shard, arrays = _case(data, sizes, opt)
    assert fused.usable(opt, torch.empty(1, dtype=torch.float32))
    got = _run(fused.step_shard, opt, shard, arrays, step, scale, torch.float32)
    want = _run(_torch_step, opt, shard, arrays, step, scale, torch.float32)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "grad", "served"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(got[4], got[0])  # the copy is the master


def _lean(opt, shard, states, grad, step, scale, served):
    """The pipeline's lean call (`fused.lean_call`, from numpy arrays) in `_run`'s shape; a shard
    with a torch remainder has none, and goes through `split_step` as the pipeline's does."""
    out = served.numpy() if served.dtype == torch.float32 else served.view(torch.int16).numpy().view(np.uint16)
    call = fused.lean_call(opt, shard, [s.numpy() for s in states], grad.numpy(), step,
                           None if scale is None else float(scale), out)
    _rows, tails = fused._split(shard, fused.vector_lanes())
    assert (call is None) == bool(tails[0] or tails[1])
    if call is None:
        fused.step_shard(opt, shard, states, grad, step, scale, served)
    else:
        fn, args = call
        fn(*args)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), sizes=st.lists(st.sampled_from([1, 15, 16, 32, 48, 64, 70]), min_size=1, max_size=4),
       lr=st.floats(1e-6, 1.0), beta1=st.sampled_from([0.0, 0.9]), wd=st.sampled_from([0.0, 0.1]),
       step=st.integers(0, 5000), scale=st.sampled_from([None, 2, 3]), fp32=st.booleans())
def test_lean_call_bit_identical_to_torch(data, sizes, lr, beta1, wd, step, scale, fp32):
    """The inline lane's call built from numpy arrays (no torch views) steps the same bits as torch
    (sizes on and off torch's vector grid: off it, there is no lean call and split_step runs)."""
    opt = OptimizerSpec("adamw", lr=lr, betas=(beta1, 0.95), eps=1e-8, weight_decay=wd)
    shard, arrays = _case(data, sizes, opt)
    dtype = torch.float32 if fp32 else torch.bfloat16
    got = _run(_lean, opt, shard, arrays, step, scale, dtype)
    want = _run(_torch_step, opt, shard, arrays, step, scale, dtype)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "grad", "served"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_lean_call_only_for_the_compiled_adamw():
    """fp16 copies, other optimizers and the reference kernels get no lean call (prepare_step runs)."""
    layer = LayerSpec(0, {"w": (64,)})
    shard = plan_layer(JobSpec("j", OptimizerSpec("adamw"), [layer], "bf16"), layer, 1 << 22).shards[0]
    states = [np.zeros(64, np.float32) for _ in range(3)]
    grad = np.zeros(64, np.float32)
    assert fused.lean_call(OptimizerSpec("adamw"), shard, states, grad, 0, None, np.zeros(64, np.uint16)) is not None
    assert fused.lean_call(OptimizerSpec("adamw"), shard, states, grad, 0, None, np.zeros(64, np.float16)) is None
    assert fused.lean_call(OptimizerSpec("sgd"), shard, states, grad, 0, None, np.zeros(64, np.uint16)) is None


def _batched(cases, served_dtype):
    """Every case's step through one `fused.run_batch` call (the pipeline's optimizer thread)."""
    out, calls = [], []
    for opt, shard, arrays, step, scale in cases:
        states = [torch.from_numpy(a.copy()) for a in arrays[:3]]
        grad = torch.from_numpy(arrays[3].copy())
        served = torch.empty(shard.numel, dtype=served_dtype)
        with np.errstate(all="ignore"):
            call = fused.split_step(opt, shard, states, grad, step,
                                    None if scale is None else torch.tensor(float(scale)), served)
        calls.append(call)  # holds the arrays the entries point at
        out.append((states, grad, served))
    with np.errstate(all="ignore"):
        fused.run_batch([fused.batch_entry(c) for c in calls])
    return [[_bits(t) for t in (*states, grad, served)] for states, grad, served in out]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), n=st.integers(1, 4), fp32=st.booleans())
def test_batched_shards_equal_one_call_each(data, n, fp32):
    """Several shards (each its own sizes, step, optimizer and gradient scale) in one compiled call
    are bit for bit what each shard's own call gives, hence what torch gives (tests above)."""
    cases = []
    for _ in range(n):
        opt = OptimizerSpec("adamw", lr=data.draw(st.floats(1e-6, 1.0)), betas=(data.draw(st.sampled_from([0.0, 0.9])), 0.95),
                            eps=1e-8, weight_decay=data.draw(st.sampled_from([0.0, 0.1])))
        shard, arrays = _case(data, data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=4)), opt)
        cases.append((opt, shard, arrays, data.draw(st.integers(0, 5000)), data.draw(st.sampled_from([None, 3]))))
    dtype = torch.float32 if fp32 else torch.bfloat16
    got = _batched(cases, dtype)
    for case, g in zip(cases, got):
        want = _run(fused.step_shard, *case, dtype)
        for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "grad", "served"), g, want):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_large_tensors_against_the_reference_path(monkeypatch):
    """Shards of realistic size (vector body plus remainders, several tensors, a cut tensor):
    the compiled pass and the reference path (torch kernel in cache-sized groups, then the cast)."""
    opt = OptimizerSpec("adamw", lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    layer = LayerSpec(0, {"w": (300, 1001), "b": (300,), "n": (1001,)}, frozenset({"b", "n"}))
    plan = plan_layer(JobSpec("j", opt, [layer], "bf16"), layer, 1 << 18)
    assert len(plan.shards) > 1
    rng = np.random.default_rng(3)
    for shard in plan.shards:
        arrays = [rng.standard_normal(shard.numel, dtype=np.float32) * np.float32(s) for s in (0.02, 1e-3, 1e-6, 1e-3)]
        arrays[2] = np.abs(arrays[2])
        arrays[0][::97] = np.nan  # NaN master weights: torch's cast pattern in the served copy
        for step, scale in ((0, None), (41, 4)):
            got = _run(kernels.step_shard, opt, shard, arrays, step, scale)
            monkeypatch.setenv(kernel_mode.ENV, "reference")
            assert not fused.usable(opt, torch.empty(1, dtype=torch.bfloat16))
            want = _run(kernels.step_shard, opt, shard, arrays, step, scale)
            monkeypatch.delenv(kernel_mode.ENV)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)


def _node_states(tmp_path, name, opt, served="bf16"):
    layers = model_layers(3, rows=50, cols=33)
    spec = JobSpec("k", opt, layers, served, initial_values(layers))
    with OptimizerNode(NodeConfig(tmp_path / name, ram_budget=64 << 20)) as node:
        node.add_job(spec)
        drive(node, spec, 4, 3)
        return [node.layer_state("k", ly.layer_id) for ly in layers]


@pytest.mark.parametrize("served", ["bf16", "fp32"])
@pytest.mark.parametrize("opt", [OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1),
                                 OptimizerSpec("adamw", lr=1e-2, clip_grad_norm=0.5, clip_scope="layer")])
def test_node_same_bits_with_and_without_compiled_kernels(tmp_path, monkeypatch, opt, served):
    fast = _node_states(tmp_path, "fast", opt, served)
    monkeypatch.setenv(kernel_mode.ENV, "reference")
    ref = _node_states(tmp_path, "ref", opt, served)
    for a, b in zip(fast, ref):
        assert a["version"] == b["version"] == 4
        for key in ("master", "exp_avg", "exp_avg_sq", "served"):
            np.testing.assert_array_equal(a[key].view(np.uint8), b[key].view(np.uint8), err_msg=key)


def test_kernel_mode_setting(monkeypatch):
    opt = OptimizerSpec("adamw")
    bf16 = torch.empty(1, dtype=torch.bfloat16)
    assert fused.usable(opt, bf16)
    assert fused.usable(opt, torch.empty(1, dtype=torch.float32))
    assert not fused.usable(OptimizerSpec("adam"), bf16)
    assert not fused.usable(opt, torch.empty(1, dtype=torch.float16))
    monkeypatch.setenv(kernel_mode.ENV, "reference")
    assert not fused.usable(opt, bf16)
    monkeypatch.setenv(kernel_mode.ENV, "fast please")
    with pytest.raises(UserError, match="LUWU_KERNELS"):
        kernel_mode.use_numba()
    # without numba: the reference path, unless numba is insisted on
    monkeypatch.setattr(kernel_mode, "numba_available", lambda: False)
    monkeypatch.delenv(kernel_mode.ENV)
    assert not fused.usable(opt, bf16)
    monkeypatch.setenv(kernel_mode.ENV, "numba")
    with pytest.raises(UserError, match="pip install numba"):
        kernel_mode.use_numba()


def test_bad_kernel_setting_is_one_line(tmp_path):
    env = {**os.environ, kernel_mode.ENV: "fastest", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "luwu.cli", "bench", "optimizer", "--params", "1M", "--dir",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 2
    want = "luwu bench optimizer: LUWU_KERNELS='fastest': choose one of auto, numba, reference"
    assert out.stderr.strip().splitlines() == [want]
