"""The reference every model-in-network result is checked against: the same GPT, data and seed
trained in one process on the whole global batch with torch.optim.AdamW."""

from __future__ import annotations

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
