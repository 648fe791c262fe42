"""The model `luwu bench capacity` grows: LLaMA-shaped (RMSNorm, attention, SwiGLU MLP, untied
input embedding and output head), a fixed hidden size and a number of decoder layers.

With `transformers` installed it is `LlamaForCausalLM` built from a `LlamaConfig` (random init,
nothing downloaded, `tie_word_embeddings=False`); otherwise a built-in module of the same shapes
and parameter count (no rotary embedding: it has no parameters). Activation checkpointing is on in
both: HF's `activation_checkpointing_enable()` (`gradient_checkpointing_enable()` before
transformers 5), or `torch.utils.checkpoint` around each block.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


def intermediate_for(hidden: int) -> int:
    """LLaMA's MLP width for `hidden`: 8/3 of it, rounded up to a multiple of 64."""
    return int(math.ceil(hidden * 8 / 3 / 64) * 64)


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def reset_parameters(self) -> None:
        """Its init (ones), for a model built on the meta device (ModelInNetwork, FSDP2's materialise)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads = heads
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(hidden), _RMSNorm(hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.input_layernorm(x)
        q, k, v = (p(y).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.o_proj(a)
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLlama(nn.Module):
    """The built-in stand-in for LlamaForCausalLM (same parameter shapes); `forward(ids)` -> logits."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden, heads, intermediate) for _ in range(layers))
        self.norm = _RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.checkpointing = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and torch.is_grad_enabled() else block(x)
        return self.lm_head(self.norm(x))


def build(cfg: dict, meta: bool = False) -> nn.Module:
    """The model of `cfg` (vocab, hidden, layers, heads, intermediate, seq, seed, backend "hf"|"builtin",
    checkpointing: activation checkpointing, on unless False). `meta`: on the meta device (no storage), for counting parameters
    or for a wrapper that initialises the units itself."""
    torch.manual_seed(int(cfg["seed"]))
    ctx = torch.device("meta") if meta else contextlib.nullcontext()
    with ctx:
        if cfg["backend"] == "hf":
            from transformers import LlamaConfig, LlamaForCausalLM

            conf = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                               num_attention_heads=cfg["heads"], num_key_value_heads=cfg["heads"],
                               intermediate_size=cfg["intermediate"], max_position_embeddings=max(cfg["seq"], 16),
                               tie_word_embeddings=False, use_cache=False)
            hf = LlamaForCausalLM(conf)
            if cfg.get("checkpointing", True):  # the newer name where there is one (the old one warns)
                getattr(hf, "activation_checkpointing_enable", hf.gradient_checkpointing_enable)()
            model: nn.Module = hf
        else:
            model = TinyLlama(cfg["vocab"], cfg["hidden"], cfg["layers"], cfg["heads"], cfg["intermediate"])
            model.checkpointing = bool(cfg.get("checkpointing", True))
    model.train()
    return model


def materialise(model: nn.Module, backend: str) -> None:
    """Give a model built on the meta device (and perhaps sharded since) CPU storage and its init:
    FSDP2's recipe for a model no rank can hold whole. HF's `initialize_weights()` (its own init,
    rotary buffers included), or the built-in modules' `reset_parameters()` and RMSNorm's ones."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        if backend == "hf":
            model.initialize_weights()  # type: ignore[operator]
            return
        for m in model.modules():
            if isinstance(m, (_RMSNorm, nn.Linear, nn.Embedding)):
                m.reset_parameters()


def loss_of(model: nn.Module, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """Next-token cross-entropy of `model` (or a wrapper of it) on `ids`."""
    if backend == "hf":
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def count_params(cfg: dict) -> int:
    """Trainable parameters of the model of `cfg`, counted on the meta device (no memory)."""
    return sum(p.numel() for p in build(cfg, meta=True).parameters() if p.requires_grad)
