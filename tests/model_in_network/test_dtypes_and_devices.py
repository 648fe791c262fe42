"""ModelInNetwork with bf16, fp16 and fp32 parameters on the model's device, on a real network (a
software switch and an optimizer node on loopback, embedded engines, workers as threads; on CUDA as
processes, one per rank, as users run them: two ranks of a job on one GPU in one process are refused,
since torch runs their backward on one autograd thread where a gradient hook waits for the other rank).

What is exact: a bf16 model served bf16 (and a fp16 model served fp16) pulls its parameters
bit-identical to the node's copy; its gradients widen to fp32 exactly.

What is bounded: training is compared with `mnn_reference.mixed_precision` (fp32 masters, starting
from the model's own values, stepped by torch AdamW and cast to the model's dtype each step; the
ranks' shard gradients averaged in fp32). The two differ only by the switch's fixed-point sum
(error at most N/2 quanta of 2^-30 of a chunk's largest magnitude, docs/protocol.md 5) and the
node's AdamW arithmetic: ~1e-7 relative on a master. The served copies round to the same bf16/fp16
values unless a master lies that close to a rounding boundary; after such a flip (one ulp of one
weight) the two runs compute different forwards and their AdamW steps (each about lr per element)
drift apart, by at most ~2 lr per step since the flip. The test allows LR * STEPS / 2 = 0.1 on
every parameter and 0.05 on the losses. Measured on the 2-core CI machine, 20 steps: bf16
bit-identical to the reference (losses and parameters); fp16 identical up to step 9, one master
1e-6 from a fp16 boundary flipped at step 10, after which 12% of the elements differ, the largest
by 0.037 (an embedding row whose gradient is near zero: AdamW steps it by ~lr either way), and the
losses by at most 0.002. Workers run with one intra-op thread, as the reference does: torch's
bf16 CPU reductions round differently when split over threads.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import traceback

import numpy as np
import pytest
import torch
from mnn_reference import mixed_precision, run_ranks_in_threads

from luwu.dataplane.process.children import join_or_kill
from luwu.demo.data import CharCorpus, shard
from luwu.demo.model import GPTConfig, build, loss_fn
from luwu.worker.engine_link import DaemonLink, EmbeddedLink
from luwu.worker.model_in_network import AdamW, ModelInNetwork
from luwu.worker.model_in_network import model as model_module
from luwu.worker.model_in_network.devices import SharedDeviceError, claim_devices
from luwu.worker.model_in_network.flat import FlatParams
from luwu.worker.model_in_network.job import JoinError
from luwu.worker.model_in_network.local import LocalNetwork
from luwu.worker.model_in_network.memory import MemoryTracker
from luwu.worker.model_in_network.network import JobNetwork
from luwu.worker.model_in_network.units import UnitError, split_units

CORPUS = CharCorpus.load()
SPEC = dict(model=dict(d_model=16, n_layers=2, n_heads=2, context=8, attn_bias=False), batch=4, lr=1e-2,
            weight_decay=0.1, seed=5, steps=20)
CFG = GPTConfig(vocab=CORPUS.vocab, **SPEC["model"])
WAIT = 300.0
PARAM_BOUND = SPEC["lr"] * SPEC["steps"] / 2  # module docstring: why
LOSS_BOUND = 0.05
SERVED = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _rank(rank, model, network, dtype, device, served, steps, workers):
    """Rank `rank`'s training: losses, gathered parameters, what it held in its first forward, the
    devices of its parameters, whether they were freed at the end, where the gathered ones were."""
    mnn = None
    try:
        mnn = ModelInNetwork(model, AdamW(lr=SPEC["lr"], weight_decay=SPEC["weight_decay"]), network,
                             served_dtype=served or SERVED[dtype], engine="embedded", timeout=WAIT)
        seen = {}

        def look(module, args):  # runs after ModelInNetwork's pull (its hook was registered first)
            seen.setdefault("head", module.weight.detach().clone())

        hook = model.head.register_forward_pre_hook(look)
        losses = []
        for step in range(steps):
            x, y = shard(*CORPUS.batch(step, SPEC["batch"], CFG.context, SPEC["seed"]), rank, workers)
            loss = loss_fn(mnn(x.to(device)), y.to(device))
            loss.backward()
            mnn.step()
            losses.append(loss.item())
            if step == 0:
                hook.remove()
        devices = {str(p.device) for p in model.parameters()}
        freed = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        gathered = mnn.gather()
        return losses, gathered, seen, devices, freed, {(str(t.dtype), str(t.device)) for t in gathered.values()}
    finally:
        if mnn is not None:
            mnn.close()


def _rank_process(rank, network_json, dtype, device, served, steps, workers, out):
    """One rank in a process of its own, as real jobs run (a CUDA rank must: devices.py
    claim_devices); its result goes back pickled by value (torch.save), with tensors on the CPU."""
    torch.set_num_threads(1)
    try:
        model = build(CFG, SPEC["seed"]).to(device=device, dtype=dtype)
        losses, gathered, seen, devices, freed, where = _rank(rank, model, JobNetwork.from_json(network_json), dtype,
                                                              device, served, steps, workers)
        buf = io.BytesIO()
        torch.save((losses, {k: v.cpu() for k, v in gathered.items()}, {k: v.cpu() for k, v in seen.items()},
                    devices, freed, where), buf)
        out.put((rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - raised in the parent
        out.put((rank, traceback.format_exc()))


def _train(tmp_path, dtype, workers=2, steps=SPEC["steps"], device="cpu", served=None, processes=False):
    """Losses per rank, gathered parameters (on the CPU with processes=True), what the model held in
    its first forward, its devices, whether it was freed, where the gathered parameters were.
    `processes`: each rank in a spawned process (the CUDA tests: one process per rank, as users
    run), else threads with embedded engines."""
    results: dict = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference: the same reduction order in every matmul
    with LocalNetwork(workers, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        if processes:
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            procs = [ctx.Process(target=_rank_process, daemon=True,
                                 args=(r, net.network(r).to_json(), dtype, device, served, steps, workers, out))
                     for r in range(workers)]
            for p in procs:
                p.start()
            try:
                for _ in range(workers):
                    try:
                        rank, got = out.get(timeout=WAIT)
                    except queue.Empty:
                        break  # named below: the ranks missing
                    results[rank] = (RuntimeError(f"rank {rank} failed in its process:\n{got}") if isinstance(got, str)
                                     else torch.load(io.BytesIO(got)))
            finally:
                join_or_kill(procs)
        else:
            models = [build(CFG, SPEC["seed"]).to(device=device, dtype=dtype) for _ in range(workers)]

            def work(rank):
                try:
                    results[rank] = _rank(rank, models[rank], net.network(rank), dtype, device, served, steps, workers)
                except BaseException as e:  # noqa: BLE001 - surfaced below
                    results[rank] = e

            run_ranks_in_threads(work, workers, WAIT)
    torch.set_num_threads(threads_before)
    for r in range(workers):
        assert not isinstance(results.get(r), BaseException), results.get(r)
        assert r in results, f"rank {r} did not finish within {WAIT} s"
    return results


def _check_against_reference(results, dtype, workers, device="cpu"):
    ref = mixed_precision(dict(SPEC), dtype, workers, device)
    for r in range(workers):
        losses, params, _, devices, freed, where = results[r]
        assert devices == {str(torch.device(device))} and freed
        assert where == {(str(dtype), str(torch.device(device)))}, where
        assert losses[-1] < losses[0] - 0.3, losses  # it learns
        np.testing.assert_allclose(losses, ref["losses"][r], rtol=0, atol=LOSS_BOUND)
        assert set(params) == set(ref["cast"])
        for name, want in ref["cast"].items():
            got = params[name]  # on the CPU when the ranks ran in processes: where they were is checked above
            assert got.dtype == dtype, (name, got.dtype)
            ulp = want.abs().float() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
            err = (got.cpu().float() - want.float()).abs()
            assert bool((err <= PARAM_BOUND + ulp).all()), (name, float(err.max()))
    # both ranks hold the same parameters, bit for bit
    for name in results[0][1]:
        assert torch.equal(results[0][1][name], results[1][1][name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_model_trains_like_fp32_masters_cast_to_its_dtype(tmp_path, dtype):
    results = _train(tmp_path, dtype)
    _check_against_reference(results, dtype, workers=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_parameters_served_in_the_models_dtype_arrive_bit_identical(tmp_path, dtype):
    initial = dict(build(CFG, SPEC["seed"]).to(dtype).named_parameters())
    results = _train(tmp_path, dtype, workers=1, steps=1)
    _, _, seen, _, _, _ = results[0]
    # the first forward computes with the node's copy of the initial values: bit-identical
    assert seen["head"].dtype == dtype and torch.equal(seen["head"], initial["head.weight"].detach())


def test_a_fp16_model_served_bf16_computes_with_bf16_rounded_weights(tmp_path):
    """The documented loss: 8 significant bits instead of fp16's 11 (no refusal: it trains)."""
    initial = build(CFG, SPEC["seed"]).to(torch.float16).head.weight.detach()
    results = _train(tmp_path, torch.float16, workers=1, steps=1, served="bf16")
    head = results[0][2]["head"]
    assert head.dtype == torch.float16
    assert torch.equal(head, initial.to(torch.bfloat16).to(torch.float16))
    assert not torch.equal(head, initial)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_model_on_a_cuda_device_trains_there(tmp_path, dtype):
    results = _train(tmp_path, dtype, device="cuda:0", processes=True)  # one process per rank, as users run
    _check_against_reference(results, dtype, workers=2, device="cuda:0")


def test_ranks_in_processes_train_like_the_reference(tmp_path):
    """The CUDA tests' way of running ranks (one spawned process each, as users run), tried on the CPU."""
    results = _train(tmp_path, torch.bfloat16, processes=True)
    _check_against_reference(results, torch.bfloat16, workers=2)


def test_two_ranks_of_a_job_on_one_gpu_in_one_process_are_refused():
    """torch runs every CUDA tensor's backward on one autograd thread per device and process: two ranks
    as threads on one GPU would deadlock in the gradient hooks, so the second rank to claim the device
    is refused, naming the fix. Other jobs, other devices, the CPU and released claims are not."""
    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    release0 = claim_devices("j", 0, {cuda0, cpu})
    with pytest.raises(SharedDeviceError, match=r"rank 1 of job j computes on cuda:0, and rank 0 of the same job does "
                                                r"too in this process.*one process per rank"):
        claim_devices("j", 1, {cuda0})
    releases = [claim_devices("j", 1, {cuda1, cpu}), claim_devices("other", 1, {cuda0}), claim_devices("j", 2, {cpu})]
    with pytest.raises(SharedDeviceError, match="rank 2 of job j computes on cuda:1, and rank 1"):
        claim_devices("j", 2, {cuda1})
    release0()
    release0()  # once only: the claim of a second instance of rank 0 stays
    releases.append(claim_devices("j", 0, {cuda0}))
    releases.append(claim_devices("j", 0, {cuda0}))  # the same rank twice (a model re-made): not two ranks
    releases.pop()()
    with pytest.raises(SharedDeviceError, match="rank 3 of job j computes on cuda:0, and rank 0"):
        claim_devices("j", 3, {cuda0})
    for release in releases:
        release()
    claim_devices("j", 3, {cuda0})()  # nothing left


def test_a_second_rank_on_the_same_gpu_fails_at_start_and_the_first_names_it(tmp_path, monkeypatch):
    """Two ranks as threads, their device claimed as cuda:0 (the CPU stands in for it here): the second
    rank to start raises SharedDeviceError and the other rank's JoinError names it, within seconds,
    instead of both hanging in their first backward. The claims are released at close."""
    real = model_module.claim_devices
    monkeypatch.setattr(model_module, "claim_devices",
                        lambda job, rank, devices: real(job, rank, {torch.device("cuda", 0) for _ in devices}))
    results: dict = {}
    with LocalNetwork(2, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        models = [build(CFG, SPEC["seed"]) for _ in range(2)]

        def work(rank):
            try:
                ModelInNetwork(models[rank], AdamW(), net.network(rank), engine="embedded", timeout=60.0).close()
                results[rank] = None
            except BaseException as e:  # noqa: BLE001 - checked below
                results[rank] = e

        run_ranks_in_threads(work, 2, 120.0)
    assert set(results) == {0, 1}, results
    refused = [r for r in (0, 1) if isinstance(results[r], SharedDeviceError)]
    assert len(refused) == 1, results
    other = results[1 - refused[0]]
    assert isinstance(other, JoinError) and f"rank {refused[0]}" in str(other) and "one process per rank" in str(other), \
        other
    claim_devices("mnn", 0, {torch.device("cuda", 0)})()  # both released: rank 0 claims the device alone
    claim_devices("mnn", 1, {torch.device("cuda", 0)})()


def test_pulled_values_beyond_fp16_are_an_error_not_inf():
    lin = torch.nn.Linear(3, 2).to(torch.float16)
    (unit,) = split_units(torch.nn.Sequential(lin))
    flat = FlatParams(unit, MemoryTracker())
    values = np.full(unit.numel, 1.5, dtype=np.float32)
    values[2] = 7e4  # a fp32 master that grew past fp16's 65504
    with pytest.raises(OverflowError, match=r"reach 70000, beyond torch.float16.*65504 \(1 of 8 values\).*bfloat16 or float32"):
        flat.materialise(values, version=1)
    values[2] = 65504.0
    flat.materialise(values, version=1)
    assert float(lin.weight.detach().reshape(-1)[2]) == 65504.0 and lin.weight.dtype == torch.float16
    values[2] = float("nan")  # non-finite values pass through as they are (the node skips such steps)
    flat.materialise(values, version=2)
    assert bool(torch.isnan(lin.weight.detach().reshape(-1)[2]))


def test_unsupported_dtypes_and_mixed_devices_are_one_clear_error(tmp_path):
    def one_line(match, model, units=None):
        with pytest.raises(UnitError, match=match) as e:
            split_units(model, units)
        assert "\n" not in str(e.value)

    one_line(r"0\.weight \(torch\.float64\), 0\.bias \(torch\.float64\).*float32, bfloat16 or float16",
             torch.nn.Sequential(torch.nn.Linear(2, 2).double()))
    odd = torch.nn.Linear(2, 2)
    odd.weight = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    one_line(r"0\.weight \(torch\.complex64\):", torch.nn.Sequential(odd))
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    # a model partly on meta (the one second device a CPU-only torch has) is told how to build it on
    # meta whole (materialize.py); two real devices get the "2 devices (...) model.to(device)" advice
    one_line(r"parameters 1\.weight, 1\.bias are on the meta device and others are not.*with torch\.device\('meta'\)",
             mixed)
    lin = torch.nn.Linear(2, 2)
    lin.bias.data = lin.bias.data.to(torch.bfloat16)
    one_line(r"unit '0' mixes dtypes \(0\.weight \(torch\.float32\), 0\.bias \(torch\.bfloat16\)\)", torch.nn.Sequential(lin))
    # what works is not refused: units of different dtypes; frozen integer tensors stay on the worker
    ok = torch.nn.Sequential(torch.nn.Linear(2, 2).to(torch.bfloat16), torch.nn.Linear(2, 2).half())
    ok[1].steps = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    assert [u.dtype for u in split_units(ok)] == [torch.bfloat16, torch.float16]
    assert [u.nbytes for u in split_units(ok)] == [12, 12] and split_units(ok)[0].wire_nbytes == 24
    # and ModelInNetwork itself refuses before it starts anything
    with (LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net,
          pytest.raises(UnitError, match="on the meta device and others are not")):
        ModelInNetwork(mixed, AdamW(), net.network(0), engine="embedded")


def _two_steps_bf16(tmp_path, monkeypatch, widen: bool, engine: str):
    """One bf16 worker, 2 steps: losses, gathered parameters, and the dtypes its pulls landed in
    (the staging views the engine wrote, the values materialised). `widen`: the old path (pulled
    as float32, then rounded back to bf16 on the host), forced on the same code."""
    landed, materialised = [], []
    link = EmbeddedLink if engine == "embedded" else DaemonLink
    pull, materialise = link.pull, FlatParams.materialise

    def recording_pull(self, st, numel, session, tensor, version, offset=0, dtype=np.float32):
        landed.append((np.dtype(dtype), st.view(numel, offset, dtype).nbytes))
        return pull(self, st, numel, session, tensor, version, offset, dtype)

    def recording_materialise(self, values, version):
        materialised.append(values.dtype)
        return materialise(self, values, version)

    with monkeypatch.context() as m:  # from the start: the constructor already issues the first pulls
        m.setattr(link, "pull", recording_pull)
        m.setattr(FlatParams, "materialise", recording_materialise)
        if widen:
            m.setattr(model_module, "pull_bits", lambda unit, served: False)
        threads_before = torch.get_num_threads()
        torch.set_num_threads(1)
        model = build(CFG, SPEC["seed"]).to(torch.bfloat16)
        try:
            with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net, \
                    ModelInNetwork(model, AdamW(lr=SPEC["lr"], weight_decay=SPEC["weight_decay"]), net.network(0),
                                   served_dtype="bf16", engine=engine, timeout=WAIT) as mnn:
                losses = []
                for step in range(2):
                    x, y = shard(*CORPUS.batch(step, SPEC["batch"], CFG.context, SPEC["seed"]), 0, 1)
                    loss = loss_fn(mnn(x), y)
                    loss.backward()
                    mnn.step()
                    losses.append(loss.item())
                gathered = mnn.gather()
        finally:
            torch.set_num_threads(threads_before)
    return losses, gathered, landed, materialised


@pytest.mark.parametrize("engine", ["embedded", "process"])
def test_a_bf16_model_served_bf16_takes_the_served_bits_without_widening(tmp_path, monkeypatch, engine):
    """The pulled bf16 values go into the parameters as their bits (a byte swap from the wire, one
    copy in), never through a float32 buffer: bit-identical to the old widen-and-round path, the
    pulled parameters and two training steps (losses, gathered parameters), with an embedded engine
    and an engine daemon (the uint16 view crosses to it by offset and dtype)."""
    new = _two_steps_bf16(tmp_path / "bits", monkeypatch, widen=False, engine=engine)
    old = _two_steps_bf16(tmp_path / "widened", monkeypatch, widen=True, engine=engine)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the first forward computes with the initial values, exactly
        x, y = shard(*CORPUS.batch(0, SPEC["batch"], CFG.context, SPEC["seed"]), 0, 1)
        with torch.no_grad():
            assert new[0][0] == loss_fn(build(CFG, SPEC["seed"]).to(torch.bfloat16)(x), y).item()
    finally:
        torch.set_num_threads(threads_before)
    assert new[0] == old[0], (new[0], old[0])  # the losses, bit for bit
    assert set(new[1]) == set(old[1]) and len(new[1]) > 0
    for name, want in old[1].items():
        got = new[1][name]
        assert got.dtype == torch.bfloat16 == want.dtype and torch.equal(got.view(torch.int16), want.view(torch.int16)), name
    # every pull of the new path landed as 2-byte bf16 bits, none as float32; the old path's as float32
    assert new[2] and {d for d, _ in new[2]} == {np.dtype(np.uint16)}, new[2]
    assert old[2] and {d for d, _ in old[2]} == {np.dtype(np.float32)}
    assert sum(b for _, b in new[2]) * 2 == sum(b for _, b in old[2])  # half the bytes written per pull
    assert new[3] and set(new[3]) == {np.dtype(np.uint16)} and set(old[3]) == {np.dtype(np.float32)}
    assert len(new[2]) == len(old[2]) and len(new[3]) == len(old[3])  # the same pulls


def test_bf16_bits_materialise_as_they_are_and_only_into_bf16_parameters():
    lin = torch.nn.Linear(3, 2).to(torch.bfloat16)
    (unit,) = split_units(torch.nn.Sequential(lin))
    flat = FlatParams(unit, MemoryTracker())
    want = torch.tensor([1.5, -2.0, 3.0e38, float("inf"), float("nan"), 1e-40, 0.1, -0.0], dtype=torch.bfloat16)
    bits = want.view(torch.int16).numpy().view(np.uint16).copy()
    flat.free()
    flat.materialise(bits, version=3)
    assert flat.version == 3 and flat.resident
    got = torch.cat([lin.weight.detach().reshape(-1), lin.bias.detach()])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit, nan and inf included
    half = FlatParams(split_units(torch.nn.Sequential(torch.nn.Linear(3, 2).half()))[0], MemoryTracker())
    with pytest.raises(TypeError, match="bf16 bits for torch.float16 parameters"):
        half.materialise(bits, version=1)
