"""`luwu mininet run --workload train`: model-in-network training across the emulated network.

Every worker host trains the demo's small GPT with ModelInNetwork (luwu.demo.worker.train, mode
"mnn"): parameters and AdamW state live on the optimizer node(s), a real `luwu node` daemon in its
own namespace with a RAM budget below the job's optimizer state (so it runs out of core), the
gradients are summed by the emulated switches and the parameters multicast back. The runner plans
the job on the model's units (one layer per unit), starts the nodes, hands each worker its
`JobNetwork` (its endpoint plan, the nodes' control channels -- Unix sockets in the run
directory, which every namespace sees -- and the unit placement from the plan's shards), and
afterwards trains the same model on the same data with the same seed in one process without any
network (torch.optim.AdamW on the whole batch: what the workers' averaged gradients are) to compare.

Rail-only: a node daemon per rail owns its rail's slice of every unit; a worker's `JobNetwork`
carries its rail's slices, the job's size and its rail's ranks, and the worker gets its NVLink
address and a FileStore in the run directory, so ModelInNetwork reduce-scatters each gradient and
all-gathers each pull among the server's GPUs (worker/model_in_network/hierarchy.py); every rank
then gathers the final parameters together (an all-gather per unit), rank 0 writes them.

Tolerance. The node serves fp32 here and the model has no attention biases. The fixed-point sums
differ from the single process's full-batch gradient by a few quanta (2^-30 of each chunk's largest
magnitude, docs/protocol.md 5). AdamW divides each gradient by its running RMS plus eps (1e-8), so
an element whose gradient is itself near a quantum (1e-10 here) can see its step change by a few
percent of lr: the measured largest difference over 21 seeds of 5 steps was 1.2e-4 (typically
1e-6..5e-5), nearly all of it from the first step. `matches_reference` allows 2% of lr per step
(1e-3 for 5 steps). A lost or doubled contribution changes a worker's gradient by a large fraction
and AdamW's steps by about lr (1e-2) on many elements, far outside that.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from luwu.dataplane.process.children import python_module

MODEL: dict[str, Any] = {"d_model": 32, "n_layers": 4, "n_heads": 2, "context": 16, "attn_bias": False}
ROWS_PER_WORKER = 4  # the global batch is this many rows per worker
LR, WEIGHT_DECAY = 1e-2, 0.1
STEP_TOLERANCE = 0.02  # of lr per step: see the module docstring
NODE_RAM_FRACTION = 0.5  # the node's RAM budget as a part of the job's optimizer state: out of core
STORE_FILE = "train-store"  # rail-only: the c10d FileStore the NVLink channel's ranks meet in (run directory)


def tolerance(steps: int) -> float:
    """The largest parameter difference from the reference that rounding explains (module docstring)."""
    return STEP_TOLERANCE * LR * steps


def spec(workers: int, steps: int, seed: int) -> dict:
    """The demo worker's spec (luwu.demo.worker.train) for this workload; `networks` is added per rank."""
    return {"mode": "mnn", "workers": workers, "model": dict(MODEL), "steps": steps, "batch": ROWS_PER_WORKER * workers,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY, "seed": seed, "served_dtype": "fp32", "engine": "embedded"}


def _model(seed: int):
    from luwu.demo.data import CharCorpus
    from luwu.demo.model import GPTConfig, build

    corpus = CharCorpus.load(None)
    return build(GPTConfig(vocab=corpus.vocab, **MODEL), seed), corpus


def layers(seed: int) -> list[tuple[int, int]]:
    """(unit index, elements) of the model's units: the layers the job is planned with."""
    from luwu.worker.model_in_network.units import split_units

    model, _ = _model(seed)
    return [(u.index, u.numel) for u in split_units(model)]


def state_bytes(seed: int) -> int:
    """The optimizer state the nodes hold: fp32 master, AdamW's two moments and the served copy."""
    return sum(n for _, n in layers(seed)) * 4 * 4


def reference(seed: int, steps: int, workers: int) -> tuple[dict, list[float]]:
    """The same training in one process, no network: (parameters by name, losses)."""
    import torch

    from luwu.demo.model import loss_fn
    from luwu.demo.worker import _optimizer_groups

    torch.set_num_threads(1)
    model, corpus = _model(seed)
    opt = torch.optim.AdamW(_optimizer_groups(model, WEIGHT_DECAY), lr=LR)
    losses = []
    for step in range(steps):
        x, y = corpus.batch(step, ROWS_PER_WORKER * workers, MODEL["context"], seed)  # every worker's rows
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.named_parameters()}, losses


def compare(params_file: Path, seed: int, steps: int, workers: int) -> dict:
    """Rank 0's final parameters against the reference: max_param_diff, reference_loss, matches_reference."""
    import numpy as np

    got = dict(np.load(params_file))
    ref, ref_losses = reference(seed, steps, workers)
    missing = sorted(set(ref) - set(got))
    if missing:
        return {"reference_loss": ref_losses[-1], "max_param_diff": None, "matches_reference": False,
                "error": f"rank 0 reported no values for {missing[:4]}"}
    diff = max(float(np.max(np.abs(got[k] - v.numpy().reshape(-1)))) for k, v in ref.items())
    return {"reference_loss": ref_losses[-1], "reference_losses": ref_losses, "max_param_diff": diff,
            "tolerance": tolerance(steps), "matches_reference": diff <= tolerance(steps)}


def run(cfg: dict, say, wait_line) -> int:
    """The worker's side of the runner's protocol (ready, go, result, stop) for --workload train."""
    import numpy as np

    from luwu.demo.worker import train

    w, t = cfg["worker"], cfg["worker"]["train"]
    rank, timeout = w["rank"], cfg["timeout"]
    say("ready", rank=rank)
    if wait_line(("go",), timeout) != "go":
        return 1
    spec_r = dict(t["spec"], networks={rank: t["network"]}, gather=rank == 0)
    nvlink = w.get("nvlink")
    if nvlink:  # rail-only: the server's ranks reduce-scatter and all-gather over NVLink, and gather together
        spec_r.update(gather=True, p2p_host=nvlink["addresses"][nvlink["index"]],
                      store=str(Path(t["params_out"]).with_name(STORE_FILE)))  # in the run directory
    t0 = time.monotonic()
    report = train(spec_r, rank)
    seconds = time.monotonic() - t0
    if rank == 0:
        arrays: dict[str, Any] = {k: np.asarray(v, dtype=np.float32) for k, v in report.pop("params").items()}
        np.savez(t["params_out"], **arrays)
    mnn = report.get("mnn", {})
    say("result", rank=rank, host=cfg["host"], workload="train", steps=len(report["losses"]),
        losses=report["losses"], seconds=seconds, verified=True,
        memory=mnn.get("memory", {}).get("peak_bytes"), pushed_bytes=mnn.get("stats", {}).get("pushed_bytes"))
    wait_line(("stop",), timeout)
    return 0


def network_json(job, rank: int, run_dir: Path, token: str) -> str:
    """Worker `rank`'s JobNetwork: its endpoint plan, the nodes' control sockets and what JoinJob
    would tell it of the job (controller/core.py job_info): its group's shards (sliced layers
    included; on rail-only its rail's slice of every unit), the job's size and its group's ranks."""
    from luwu.worker.model_in_network.network import JobNetwork

    plan = job.plan
    group = plan.group_of(rank)
    info = {"job_id": "mininet-train", "num_workers": plan.num_workers, "group": group,
            "group_ranks": plan.groups[group], "shards": [vars(s) for s in plan.shards if s.group == group]}
    controls = [f"unix:{run_dir / (node + '.sock')}" for node in job.plan.nodes]
    return JobNetwork.from_controller(job.worker_plans[rank], info, controls, job_token=token).to_json()


def node_argv(node: str, plan_file: Path, run_dir: Path, token_file: Path, ram: int) -> list[str]:
    return python_module(
        "luwu.cli", "node", "--plan", str(plan_file), "--state-dir", str(run_dir / f"{node}-state"),
        "--ram-budget", str(ram), "--control", f"unix:{run_dir / (node + '.sock')}", "--control-token-file", str(token_file))


def summary(workers: list[dict], compared: dict) -> dict:
    done = [w for w in workers if w.get("losses")]
    last = [w["losses"][-1] for w in done]
    return {"loss": sum(last) / len(last) if last else None, **{k: v for k, v in compared.items()
                                                                if k != "reference_losses"},
            "train": {"per_worker": [{k: v for k, v in w.items() if k != "losses"} for w in workers],
                      "losses_rank0": done[0]["losses"] if done else [],
                      "reference_losses": compared.get("reference_losses", []),
                      "seconds_max": max((w["seconds"] for w in done), default=None)}}


