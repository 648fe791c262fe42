"""Models that are never whole on a worker, through ModelInNetwork on a real network (a software
switch and an optimizer node on loopback, embedded engines, workers as threads): built on the meta
device and initialised by the network unit by unit (materialize.py), streamed from a
`save_pretrained` safetensors directory (checkpoint_io.py), and written back as one.

Exact comparisons: a meta-built model's unit i holds what its modules' own init gives under
`torch.manual_seed(seed + i)` (rebuilt here on an eager model, bit for bit); an eager model loaded
with those values trains to the same losses bit for bit (the same values, the same arithmetic);
a model streamed from a checkpoint trains to the same losses and parameters, bit for bit, as the
model that was saved trained from its own weights.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from luwu.worker.model_in_network.devices import HostStage
from luwu.worker.model_in_network.local import LocalNetwork
from luwu.worker.model_in_network.materialize import Materializer, MetaInitError, post_order
from luwu.worker.model_in_network.memory import MemoryTracker
from luwu.worker.model_in_network.units import split_units

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py"
_spec = importlib.util.spec_from_file_location("hf_causal_lm", EXAMPLE)
assert _spec is not None and _spec.loader is not None
hf_lm = importlib.util.module_from_spec(_spec)
sys.modules["hf_causal_lm"] = hf_lm
_spec.loader.exec_module(hf_lm)

STEPS, WORKERS, WAIT = 2, 2, 300.0


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order in every run
    yield
    torch.set_num_threads(before)


def _expected_initial(name: str, seed: int) -> dict[str, torch.Tensor]:
    """Unit i of an eager model re-initialised by HF's `_init_weights`, module by module (children
    first), under torch.manual_seed(seed + i), skipping modules holding another unit's tied weight."""
    model = hf_lm.build(name)
    out = {}
    with torch.no_grad():
        for u in split_units(model):
            mine = {id(p) for _, p in u.params}
            torch.manual_seed(seed + u.index)
            for m in post_order(u.module):
                if any(id(p) not in mine for p in m.parameters(recurse=False)):
                    continue
                model._init_weights(m)
            out.update({f"{u.name}.{n}": p.detach().clone() for n, p in u.params})
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2", "opt", "qwen2"])
def test_meta_built_model_is_initialised_unit_by_unit_by_its_own_init(tmp_path, name):
    got = hf_lm.train(name, STEPS, WORKERS, seed=7, meta=True, state_dir=str(tmp_path), timeout=WAIT)
    want = _expected_initial(name, 7)
    assert set(got["initial"]) == set(want)
    for k, t in want.items():
        assert torch.equal(got["initial"][k], t), k  # (a): the module's own init, per-unit seed
    assert all(bool(t.std() > 0) for k, t in got["initial"].items() if "norm" not in k and "ln" not in k and
               "bias" not in k)  # drawn, not left zero
    # (d): an eager model loaded with those values trains to the same losses, bit for bit
    eager = hf_lm.train(name, STEPS, WORKERS, initial=got["initial"], state_dir=str(tmp_path / "eager"),
                        timeout=WAIT)
    assert eager["losses"] == got["losses"]
    for k, t in eager["params"].items():
        assert torch.equal(got["params"][k], t), k
    # the worker made at most one unit at a time before training, on every rank
    largest = max(r["largest_unit_bytes"] for r in got["reports"])
    assert all(m["peak_bytes_by_kind"]["params"] <= largest for m in got["setup_memory"])


def test_meta_init_is_reproducible_and_follows_the_seed(tmp_path):
    a = hf_lm.train("llama", 1, WORKERS, seed=3, meta=True, state_dir=str(tmp_path / "a"), timeout=WAIT)
    b = hf_lm.train("llama", 1, WORKERS, seed=3, meta=True, state_dir=str(tmp_path / "b"), timeout=WAIT)
    c = hf_lm.train("llama", 1, WORKERS, seed=4, meta=True, state_dir=str(tmp_path / "c"), timeout=WAIT)
    assert all(torch.equal(a["initial"][k], b["initial"][k]) for k in a["initial"])  # (b)
    assert a["losses"] == b["losses"]
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a["initial"][w], c["initial"][w])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_meta_buffers_equal_an_eager_builds_and_nothing_stays_on_meta(name):
    with torch.device("meta"):
        model = hf_lm.build_meta(name)
    init = Materializer.for_model(model, None, 0, None)
    assert init is not None
    units = split_units(model)
    memory = MemoryTracker()
    flats = init.flats(units, memory, HostStage(memory))
    assert memory.current["params"] == 0 and memory.peak["params"] <= max(u.nbytes for u in units)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])  # (c)
    eager = hf_lm.build(name)
    want = dict(eager.named_buffers())
    got = dict(model.named_buffers())
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k  # rotary inv_freq, causal masks: exactly the eager build's
    # the tied head holds the embedding's parameter object, a view of its unit's flat storage
    if name == "llama":
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.lm_head.weight.untyped_storage().data_ptr() == flats[0].storage.data_ptr()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # no reset_parameters sets it

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_tensor_its_module_init_does_not_set_is_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scaled())
    init = Materializer.for_model(model, None, 0, None)
    assert init is not None
    units = split_units(model)
    memory = MemoryTracker()
    flats = init.flats(units, memory, HostStage(memory))
    init.values(units, flats, 0)  # a Linear: reset_parameters sets everything
    with pytest.raises(MetaInitError, match=r"1\.scale"):
        init.values(units, flats, 1)
    assert memory.current["params"] == 0  # freed on the error too


def test_plain_torch_model_on_meta_uses_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    init = Materializer.for_model(model, None, 5, None)
    assert init is not None
    units = split_units(model)
    memory = MemoryTracker()
    flats = init.flats(units, memory, HostStage(memory))
    eager = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    for u, m in zip(units, eager):
        torch.manual_seed(5 + u.index)
        m.reset_parameters()
        want = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        assert torch.equal(torch.from_numpy(init.values(units, flats, u.index)), want)


def test_a_model_partly_on_meta_is_refused_with_advice():
    from luwu.worker.model_in_network.units import UnitError

    with torch.device("meta"):
        second = nn.Linear(4, 4)
    with pytest.raises(UnitError, match="meta device and others are not"):
        split_units(nn.Sequential(nn.Linear(4, 4), second))


@pytest.mark.parametrize("shard", [None, "2KB"], ids=["single-file", "sharded"])
def test_streamed_from_a_checkpoint_trains_as_the_saved_model(tmp_path, shard):
    model = hf_lm.build("llama")  # seed 0, tied
    ckpt = tmp_path / "ckpt"
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(ckpt, safe_serialization=True, **kwargs)
    assert (ckpt / ("model.safetensors.index.json" if shard else "model.safetensors")).is_file()
    got = hf_lm.train("llama", STEPS, WORKERS, meta=True, init_from=str(ckpt), state_dir=str(tmp_path / "a"),
                      timeout=WAIT)  # ModelInNetwork.from_pretrained on every rank
    want = hf_lm.train("llama", STEPS, WORKERS, state_dir=str(tmp_path / "b"), timeout=WAIT)
    assert got["losses"] == want["losses"]
    for k, t in want["params"].items():
        assert torch.equal(got["params"][k], t), k


def test_a_checkpoint_missing_a_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    from luwu.worker.model_in_network.checkpoint_io import CheckpointError, CheckpointReader

    model = hf_lm.build("llama")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight" and k != "lm_head.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reader = CheckpointReader(tmp_path)
    units = split_units(model)
    names = {id(p): [n] for n, p in model.named_parameters()}
    norm = next(u for u in units if u.name == "model.norm")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        reader.unit_values(norm, names)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        CheckpointReader(tmp_path / "nothing")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_save_pretrained_writes_a_directory_transformers_loads(tmp_path, name):
    import transformers

    out = tmp_path / "trained"
    got = hf_lm.train(name, STEPS, WORKERS, meta=True, save_to=str(out), state_dir=str(tmp_path / "s"),
                      timeout=WAIT)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    units = got["reports"][0]["units"]
    assert len(set(index["weight_map"].values())) in (units, units + 1)  # one file per unit (+ resident)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    params = dict(loaded.named_parameters())
    for k, t in got["params"].items():
        assert torch.equal(params[k].detach(), t), k
    if name == "llama":  # tied: written once, and tied again on loading
        assert "lm_head.weight" not in index["weight_map"]
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # and it goes back in the same way: streamed to a new job, its first losses are the loaded model's
    again = hf_lm.train(name, 1, WORKERS, meta=True, init_from=str(out), state_dir=str(tmp_path / "t"),
                        timeout=WAIT)
    for k, t in got["params"].items():
        assert torch.equal(again["initial"][k], t), k


def test_memory_a_meta_model_worker_holds_units_in_flight_only(tmp_path):
    """A 6-block model: before training each rank made at most one unit; while training the
    resident parameters stay within the units in flight (prefetch 1: the unit computed, the next
    one, the kept last unit, the tied embedding resident through backward), far below the model."""
    got = hf_lm.train("llama", STEPS, WORKERS, meta=True, state_dir=str(tmp_path), timeout=WAIT, layers=6,
                      hidden=64)
    for rep, setup in zip(got["reports"], got["setup_memory"]):
        largest, whole = rep["largest_unit_bytes"], rep["model_bytes"]
        assert whole >= 6 * largest
        assert setup["peak_bytes_by_kind"]["params"] <= largest
        assert rep["memory"]["peak_bytes_by_kind"]["params"] <= 3 * largest < whole / 2  # prefetch + 2 units


def test_an_init_error_while_handing_over_is_not_trained_from_zeros_on_a_retry(tmp_path):
    """The job reaches the node at zeros and each layer's values follow in a set_layer message as
    they are made (job.py): an init error on the way leaves an incomplete job, and a retry of the
    same job hands every layer's values over again instead of taking the node's zeros as state."""
    from luwu.worker.model_in_network import SGD, ModelInNetwork

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scaled())
    with LocalNetwork(1, 1, mode="tofino", state_dir=str(tmp_path), switch_process=False) as net:
        with pytest.raises(MetaInitError, match=r"1\.scale"):
            ModelInNetwork(model, SGD(lr=0.1), net.network(0), engine="embedded", timeout=WAIT)
        service = net.services[0]
        (job_id,) = service.node.jobs
        assert service.awaiting[job_id]  # incomplete: not every layer had its values
        torch.manual_seed(3)
        eager = nn.Sequential(nn.Linear(4, 4), _Scaled())
        with torch.no_grad():
            eager[1].scale.uniform_(0.5, 1.5)
        want = {k: v.detach().clone() for k, v in eager.named_parameters()}
        mnn = ModelInNetwork(eager, SGD(lr=0.1), net.network(0), engine="embedded", timeout=WAIT)
        try:
            got = mnn.gather()
        finally:
            mnn.close()
        assert job_id not in service.awaiting
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v.to(torch.bfloat16).float()), k  # the retry's values (served bf16), not zeros


def test_a_bf16_meta_model_trains_as_the_eager_model_with_its_values(tmp_path):
    """Built on meta then cast to bf16 (still meta): each unit is initialised in bf16 directly."""
    got = hf_lm.train("llama", STEPS, WORKERS, seed=2, meta=True, dtype="bf16", state_dir=str(tmp_path / "a"),
                      timeout=WAIT)
    assert all(t.dtype == torch.bfloat16 for t in got["initial"].values())
    eager = hf_lm.train("llama", STEPS, WORKERS, dtype="bf16", initial=got["initial"], state_dir=str(tmp_path / "b"),
                        timeout=WAIT)
    assert eager["losses"] == got["losses"]
    for k, t in eager["params"].items():
        assert torch.equal(got["params"][k], t), k


def test_a_clean_close_leaves_no_work_folder(tmp_path):
    """A worker's engine daemon keeps its socket and log in a folder of its own under /tmp; a
    clean close() removes it (after a failure it stays, for the log the error names)."""
    import os

    from luwu.worker.model_in_network import SGD, ModelInNetwork

    with LocalNetwork(1, 1, mode="tofino", state_dir=str(tmp_path), switch_process=False) as net:
        mnn = ModelInNetwork(nn.Sequential(nn.Linear(4, 4)), SGD(lr=0.1), net.network(0), engine="process",
                             timeout=WAIT)
        try:
            mnn(torch.ones(2, 4)).sum().backward()
            mnn.step()
            workdir = mnn._workdir
            assert os.listdir(workdir)  # the daemon's socket and log are there while it runs
        finally:
            mnn.close()
        assert not os.path.exists(workdir)
