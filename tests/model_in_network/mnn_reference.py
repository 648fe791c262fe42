"""The reference every model-in-network result is checked against: the same GPT, data and seed
trained in one process on the whole global batch with torch.optim.AdamW."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from luwu.demo.data import CharCorpus
from luwu.demo.model import GPTConfig, build, loss_fn
from luwu.demo.worker import _ddp_state_bytes, _optimizer_groups


def single_process(spec: dict) -> dict:
    """Losses per step, final parameters by name, and the model-state bytes a DDP worker holds."""
    torch.set_num_threads(1)
    corpus = CharCorpus.load(spec.get("corpus"))
    cfg = GPTConfig(vocab=corpus.vocab, **spec["model"])
    model = build(cfg, spec["seed"])
    opt = torch.optim.AdamW(_optimizer_groups(model, spec["weight_decay"]), lr=spec["lr"])
    losses, state = [], None
    for step in range(spec["steps"]):
        x, y = corpus.batch(step, spec["batch"], cfg.context, spec["seed"])
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if state is None:
            state = _ddp_state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "state_bytes": state}


def mixed_precision(spec: dict, dtype: torch.dtype, workers: int, device: str = "cpu") -> dict:
    """What ModelInNetwork computes for a model of `dtype` on `workers` ranks, done locally: fp32
    master weights stepped by torch.optim.AdamW; each step the masters are rounded (torch's cast,
    as the node serves them) into a `dtype` copy of the model on `device` that computes every
    rank's shard; the shards' gradients are widened to fp32 and averaged, as the switch sums and
    the node divides. Losses per rank and step, masters and their `dtype` copies by name."""
    from luwu.demo.data import shard

    torch.set_num_threads(1)
    corpus = CharCorpus.load(spec.get("corpus"))
    cfg = GPTConfig(vocab=corpus.vocab, **spec["model"])
    work = build(cfg, spec["seed"]).to(device=device, dtype=dtype)
    master = build(cfg, spec["seed"]).to(dtype).float()  # the masters start from the model's own values
    opt = torch.optim.AdamW(_optimizer_groups(master, spec["weight_decay"]), lr=spec["lr"])
    pairs = [(m, w) for m, w in zip(master.parameters(), work.parameters())]
    losses: list[list[float]] = [[] for _ in range(workers)]
    for step in range(spec["steps"]):
        with torch.no_grad():
            for m, w in pairs:
                w.copy_(m.to(dtype))
        grads = [torch.zeros_like(m) for m, _ in pairs]
        x, y = corpus.batch(step, spec["batch"], cfg.context, spec["seed"])
        for r in range(workers):
            xs, ys = shard(x, y, r, workers)
            loss = loss_fn(work(xs.to(device)), ys.to(device))
            loss.backward()
            for g, (_, w) in zip(grads, pairs):
                g += w.grad.to(device="cpu", dtype=torch.float32)
                w.grad = None
            losses[r].append(loss.item())
        for g, (m, _) in zip(grads, pairs):
            m.grad = g / workers
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {k: v.detach().clone() for k, v in master.named_parameters()}
    return {"losses": losses, "params": params, "cast": {k: v.to(dtype) for k, v in params.items()}}


def run_ranks_in_threads(work: Callable[[int], None], workers: int, timeout: float) -> None:
    """`work(rank)` for every rank, each in its own thread (embedded engines), joined within `timeout` s each."""
    threads = [threading.Thread(target=work, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
