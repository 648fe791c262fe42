"""Computation and memory of one training iteration, layer by layer (after Kundu et al. 2024,
arXiv 2407.14645): each operator of a transformer block is a roofline, the larger of its FLOPs at
the GPU's achievable GEMM rate and its HBM bytes at the achievable memory rate; backward costs
twice the forward; recomputation adds the forward work it redoes: all of it (full checkpointing)
or only the attention core (selective, Korthikanti et al. 2022, arXiv 2205.05198, whose activation
memory formulas this follows). docs/simulator.md explains every term.
"""

from __future__ import annotations

from dataclasses import dataclass

from luwu.simulate.hardware import Config

# Activation recomputation (Korthikanti et al. 2022, section 4): "full" keeps each block's input
# and recomputes the whole block in backward; "selective" keeps everything but the attention core
# (QK^T, softmax, dropout, x V: the 5as/h part of the activations) and recomputes only that;
# "none" keeps everything. Cheapest first: what a system runs when its memory allows.
RECOMPUTE = ("none", "selective", "full")
ATTENTION_CORE = slice(2, 5)  # the operators of `_ops` that selective recomputation redoes


@dataclass(frozen=True)
class LayerCost:
    """Seconds of GPU time of one unit the workers pull and push: a block, or the tied embedding."""

    name: str
    params: int
    fwd: float
    bwd: float  # including the recompute
    hw_flops: float  # FLOPs the GPU executes for this unit in one iteration (fwd + recompute + bwd)


def _ops(b: int, s: int, h: int, a: int, B: int) -> list[tuple[float, float]]:
    """(FLOPs, HBM bytes) of each forward operator of one block for b sequences of s tokens."""
    t = b * s
    return [
        (0, B * 2 * t * h),  # layer norm 1
        (2 * t * h * 3 * h, B * (t * h + 3 * h * h + 3 * t * h)),  # QKV projection
        (2 * b * s * s * h, B * (2 * t * h + b * a * s * s)),  # scores Q K^T
        (0, B * 3 * b * a * s * s),  # scale, mask, softmax, dropout
        (2 * b * s * s * h, B * (b * a * s * s + 2 * t * h)),  # scores x V
        (2 * t * h * h, B * (2 * t * h + h * h)),  # output projection
        (0, B * 3 * t * h),  # dropout + residual
        (0, B * 2 * t * h),  # layer norm 2
        (2 * t * h * 4 * h, B * (5 * t * h + 4 * h * h)),  # MLP up
        (0, B * 8 * t * h),  # GeLU
        (2 * t * 4 * h * h, B * (5 * t * h + 4 * h * h)),  # MLP down
        (0, B * 3 * t * h),  # dropout + residual
    ]


def _roofline(ops, cfg: Config) -> tuple[float, float]:
    g = cfg.gpu
    secs = sum(max(f / (g.peak_flops * g.gemm_efficiency), m / (g.hbm * g.hbm_efficiency)) for f, m in ops)
    return secs, sum(f for f, _ in ops)


def layer_costs(cfg: Config, micro_batch: int, recompute: str = "full") -> list[LayerCost]:
    """The embedding (index 0, whose tied output head runs last in forward and first in backward)
    followed by the blocks in forward order. `recompute`: one of RECOMPUTE."""
    m, B = cfg.model, cfg.dtype_bytes
    b, s, h = micro_batch, m.seq, m.hidden
    ops = _ops(b, s, h, m.heads, B)
    fwd, flops = _roofline(ops, cfg)
    redo, redo_flops = {"none": (0.0, 0.0), "full": (fwd, flops),
                        "selective": _roofline(ops[ATTENTION_CORE], cfg)}[recompute]
    block = LayerCost("block", m.block_params, fwd, 2 * fwd + redo, 3 * flops + redo_flops)
    t = b * s
    head_ops = [(2 * t * h * m.vocab, B * (t * h + h * m.vocab + t * m.vocab)), (0, 6 * t * m.vocab)]
    hf, hfl = _roofline(head_ops, cfg)
    embed = LayerCost("embed+head", m.embed_params, hf, 2 * hf, 3 * hfl)
    return [embed] + [block] * m.layers


def model_flops_per_token(cfg: Config) -> float:
    """Model FLOPs per token (no recompute): 6 per parameter plus attention (Narayanan et al. 2021)."""
    m = cfg.model
    return 6 * m.params + 12 * m.layers * m.hidden * m.seq


def activation_bytes(cfg: Config, micro_batch: int, recompute: str = "full") -> tuple[float, float]:
    """(bytes kept across the iteration, peak transient bytes on top of them), after Korthikanti
    et al. table 2 (no tensor parallelism): a block's activations are s b h (34 + 5 a s / h) bytes.
    Kept per block: its input, 2 s b h (full recomputation); all but the attention core, 34 s b h
    (selective); everything (none). Transient: the recomputed part of the one block being
    back-propagated, or the logits and their fp32 softmax while the head runs (b s V (2 + 4)),
    whichever is larger: the head's forward and backward finish, and free the logits, before
    the first block's backward starts."""
    m = cfg.model
    b, s, h, a = micro_batch, m.seq, m.hidden, m.heads
    full = s * b * h * (34 + 5 * a * s / h)
    kept, redo = {"full": (2 * s * b * h, full), "selective": (34 * s * b * h, 5 * a * s * s * b),
                  "none": (full, 0.0)}[recompute]
    logits = b * s * m.vocab * (cfg.dtype_bytes + 4)
    return m.layers * kept, max(redo, logits)
