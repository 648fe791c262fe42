"""The checks of `scripts/gpu-check` (docs/gpu.md), one per process: `gpu_checks.py NAME --device D --result F`.

Each writes {"status": pass|fail|skip, "summary": one line, "details": {...}} to F; an exception
is written as "error" with its traceback in the output. `--device none` (no CUDA here) skips the
CUDA checks; `--device cpu` runs mnn and ddp on the CPU, to try their code without a GPU.

  cuda_tests  pytest -k cuda over the test files that check torch.cuda.is_available(); counts from its JUnit XML
  mnn         a tiny LlamaForCausalLM (transformers, from a config, untied embeddings) in bf16 trained
              by ModelInNetwork, 2 workers (processes, embedded engines) on a LocalNetwork, against the
              one-process reference of tests/model_in_network/mnn_reference.py (fp32 masters stepped
              by torch AdamW, cast to bf16 each step, the same data); the bounds of
              tests/model_in_network/test_dtypes_and_devices.py
  ddp         DDP over init_process_group("luwu") with CUDA tensors against DDP over Gloo (CUDA
              tensors) and NCCL where each rank has its own GPU; the bound of tests/backend/test_backend_ddp.py
  staging     ModelInNetwork's HostStage and the backend's staging (pinned host buffers, current
              stream) timed against a plain pinned copy of the same size (the PCIe bandwidth)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _skip(why: str) -> dict:
    return {"status": "skip", "summary": why}


# ---------------------------------------------------------------- cuda_tests

def check_cuda_tests(device: str, scratch: Path) -> dict:
    import xml.etree.ElementTree as ET

    # the tests that skip without CUDA (tests/test_gpu_check.py runs this script: not one of them)
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "cuda.is_available()" in p.read_text() and p.name != "test_gpu_check.py")
    if not files:
        return {"status": "fail", "summary": "no test file under tests/ checks torch.cuda.is_available()"}
    xml = scratch / "cuda-tests.xml"
    # -P: the repository root must not shadow the installed luwu (its folders are not the import layout)
    import importlib.util

    per_test = ["--timeout=170"] if importlib.util.find_spec("pytest_timeout") else []
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-rA", "-k", "cuda", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *per_test, *files]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO, timeout=195).returncode
    if not xml.exists():
        return {"status": "fail", "summary": f"pytest exited {rc} without a report", "details": {"files": files}}
    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        kind = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), "passed")
        cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": kind,
                      "seconds": float(tc.get("time") or 0),
                      "message": next((c.get("message", "")[:300] for c in tc if c.tag != "system-out"), "")})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    summary = (f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, "
               f"{counts['skipped']} skipped of {len(cases)} (pytest exit {rc})")
    details = {"files": files, "cases": cases, "pytest_exit": rc}
    if not cases:
        return {"status": "fail", "summary": "no CUDA test collected: " + summary, "details": details}
    if counts["failure"] or counts["error"] or rc not in (0, 5):
        return {"status": "fail", "summary": summary, "details": details}
    if counts["passed"] == 0:
        return {"status": "skip", "summary": summary, "details": details}
    if device == "cuda" and counts["skipped"]:
        return {"status": "fail", "summary": "a CUDA test skipped on a CUDA machine: " + summary, "details": details}
    return {"status": "pass", "summary": summary, "details": details}


# ---------------------------------------------------------------- mnn

MNN = dict(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, seq=32, batch=8, steps=12, lr=1e-2, weight_decay=0.1,
           seed=7, workers=2)
LOSS_BOUND = 0.05  # as tests/model_in_network/test_dtypes_and_devices.py
PARAM_BOUND = MNN["lr"] * MNN["steps"] / 2


def _llama(dtype, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=MNN["vocab"], hidden_size=MNN["hidden"], intermediate_size=2 * MNN["hidden"],
                      num_hidden_layers=MNN["layers"], num_attention_heads=MNN["heads"],
                      num_key_value_heads=MNN["kv_heads"], max_position_embeddings=2 * MNN["seq"],
                      tie_word_embeddings=False, use_cache=False)
    try:
        cfg._attn_implementation = "eager"  # no fused attention kernels: the same arithmetic in both runs
    except Exception:  # noqa: BLE001 - a transformers without the setter keeps its default
        pass
    torch.manual_seed(MNN["seed"])
    model = LlamaForCausalLM(cfg)
    return model.to(device=device, dtype=dtype), cfg


def _units(cfg) -> list[str]:
    return ["model.embed_tokens", *[f"model.layers.{i}" for i in range(cfg.num_hidden_layers)], "model.norm", "lm_head"]


def _batch(step: int):
    """A learnable sequence task: each row counts up by a row-specific stride (mod vocab)."""
    import torch

    g = torch.Generator().manual_seed(MNN["seed"] * 1000 + step)
    start = torch.randint(0, MNN["vocab"], (MNN["batch"], 1), generator=g)
    stride = torch.randint(1, 4, (MNN["batch"], 1), generator=g)
    return (start + stride * torch.arange(MNN["seq"])) % MNN["vocab"]


def _loss(model, x):
    import torch

    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _reference(dtype, device) -> dict:
    """tests/model_in_network/mnn_reference.py's mixed_precision, for this model."""
    import torch

    work, _ = _llama(dtype, device)
    master, _ = _llama(dtype, "cpu")
    master = master.float()  # the masters start from the model's own (rounded) values
    decay = [p for p in master.parameters() if p.dim() >= 2]
    no_decay = [p for p in master.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": MNN["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=MNN["lr"])
    pairs = list(zip(master.parameters(), work.parameters()))
    names = [n for n, _ in master.named_parameters()]
    losses: list[list[float]] = [[] for _ in range(MNN["workers"])]
    for step in range(MNN["steps"]):
        with torch.no_grad():
            for m, w in pairs:
                w.copy_(m.to(dtype))
        grads = [torch.zeros_like(m) for m, _ in pairs]
        x = _batch(step)
        for r in range(MNN["workers"]):
            xs = x.chunk(MNN["workers"])[r].to(device)
            loss = _loss(work, xs)
            loss.backward()
            for g, (_, w) in zip(grads, pairs):
                g += w.grad.to(device="cpu", dtype=torch.float32)
                w.grad = None
            losses[r].append(loss.item())
        for g, (m, _) in zip(grads, pairs):
            m.grad = g / MNN["workers"]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "cast": {n: m.detach().to(dtype) for n, (m, _) in zip(names, pairs)}}


def _mnn_rank(rank: int, network_json: str, dev: str, wait: float, out) -> None:
    """One ModelInNetwork rank in a process of its own (as users run: two ranks on one GPU in one
    process are refused, worker/model_in_network/devices.py); its result goes back pickled by value
    (torch.save), tensors on the CPU, and the gathered tensors' dtypes and devices beside them."""
    import io

    import torch

    from luwu.train import AdamW, ModelInNetwork
    from luwu.worker.model_in_network.network import JobNetwork

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    mnn = None
    try:
        model, cfg = _llama(torch.bfloat16, dev)
        mnn = ModelInNetwork(model, AdamW(lr=MNN["lr"], weight_decay=MNN["weight_decay"]),
                             JobNetwork.from_json(network_json), units=_units(cfg), served_dtype="bf16",
                             engine="embedded", timeout=wait)
        losses, step_s = [], []
        for step in range(MNN["steps"]):
            s0 = time.monotonic()
            x = _batch(step).chunk(MNN["workers"])[rank].to(dev)
            loss = _loss(mnn, x)
            loss.backward()
            mnn.step()
            losses.append(loss.item())
            step_s.append(time.monotonic() - s0)
        devices = sorted({str(p.device) for p in model.parameters()})
        report = mnn.report()
        gathered = mnn.gather()
        where = {k: (v.dtype, str(v.device)) for k, v in gathered.items()}
        buf = io.BytesIO()
        torch.save((losses, {k: v.cpu() for k, v in gathered.items()}, devices, step_s, report.get("memory"), where),
                   buf)
        out.put((rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put((rank, traceback.format_exc()))
    finally:
        if mnn is not None:
            mnn.close()


def check_mnn(device: str, scratch: Path) -> dict:
    if device == "none":
        return _skip("no CUDA device (torch.cuda.is_available() is False)")
    try:
        import transformers
    except ImportError as e:
        return _skip(f"transformers is not installed ({e})")
    import io
    import multiprocessing as mp
    import queue

    import torch

    from luwu.dataplane.process.children import join_or_kill
    from luwu.train import LocalNetwork

    dtype, dev = torch.bfloat16, ("cuda:0" if device == "cuda" else "cpu")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    workers, wait = MNN["workers"], 120.0
    results: dict = {}
    t0 = time.monotonic()
    with LocalNetwork(workers, 1, mode="tofino", state_dir=scratch, switch_process=False) as net:
        ctx = mp.get_context("spawn")  # one process per rank, as users run
        out = ctx.Queue()
        procs = [ctx.Process(target=_mnn_rank, args=(r, net.network(r).to_json(), dev, wait, out), daemon=True)
                 for r in range(workers)]
        for p in procs:
            p.start()
        try:
            for _ in range(workers):
                try:
                    rank, got = out.get(timeout=wait + 30)
                except queue.Empty:
                    break  # the ranks missing are named below
                results[rank] = got if isinstance(got, str) else torch.load(io.BytesIO(got))
        finally:
            join_or_kill(procs)
    train_s = time.monotonic() - t0
    for r in range(workers):
        if r not in results:
            return {"status": "fail", "summary": f"rank {r} did not finish within {wait + 30:.0f} s"}
        if isinstance(results[r], str):
            print(results[r], flush=True)
            return {"status": "fail", "summary": f"rank {r} raised: {results[r].strip().splitlines()[-1][:200]}"}
    ref = _reference(dtype, dev)
    problems, worst_param, worst_loss, identical, total = [], 0.0, 0.0, 0, 0
    for r in range(workers):
        losses, params, devices, _, _, where = results[r]
        if devices != [str(torch.device(dev))]:
            problems.append(f"rank {r}'s parameters are on {devices}, not {dev}")
        if not losses[-1] < losses[0] - 0.3:
            problems.append(f"rank {r} did not learn: losses {losses[0]:.3f} -> {losses[-1]:.3f}")
        worst_loss = max(worst_loss, max(abs(a - b) for a, b in zip(losses, ref["losses"][r])))
        if set(params) != set(ref["cast"]):
            problems.append(f"gathered names differ from the model's: {sorted(set(params) ^ set(ref['cast']))[:4]}")
            continue
        for name, want in ref["cast"].items():
            got = params[name]  # on the CPU: where the rank had it is in `where`
            if where[name] != (dtype, str(torch.device(dev))):
                problems.append(f"{name}: {where[name][0]} on {where[name][1]}")
            err = (got.cpu().float() - want.float()).abs()
            ulp = want.abs().float() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
            worst_param = max(worst_param, float(err.max()))
            if not bool((err <= PARAM_BOUND + ulp).all()):
                problems.append(f"rank {r} {name}: off the reference by {float(err.max()):.3g} > {PARAM_BOUND}")
            if r == 0:
                identical += int((got.cpu() == want).sum())
                total += want.numel()
    if worst_loss > LOSS_BOUND:
        problems.append(f"losses off the reference by {worst_loss:.3g} > {LOSS_BOUND}")
    for name in results[0][1]:
        if not torch.equal(results[0][1][name].cpu(), results[1][1][name].cpu()):
            problems.append(f"ranks 0 and 1 hold different {name}")
    losses0 = results[0][0]
    step_ms = 1000 * sorted(results[0][3][1:] or results[0][3])[len(results[0][3][1:] or results[0][3]) // 2]
    details = {"config": MNN, "transformers": transformers.__version__, "device": dev, "losses": {r: results[r][0] for r in
               range(workers)}, "reference_losses": ref["losses"], "max_param_diff": worst_param,
               "max_loss_diff": worst_loss, "bit_identical_fraction": identical / max(total, 1),
               "median_step_ms_rank0": step_ms, "train_seconds": train_s, "memory_rank0": results[0][4],
               "problems": problems}
    summary = (f"tiny Llama bf16 on {dev}, {workers} workers x {MNN['steps']} steps: loss {losses0[0]:.3f} -> "
               f"{losses0[-1]:.3f}; vs reference max |dparam| {worst_param:.3g} (bound {PARAM_BOUND:g}), "
               f"max |dloss| {worst_loss:.3g}, {100 * identical / max(total, 1):.1f}% bit-identical; "
               f"median step {step_ms:.0f} ms")
    if problems:
        return {"status": "fail", "summary": f"{problems[0]} ({len(problems)} problems); {summary}", "details": details}
    return {"status": "pass", "summary": summary, "details": details}


# ---------------------------------------------------------------- ddp

DDP_STEPS, DDP_LR, DDP_SAFETY, DDP_WORLD = 8, 0.05, 10.0, 2


def _ddp_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 4))


def _ddp_rank(rank: int, world: int, init: str, device: str, workdir: str, q) -> None:
    os.environ.update(LUWU_WORKDIR=workdir, OMP_NUM_THREADS="1")
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import luwu  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    try:
        dist.init_process_group("luwu", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        cuda = device == "cuda"
        dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        groups = {"luwu": None, "gloo": dist.new_group(backend="gloo")}
        notes = []
        if cuda and torch.cuda.device_count() >= world:
            groups["nccl"] = dist.new_group(backend="nccl")
        elif cuda:
            notes.append(f"NCCL not compared: {world} ranks share {torch.cuda.device_count()} GPU and NCCL refuses two "
                         "ranks on one device")
        ids = [dev.index] if cuda else None
        models = {k: DDP(_ddp_model().to(dev), process_group=g, device_ids=ids, bucket_cap_mb=0.004)
                  for k, g in groups.items()}
        models["local"] = _ddp_model().to(dev)
        opts = {k: torch.optim.SGD(m.parameters(), lr=DDP_LR) for k, m in models.items()}
        gen = torch.Generator().manual_seed(1000 + rank)
        w = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        max_grad, t_step = 0.0, dict.fromkeys(models, 0.0)
        for _ in range(DDP_STEPS):
            x = torch.randn(32, 16, generator=gen)
            y = (x @ w).to(dev)
            x = x.to(dev)
            for k, m in models.items():
                s0 = time.monotonic()
                opts[k].zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                if k == "gloo":
                    max_grad = max(max_grad, max(p.grad.abs().max().item() for p in m.parameters()))
                opts[k].step()
                if cuda:
                    torch.cuda.synchronize(dev)
                t_step[k] += time.monotonic() - s0
        dist.barrier()

        def flat(m):
            mod = m.module if hasattr(m, "module") else m
            return torch.cat([p.detach().reshape(-1) for p in mod.parameters()]).cpu().numpy()

        params = {k: flat(m) for k, m in models.items()}
        param_devices = sorted({str(p.device) for m in models.values() for p in m.parameters()})
        q.put((rank, "ok", {"params": params, "init": flat(_ddp_model()), "max_grad": max_grad, "notes": notes,
                            "devices": param_devices, "step_ms": {k: 1000 * v / DDP_STEPS for k, v in t_step.items()}}))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def check_ddp(device: str, scratch: Path) -> dict:
    if device == "none":
        return _skip("no CUDA device (torch.cuda.is_available() is False)")
    import multiprocessing as mp
    import queue

    import numpy as np

    from luwu.dataplane.process.children import join_or_kill
    from luwu.dataplane.quantize import contributor_bits

    scratch.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{scratch}/store"
    procs = [ctx.Process(target=_ddp_rank, args=(r, DDP_WORLD, init, device, str(scratch / "luwu"), q), daemon=True)
             for r in range(DDP_WORLD)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(DDP_WORLD):
            try:
                rank, status, value = q.get(timeout=120)
            except queue.Empty:
                missing = sorted(set(range(DDP_WORLD)) - set(results) - set(errors))
                return {"status": "fail", "summary": f"ranks {missing} did not finish within 120 s",
                        "details": {"errors": errors}}
            (results if status == "ok" else errors)[rank] = value
    finally:
        join_or_kill(procs)
    if errors:
        for r, tb in sorted(errors.items()):
            print(f"rank {r} failed:\n{tb}", flush=True)
        first = sorted(errors.items())[0]
        return {"status": "fail", "summary": f"rank {first[0]} raised: {first[1].strip().splitlines()[-1][:200]}"}
    res = [results[r] for r in range(DDP_WORLD)]
    max_grad = max(r["max_grad"] for r in res)
    c = contributor_bits(DDP_WORLD)
    tol = DDP_SAFETY * DDP_STEPS * DDP_LR * (DDP_WORLD * 2.0 ** (c - 30) + 2.0 ** -22) * max_grad
    problems, diffs = [], {}
    luwu0 = res[0]["params"]["luwu"]
    for r, out in enumerate(res):
        if not np.array_equal(out["params"]["luwu"], luwu0):
            problems.append(f"luwu replica of rank {r} differs from rank 0's")
        want_dev = "cuda" if device == "cuda" else "cpu"
        if any(not d.startswith(want_dev) for d in out["devices"]):
            problems.append(f"rank {r}'s parameters are on {out['devices']}")
        for base in [k for k in out["params"] if k not in ("luwu", "local")]:
            d = float(np.abs(out["params"]["luwu"] - out["params"][base]).max())
            diffs[base] = max(diffs.get(base, 0.0), d)
            if d > tol:
                problems.append(f"rank {r}: luwu and {base} differ by {d:.3g} > tolerance {tol:.3g}")
    moved = float(np.abs(luwu0 - res[0]["init"]).max())
    unsynced = max(float(np.abs(o["params"]["local"] - o["params"]["gloo"]).max()) for o in res)
    if moved <= 100 * tol or unsynced <= 100 * tol:
        problems.append(f"the comparison is blind: moved {moved:.3g}, unsynchronised {unsynced:.3g}, tol {tol:.3g}")
    notes = res[0]["notes"]
    step_ms = {k: round(v, 2) for k, v in res[0]["step_ms"].items()}
    details = {"world": DDP_WORLD, "device": device, "tolerance": tol, "max_diff": diffs, "moved": moved,
               "unsynced": unsynced, "notes": notes, "step_ms_rank0": step_ms, "devices": res[0]["devices"],
               "problems": problems}
    summary = (f"{DDP_WORLD} ranks on {res[0]['devices']}, {DDP_STEPS} steps: luwu vs "
               + ", ".join(f"{k} max |d| {v:.3g}" for k, v in diffs.items())
               + f" (tol {tol:.3g}); replicas identical; ms/step " + ", ".join(f"{k} {v}" for k, v in step_ms.items())
               + (f"; {notes[0]}" if notes else ""))
    if problems:
        return {"status": "fail", "summary": f"{problems[0]}; {summary}", "details": details}
    return {"status": "pass", "summary": summary, "details": details}


# ---------------------------------------------------------------- staging

STAGING_SIZES = (1 << 20, 16 << 20, 256 << 20)  # bytes


def _timed(fn, reps: int, dev) -> float:
    """Seconds per call of fn (after one warm-up), the device synchronised around the loop."""
    import torch

    fn()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / reps


def _staging_row(nbytes: int, dev, problems: list[str]) -> dict:
    """One size: plain pinned copies (the bus) against luwu's two staging paths."""
    import torch

    from luwu.worker.backend.staging import _needs_staging, _Stage
    from luwu.worker.model_in_network.devices import HostStage
    from luwu.worker.model_in_network.memory import MemoryTracker

    reps = max(3, min(50, (2 << 30) // nbytes))
    n = nbytes // 2  # bf16 elements, as ModelInNetwork's parameters
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    pinned.copy_(torch.randn(n).to(torch.bfloat16))
    on_dev = torch.empty(n, dtype=torch.bfloat16, device=dev)
    plain_h2d = _timed(lambda: on_dev.copy_(pinned, non_blocking=True), reps, dev)
    plain_d2h = _timed(lambda: pinned.copy_(on_dev, non_blocking=True), reps, dev)
    # ModelInNetwork: a pull lands in a (pageable) host tensor and goes up through the pinned stage;
    # a gradient comes down into it
    up, down = HostStage(MemoryTracker()), HostStage(MemoryTracker())
    src = torch.randn(n).to(torch.bfloat16)
    dst = torch.empty(n, dtype=torch.bfloat16, device=dev)
    mnn_up = _timed(lambda: up.to_device(dst, src), reps, dev)
    if not torch.equal(dst.cpu(), src):
        problems.append(f"HostStage.to_device of {nbytes} B corrupted the data")
    mnn_down = _timed(lambda: down.to_host(dst), reps, dev)
    if not torch.equal(down.to_host(dst), src):
        problems.append(f"HostStage.to_host of {nbytes} B corrupted the data")
    # the backend: a collective's device tensor copied to a fresh pinned buffer and back
    t = torch.randn(nbytes // 4, device=dev)
    want = t.clone()

    def backend_round_trip() -> None:
        st = _Stage(_needs_staging)
        host = st.to_host(t, is_output=True)
        host.mul_(1.0)
        st.copy_back()

    backend = _timed(backend_round_trip, reps, dev)
    if not torch.equal(t, want):
        problems.append(f"backend staging round trip of {nbytes} B changed the tensor")
    row = {"bytes": nbytes, "reps": reps,
           "plain_h2d_GBps": nbytes / plain_h2d / 1e9, "plain_d2h_GBps": nbytes / plain_d2h / 1e9,
           "mnn_to_device_GBps": nbytes / mnn_up / 1e9, "mnn_to_host_GBps": nbytes / mnn_down / 1e9,
           "backend_round_trip_GBps": 2 * nbytes / backend / 1e9}
    row["mnn_to_device_vs_plain"] = row["mnn_to_device_GBps"] / row["plain_h2d_GBps"]
    row["mnn_to_host_vs_plain"] = row["mnn_to_host_GBps"] / row["plain_d2h_GBps"]
    row["backend_vs_plain"] = row["backend_round_trip_GBps"] / (2 / (1 / row["plain_h2d_GBps"] + 1 / row["plain_d2h_GBps"]))
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}


def check_staging(device: str, scratch: Path) -> dict:
    if device != "cuda":
        return _skip("no CUDA device: pinned staging is CUDA's" if device == "none" else "CUDA only (pinned copies)")
    import torch

    dev = torch.device("cuda", 0)
    rows: list[dict] = []
    problems: list[str] = []
    for nbytes in STAGING_SIZES:
        rows.append(_staging_row(nbytes, dev, problems))
        torch.cuda.empty_cache()
    big = rows[-1]
    summary = (f"{big['bytes'] >> 20} MiB: plain pinned H2D {big['plain_h2d_GBps']:.1f} GB/s, D2H "
               f"{big['plain_d2h_GBps']:.1f}; HostStage to_device {big['mnn_to_device_GBps']:.1f} "
               f"({big['mnn_to_device_vs_plain']:.2f}x), to_host {big['mnn_to_host_GBps']:.1f} "
               f"({big['mnn_to_host_vs_plain']:.2f}x); backend round trip {big['backend_round_trip_GBps']:.1f} "
               f"({big['backend_vs_plain']:.2f}x)")
    details = {"rows": rows, "problems": problems, "device_name": torch.cuda.get_device_name(dev)}
    if problems:
        return {"status": "fail", "summary": f"{problems[0]}; {summary}", "details": details}
    return {"status": "pass", "summary": summary, "details": details}


CHECKS = {"cuda_tests": check_cuda_tests, "mnn": check_mnn, "ddp": check_ddp, "staging": check_staging}


def main() -> int:
    ap = argparse.ArgumentParser(prog="gpu_checks.py")
    ap.add_argument("check", choices=sorted(CHECKS))
    ap.add_argument("--device", choices=("cuda", "cpu", "none"), required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--scratch", required=True)
    args = ap.parse_args()
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        res = CHECKS[args.check](args.device, scratch)
    except BaseException as e:  # noqa: BLE001 - the driver reports it; the traceback is in the output
        traceback.print_exc()
        res = {"status": "error", "summary": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"}
    Path(args.result).write_text(json.dumps(res, default=str))
    return 0 if res["status"] in ("pass", "skip") else 1


if __name__ == "__main__":
    sys.exit(main())
