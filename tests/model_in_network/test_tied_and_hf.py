"""Tied and shared parameters, Hugging Face causal LMs and activation checkpointing through
ModelInNetwork, on a real network (a software switch and an optimizer node on loopback, embedded
engines, workers as threads).

Tied parameters: a tensor held by two modules (a causal LM's input embedding and output head) is
one layer on the node, owned by the first unit holding it; the other module pulls that unit for
its forward and backward. Autograd sums the two uses' gradients before the tensor's one
gradient hook runs, so the node steps it once with the sum.

Bounds. The HF models are fp32, served fp32: the first step computes with the initial values on
both sides, so its losses are bit-identical to the one-process reference (`hf_causal_lm.reference`:
the ranks' shard gradients averaged in fp32, torch.optim.AdamW). After that the two differ by the
switch's fixed-point sum (at most N/2 quanta of 2^-30 of a chunk's largest magnitude,
docs/protocol.md 5) and the node's AdamW arithmetic: ~1e-7 relative on a gradient, which AdamW
turns into the same relative error of a step (at most lr = 1e-2 per element per step). Over 3
steps the test allows 1e-4 on every parameter (measured: at most 2.8e-5, OPT; GPT-2 1.8e-5, Qwen2
6.4e-6, LLaMA 1.6e-7 tied and 1.6e-6 untied) and 1e-5 on the losses. An element whose gradient is
below one quantum of its chunk would be stepped by up to lr apart (AdamW normalises noise too):
none is in these models. Activation checkpointing recomputes the same forward, so a checkpointed
run is compared bit for bit with the same run without it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from luwu.worker.model_in_network import SGD, ModelInNetwork
from luwu.worker.model_in_network.local import LocalNetwork
from luwu.worker.model_in_network.units import split_units

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py"
_spec = importlib.util.spec_from_file_location("hf_causal_lm", EXAMPLE)
assert _spec is not None and _spec.loader is not None
hf_lm = importlib.util.module_from_spec(_spec)
sys.modules["hf_causal_lm"] = hf_lm
_spec.loader.exec_module(hf_lm)

STEPS, WORKERS, WAIT = 3, 2, 300.0
PARAM_BOUND, LOSS_BOUND = 1e-4, 1e-5  # module docstring: why


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference: the same reduction order in every matmul
    yield
    torch.set_num_threads(before)


def _compare(got: dict, want: dict) -> None:
    for r in range(WORKERS):
        assert got["losses"][r][0] == want["losses"][r][0]  # the first step: the same values, bit for bit
        np.testing.assert_allclose(got["losses"][r], want["losses"][r], rtol=0, atol=LOSS_BOUND)
    assert set(got["params"]) == set(want["params"])
    for name, t in want["params"].items():
        err = float((got["params"][name] - t).abs().max())
        assert err <= PARAM_BOUND, (name, err)
    assert np.mean(got["losses"], axis=0)[-1] < np.mean(got["losses"], axis=0)[0]  # it learns


@pytest.mark.parametrize("name,tied", [("opt", True), ("gpt2", True), ("llama", True), ("llama", False),
                                       ("qwen2", True)], ids=["opt", "gpt2", "llama-tied", "llama-untied", "qwen2"])
def test_hf_causal_lms_train_like_one_process_adamw(tmp_path, name, tied):
    got = hf_lm.train(name, STEPS, WORKERS, state_dir=str(tmp_path), timeout=WAIT, tied=tied)
    want = hf_lm.reference(name, STEPS, WORKERS, tied=tied)
    _compare(got, want)
    model = hf_lm.build(name, tied=tied)
    units = split_units(model)
    # one unit per block plus the embeddings and the final norm (and the head when untied)
    blocks = [u.name for u in units if u.name.rsplit(".", 1)[0].endswith(("layers", ".h"))]
    assert len(blocks) == model.config.num_hidden_layers
    assert len(units) == got["reports"][0]["units"]
    # the tied tensor is one layer on the node: the units hold every distinct parameter once
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    sites = [m for u in units for _, m in u.sites]
    assert (head in sites) == tied and (head.weight is model.get_input_embeddings().weight) == tied


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_a_bf16_hf_model_served_bf16_matches_fp32_masters_cast_each_step(tmp_path, name):
    """bf16 served bf16: the worker computes with the node's copy, bit for bit; the reference's
    masters differ from the node's by the fixed-point sum only, so their bf16 casts agree unless a
    master sits that close to a rounding boundary (then the runs drift apart by at most ~2 lr a step
    since that flip: the bound of test_dtypes_and_devices.py). Measured over 3 steps: Qwen2, LLaMA
    and OPT bit-identical, GPT-2 one element one bf16 ulp apart (1.9e-9); over 5 steps Qwen2 still
    bit-identical, flips in GPT-2 (7.6e-6), LLaMA (6.1e-5) and OPT (1.5e-3, losses 6e-5 apart)."""
    got = hf_lm.train(name, STEPS, WORKERS, dtype="bf16", state_dir=str(tmp_path), timeout=WAIT)
    want = hf_lm.reference(name, STEPS, WORKERS, dtype="bf16")
    bound = hf_lm.LR * STEPS
    same, total = 0, 0
    for r in range(WORKERS):
        assert got["losses"][r][0] == want["losses"][r][0]
        np.testing.assert_allclose(got["losses"][r], want["losses"][r], rtol=0, atol=0.05)
    for n, t in want["params"].items():
        g = got["params"][n]
        assert g.dtype == torch.bfloat16
        assert float((g.float() - t.float()).abs().max()) <= bound, n
        same += int((g == t).sum())
        total += t.numel()
    assert same >= 0.99 * total, (same, total)


def test_a_tied_head_pulls_its_embedding_for_each_use(tmp_path):
    got = hf_lm.train("gpt2", STEPS, WORKERS, state_dir=str(tmp_path), timeout=WAIT)
    counters = got["reports"][0]["counters"]
    # units: wte, wpe, h.0, h.1, ln_f; the head is a site of wte. Per step: 5 forward pulls + wte
    # again for the head's forward; backward: wte for the head's (its matmul saved the weight),
    # h.1 and h.0 (ln_f is kept; wpe's backward needs only the indices, wte's embedding use too)
    per_step = 5 + 1 + 3
    assert counters["pulls"] == STEPS * per_step + 5 + 1  # + gather + the next step's prefetch
    assert counters["pushes"] == STEPS * 5  # the tied weight's gradient pushed once per step


def test_each_use_of_a_tied_unit_is_prefetched_once_the_pass_was_seen(tmp_path):
    model = hf_lm.build("gpt2")
    takes = []
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        mnn = ModelInNetwork(model, SGD(lr=0.1), net.network(0), served_dtype="fp32", engine="embedded", timeout=WAIT)
        take = mnn.schedule.take

        def watched(unit, phase, version, resident):
            takes.append((version, unit, phase, (unit, phase) in mnn.schedule.pending))
            return take(unit, phase, version, resident)

        mnn.schedule.take = watched  # type: ignore[method-assign]
        try:
            for step in range(STEPS):
                x = hf_lm.batch(step, 0, 1)
                mnn(input_ids=x, labels=x, use_cache=False).loss.backward()
                mnn.step()
        finally:
            mnn.close()
    wte = 0  # the head's weight is wte's: its forward is wte's second use ("f1"), its backward wte's first need
    assert [(u, ph) for v, u, ph, _ in takes if v == 1] == [(0, "f"), (1, "f"), (2, "f"), (3, "f"), (4, "f"),
                                                              (wte, "f1"), (wte, "b"), (3, "b"), (2, "b")]
    first = [t for t in takes if t[0] == 0]
    assert not first[5][3] and not first[6][3]  # the first pass: the head's pulls were not foreseen
    assert all(prefetched for v, *_, prefetched in takes if v > 0)  # then every pull was issued ahead


@pytest.mark.parametrize("how", [True, {"use_reentrant": True}], ids=["non-reentrant", "reentrant"])
def test_hf_activation_checkpointing_pulls_again_and_trains_the_same(tmp_path, how):
    runs = [hf_lm.train("llama", STEPS, WORKERS, checkpointing=c, state_dir=str(tmp_path / str(i)), timeout=WAIT)
            for i, c in enumerate((False, how))]
    plain, ckpt = runs
    assert ckpt["losses"] == plain["losses"]
    for name, t in plain["params"].items():
        assert torch.equal(ckpt["params"][name], t), name
    # the recomputed forward of each block found it freed the first time (checkpointing hides its
    # saves from the watch) and pulled it; from then on each block's backward pull is prefetched
    assert ckpt["reports"][0]["counters"]["recomputed_pulls"] == 2
    assert plain["reports"][0]["counters"].get("recomputed_pulls", 0) == 0
    assert ckpt["reports"][0]["counters"]["pulls"] == plain["reports"][0]["counters"]["pulls"]
    # and the recomputation did happen: each block's MLP ran twice per step
    model = hf_lm.build("llama", checkpointing=how)
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    x = hf_lm.batch(0, 0, 1)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    assert len(calls) == 2


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.lin(x)))


class _Shared(nn.Module):
    """An embedding, a block used twice (one module, two calls), two linears sharing a weight with
    biases of their own (a module that is its own unit and a site of another), and a head tied to
    the embedding; `ckpt`: torch.utils.checkpoint inside the block's forward, or around its calls."""

    def __init__(self, ckpt: str = ""):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = _Block()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.ckpt = ckpt
        if ckpt == "inside":
            inner = self.block.forward
            self.block.forward = lambda x: checkpoint(inner, x, use_reentrant=False)  # type: ignore[method-assign]

    def run_block(self, h: torch.Tensor) -> torch.Tensor:
        if self.ckpt == "around":
            return checkpoint(self.block, h, use_reentrant=False)
        return self.block(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.run_block(self.embed(x))
        h = self.run_block(h)
        h = self.b(torch.relu(self.a(h)))
        return self.head(h)


@pytest.mark.parametrize("ckpt", ["", "inside", "around"], ids=["plain", "checkpoint-inside", "checkpoint-around"])
def test_modules_used_twice_and_weights_tied_across_units_train_like_torch(tmp_path, ckpt):
    torch.manual_seed(4)
    model, ref = _Shared(ckpt), _Shared()
    ref.load_state_dict(model.state_dict())
    units = split_units(model)
    assert [u.name for u in units] == ["embed", "block", "a", "b"]
    assert [n for n, _ in units[3].params] == ["bias"] and [n for n, _ in units[2].sites] == ["b"]
    assert [n for n, _ in units[0].sites] == ["head"]
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randint(0, 16, (4, 6))
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        mnn = ModelInNetwork(model, SGD(lr=0.5), net.network(0), served_dtype="fp32", engine="embedded", timeout=WAIT)
        try:
            for _ in range(STEPS):
                loss = mnn(x).pow(2).mean()
                loss.backward()
                mnn.step()
                want = ref(x).pow(2).mean()
                want.backward()
                opt.step()
                opt.zero_grad()
                np.testing.assert_allclose(loss.item(), want.item(), rtol=0, atol=1e-6)
                assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # nothing stays
            params = mnn.gather()
        finally:
            mnn.close()
    assert set(params) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(params[name].numpy(), p.detach().numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_the_example_runs_and_prints_both_runs_losses(capsys):
    assert hf_lm.main(["--model", "qwen2", "--steps", "2", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "qwen2 (tied, fp32), 2 workers, 4 units on the node" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and all(float(r[2]) == float(r[3]) for r in rows[:2])  # step 0: the same values
    assert hf_lm.main(["--workers", "3"]) == 2
    assert "--workers one of 1, 2, 4" in capsys.readouterr().err


class _ReentrantTwice(nn.Module):
    """A unit used inside a reentrant checkpoint and again outside it: the checkpoint's own backward
    recomputes it after the outer use's gradient completed (and was pushed)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(checkpoint(self.a, x, use_reentrant=True))


def test_a_unit_recomputed_after_its_push_is_a_clear_error(tmp_path):
    torch.manual_seed(0)
    model = _ReentrantTwice()
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        mnn = ModelInNetwork(model, SGD(lr=0.1), net.network(0), served_dtype="fp32", engine="embedded", timeout=WAIT)
        try:
            loss = mnn(torch.randn(3, 4, requires_grad=True)).pow(2).sum()
            with pytest.raises(RuntimeError, match="recomputed for backward uses it after its gradient was pushed"):
                loss.backward()
        finally:
            mnn.close()
