"""ModelInNetwork's behaviour on a real network (a software switch and optimizer nodes in this
process, embedded engines): parameters are freed between uses and restored for backward, the
pull policy does not change results, misuse gets clear errors, and units spread over two
optimizer nodes train like one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mnn_reference import run_ranks_in_threads, single_process

from luwu.demo.data import CharCorpus, shard
from luwu.demo.model import GPTConfig, build, loss_fn
from luwu.worker.model_in_network import SGD, AdamW, ModelInNetwork
from luwu.worker.model_in_network.flat import FlatParams
from luwu.worker.model_in_network.local import LocalNetwork
from luwu.worker.model_in_network.memory import MemoryTracker
from luwu.worker.model_in_network.units import split_units

CORPUS = CharCorpus.load()
CFG = GPTConfig(vocab=CORPUS.vocab, d_model=16, n_layers=2, n_heads=2, context=8, attn_bias=False)
SPEC = dict(model=dict(d_model=16, n_layers=2, n_heads=2, context=8, attn_bias=False), batch=4, lr=1e-2,
            weight_decay=0.1, seed=5)
WAIT = 120.0


def test_freed_parameters_come_back_for_backward_with_the_same_gradients():
    torch.manual_seed(0)
    lin, ref = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    ref.load_state_dict(lin.state_dict())
    (unit,) = split_units(torch.nn.Sequential(lin))
    flat = FlatParams(unit, MemoryTracker())
    values = flat.values().numpy()
    x = torch.randn(3, 6)
    y = lin(x)
    flat.free()
    assert lin.weight.untyped_storage().nbytes() == 0  # the saved weight's memory is really gone
    flat.materialise(values, version=0)
    y.pow(2).sum().backward()  # autograd's saved weight is the restored storage; no version error
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=0)


def _train_one(net, steps, **kw):
    model = build(CFG, SPEC["seed"])
    mnn = ModelInNetwork(model, AdamW(lr=SPEC["lr"], weight_decay=SPEC["weight_decay"]), net.network(0),
                         served_dtype="fp32", engine="embedded", **kw)
    losses = []
    try:
        for step in range(steps):
            x, y = CORPUS.batch(step, SPEC["batch"], CFG.context, SPEC["seed"])
            loss = loss_fn(mnn(x), y)
            loss.backward()
            mnn.step()
            losses.append(loss.item())
            assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # nothing stays between steps
        return losses, mnn.gather(), mnn.report()
    finally:
        mnn.close()


@pytest.mark.parametrize("policy", [dict(), dict(prefetch=0, keep_last=0), dict(prefetch=3, keep_last=2)])
def test_one_worker_trains_like_one_process_whatever_the_pull_policy(tmp_path, policy):
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        losses, params, report = _train_one(net, 4, **policy)
    ref = single_process(dict(SPEC, steps=4))
    np.testing.assert_allclose(losses, ref["losses"], rtol=0, atol=1e-5)
    for name, want in ref["params"].items():
        np.testing.assert_allclose(params[name].numpy(), want.numpy(), rtol=0, atol=1e-5, err_msg=name)
    c = report["counters"]
    assert c["pushes"] == 4 * 5 and c["steps"] == 4
    fwd, kept = 5, policy.get("keep_last", 1)
    # backward re-pulls every unit but the kept ones and the embeddings (whose backward needs no weights)
    bwd = 5 - max(kept, 0) - 1 if kept < 5 else 0
    assert c["pulls"] == 4 * (fwd + bwd) + 5 + min(policy.get("prefetch", 1), 5)  # + gather + the next prefetch


def test_misuse_gets_clear_errors(tmp_path):
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        model = build(CFG, 0)
        with pytest.raises(TypeError, match="luwu.AdamW"):
            ModelInNetwork(model, torch.optim.AdamW(model.parameters()), net.network(0), engine="embedded")
        mnn = ModelInNetwork(model, AdamW(), net.network(0), engine="embedded")
        try:
            x, y = CORPUS.batch(0, 2, CFG.context, 0)
            with pytest.raises(RuntimeError, match="without a backward pass"):
                mnn.step()
            loss_fn(mnn(x), y).backward()
            with pytest.raises(RuntimeError, match="second gradient before step"):
                loss_fn(mnn(x), y).backward()
        finally:
            mnn.close()


def test_units_spread_over_two_optimizer_nodes_train_like_one_process(tmp_path):
    workers, steps = 2, 5
    results = {}
    with LocalNetwork(workers, 2, mode="tofino", state_dir=tmp_path) as net:
        models = [build(CFG, SPEC["seed"]) for _ in range(workers)]  # built here: torch's seed is global

        def work(rank):
            mnn = ModelInNetwork(models[rank], AdamW(lr=SPEC["lr"], weight_decay=SPEC["weight_decay"]),
                                 net.network(rank), served_dtype="fp32", engine="embedded")
            try:
                losses = []
                for step in range(steps):
                    x, y = shard(*CORPUS.batch(step, SPEC["batch"], CFG.context, SPEC["seed"]), rank, workers)
                    loss = loss_fn(mnn(x), y)
                    loss.backward()
                    mnn.step()
                    losses.append(loss.item())
                results[rank] = (losses, mnn.gather(), dict(mnn.session_of))
            except BaseException as e:  # noqa: BLE001 - surfaced below
                results[rank] = e
            finally:
                mnn.close()

        run_ranks_in_threads(work, workers, WAIT)
        published = [s["node"]["node"]["published"] for s in net.node_stats()]
    for r in range(workers):
        assert not isinstance(results[r], BaseException), results[r]
    sessions = set(results[0][2].values())
    assert len(sessions) == 2 and results[0][2] == results[1][2]  # both nodes serve units, same map on every rank
    assert all(p > 0 for p in published) and sum(p for p in published) == steps * 5
    ref = single_process(dict(SPEC, steps=steps))
    np.testing.assert_allclose(np.mean([results[r][0] for r in range(workers)], axis=0), ref["losses"], atol=1e-5)
    for name, want in ref["params"].items():
        np.testing.assert_allclose(results[0][1][name].numpy(), want.numpy(), rtol=0, atol=1e-4, err_msg=name)


def test_a_non_finite_gradient_skips_that_units_step_and_training_goes_on(tmp_path):
    """As torch's GradScaler: a unit whose summed gradient holds NaN/inf keeps its parameters for
    that step (its version still advances, so no worker waits), the node counts it, the worker sees
    it, and the next steps train normally."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    poison = {"step": None}
    model[1].weight.register_hook(lambda g: g * float("nan") if poison["step"] is not None else g)
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        mnn = ModelInNetwork(model, AdamW(lr=1e-2), net.network(0), served_dtype="fp32", engine="embedded",
                             timeout=60.0)
        try:
            seen = []
            for step in range(4):
                poison["step"] = step if step == 1 else None
                x = torch.randn(5, 4)
                mnn(x).pow(2).sum().backward()
                mnn.step()
                seen.append(mnn.gather())
            skipped, report = mnn.skipped_steps(), mnn.report()
            node_stats = net.services[0].node.stats()["node"]
        finally:
            mnn.close()
    labels = [u.label() for u in mnn.units]
    assert skipped == {1: [labels[1]]} and report["skipped_steps"] == skipped
    assert node_stats["skipped_steps"] == 1
    for name in ("1.weight", "1.bias"):  # the skipped step left unit 1 exactly as it was
        torch.testing.assert_close(seen[1][name], seen[0][name], rtol=0, atol=0)
        assert not torch.equal(seen[2][name], seen[1][name])  # and it trains again afterwards
    for name in ("0.weight", "0.bias"):  # the other unit stepped as usual
        assert not torch.equal(seen[1][name], seen[0][name])
    assert all(torch.isfinite(t).all() for s in seen for t in s.values())


class _Toggle(torch.nn.Module):
    """A unit whose forward saves its weight for backward only when `saves` is set (x @ w saves w;
    x + w.sum(0) saves nothing of w): the graph changes between steps."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8) / 8)
        self.saves = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight if self.saves else x + self.weight.sum(0)


def test_a_unit_that_starts_or_stops_saving_its_parameters_keeps_training_right(tmp_path):
    # the saved-tensor watch stops for a unit once seen saving (a needless pull at worst if it stops);
    # a unit seen not saving stays watched, so the step where it starts gets its backward pull
    saves = [False, False, True, False, True]
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), _Toggle(), torch.nn.Linear(8, 16, bias=False))
    ref = torch.nn.Sequential(torch.nn.Embedding(16, 8), _Toggle(), torch.nn.Linear(8, 16, bias=False))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randint(0, 16, (4, 6))
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        mnn = ModelInNetwork(model, SGD(lr=0.5), net.network(0), served_dtype="fp32", engine="embedded")
        try:
            pulls, losses = [], []
            for s in saves:
                model[1].saves = ref[1].saves = s
                before = mnn.stats["pulls"]
                loss = mnn(x).pow(2).mean()
                loss.backward()
                mnn.step()
                pulls.append(mnn.stats["pulls"] - before)
                losses.append(loss.item())
                want = ref(x).pow(2).mean()
                want.backward()
                opt.step()
                opt.zero_grad()
                np.testing.assert_allclose(losses[-1], want.item(), rtol=0, atol=1e-6)
            params = mnn.gather()
        finally:
            mnn.close()
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(params[name].numpy(), p.detach().numpy(), rtol=0, atol=1e-6, err_msg=name)
    # per step: 2 forward pulls (the first unit's was prefetched by the step before) + the next step's
    # prefetch + the toggle's backward pull from the first step it saved on, even on the step it did
    # not (the head is kept, the embedding never saves its weight)
    assert pulls == [3, 3, 4, 4, 4]


def test_memory_transient_leaves_the_peaks_add_then_sub_would():
    a, b = MemoryTracker(), MemoryTracker()
    for m in (a, b):
        m.add("params", 100)
        m.add("staging", 50)
    a.add("grads", 30)
    a.sub("grads", 30)
    b.transient("grads", 30)
    assert a.snapshot()["peak_bytes_by_kind"] == b.snapshot()["peak_bytes_by_kind"] == {"params": 100, "grads": 30,
                                                                                          "staging": 50}
    assert a.peak_total == b.peak_total == 180 and a.current == b.current and a.total == b.total == 150
