"""The demo's bigger models: OPT-shaped `transformers` causal LMs (OPT is the paper's model family),
built from a config (never downloaded) at the sizes `luwu demo --model 125m|350m|custom` names.

`--model tiny` is the demo's own GPT (model.py); the sizes here are `transformers.OPTConfig`s with
OPT-125m's and OPT-350m's shapes (hidden, layers, heads, FFN; OPT-350m's 512-wide embedding
projected in and out, and its post-norm blocks), dropout off, the demo's context length as
`max_position_embeddings`, and the demo corpus's vocabulary (a character per token) unless `--vocab`
is given. Input embedding and output head are tied, as OPT's are.

The luwu workers build the model on the meta device: ModelInNetwork initialises it unit by unit
(unit i by its modules' own init under `torch.manual_seed(seed + i)`, materialize.py), so no worker
ever holds it whole. The DDP baseline must hold it whole: it builds it normally and then sets every
unit to the values the network gives it (`network_initial_values`: the same materialiser, one unit
at a time), so both runs start from the same parameters, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# name -> (hidden, layers, heads, ffn, extra OPTConfig fields): the shapes of facebook/opt-125m and opt-350m
SIZES: dict[str, tuple[int, int, int, int, dict[str, Any]]] = {
    "125m": (768, 12, 12, 3072, {}),
    "350m": (1024, 24, 16, 4096, {"word_embed_proj_dim": 512, "do_layer_norm_before": False}),
}
DEFAULT_STEPS = {"tiny": 150, "custom": 150, "125m": 5, "350m": 3}  # 2 cores: the big sizes take seconds a step
DEFAULT_LR = {"tiny": 3e-3, "custom": 3e-3, "125m": 6e-4, "350m": 3e-4}  # OPT's own peak rates at 125m/350m


def config_dict(size: str, vocab: int, context: int, d_model: int | None = None, layers: int | None = None,
                heads: int | None = None) -> dict:
    """The OPTConfig fields of `size` ("125m", "350m", or "custom" with d_model/layers/heads)."""
    extra: dict[str, Any]
    if size == "custom":
        if d_model is None or layers is None or heads is None:
            raise ValueError("--model custom needs --d-model, --layers and --heads")
        hidden, n_layers, n_heads, ffn, extra = d_model, layers, heads, 4 * d_model, {}
    else:
        hidden, n_layers, n_heads, ffn, extra = SIZES[size]
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
            "ffn_dim": ffn, "max_position_embeddings": context, "word_embed_proj_dim": hidden, "dropout": 0.0,
            "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0, "tie_word_embeddings": True,
            "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, **extra}


def build(cfg: dict, *, meta: bool, seed: int = 0, checkpointing: bool = False) -> nn.Module:
    """The OPT model of `cfg` (config_dict), in training mode: on the meta device (no memory for its
    parameters), or built normally under `torch.manual_seed(seed)` (the caller's generator kept);
    `checkpointing`: HF's activation checkpointing in every block (non-reentrant)."""
    import transformers as hf

    config = hf.OPTConfig(**cfg)
    if meta:
        with torch.device("meta"):
            model = hf.OPTForCausalLM(config)
    else:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = hf.OPTForCausalLM(config)
    model.train()
    if checkpointing:
        kwargs = {"use_reentrant": False}
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5; older: the alias
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def network_initial_values(model: nn.Module, cfg: dict, seed: int) -> int:
    """Set `model` (built normally) to the values a meta-built copy gets from the network under
    `seed` (ModelInNetwork(..., seed=seed): materialize.py), one unit at a time; returns the number
    of parameters set (every one, or a ValueError)."""
    from luwu.worker.model_in_network.devices import HostStage
    from luwu.worker.model_in_network.materialize import Materializer
    from luwu.worker.model_in_network.memory import MemoryTracker
    from luwu.worker.model_in_network.units import split_units

    ghost = build(cfg, meta=True)
    init = Materializer.for_model(ghost, None, seed, None)
    if init is None:
        raise ValueError("the ghost model was not built on the meta device")
    units = split_units(ghost)
    memory = MemoryTracker()
    flats = init.flats(units, memory, HostStage(memory))
    named = dict(model.named_parameters())
    done = 0
    with torch.no_grad():
        for u in units:
            values = torch.from_numpy(init.values(units, flats, u.index))
            for (name, p), (lo, hi) in zip(u.params, u.offsets):
                full = f"{u.name}.{name}" if u.name else name
                if full not in named or named[full].shape != p.shape:
                    raise ValueError(f"parameter {full} of unit {u.label()} is not in the eager model as shaped")
                named[full].copy_(values[lo:hi].view(p.shape))
                done += p.numel()
    want = sum(p.numel() for p in model.parameters())
    if done != want:
        raise ValueError(f"set {done} of the model's {want} parameters from the network's initial values")
    return done
