"""Computation and memory of one training iteration, layer by layer (after Kundu et al. 2024,
arXiv 2407.14645): each operator of a transformer block is a roofline, the larger of its FLOPs at
the GPU's achievable GEMM rate and its HBM bytes at the achievable memory rate; backward costs
twice the forward; activation checkpointing adds one forward (the recompute). Activation memory
follows Korthikanti et al. 2022 (arXiv 2205.05198). docs/simulator.md explains every term.
"""

from __future__ import annotations

from dataclasses import dataclass

from luwu.simulate.hardware import Config


@dataclass(frozen=True)
class LayerCost:
    """Seconds of GPU time of one unit the workers pull and push: a block, or the tied embedding."""

    name: str
    params: int
    fwd: float
    bwd: float  # including the recompute when checkpointing
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


def layer_costs(cfg: Config, micro_batch: int) -> list[LayerCost]:
    """The embedding (index 0, whose tied output head runs last in forward and first in backward)
    followed by the blocks in forward order."""
    m, B = cfg.model, cfg.dtype_bytes
    b, s, h = micro_batch, m.seq, m.hidden
    recompute = 1 if cfg.checkpointing else 0
    fwd, flops = _roofline(_ops(b, s, h, m.heads, B), cfg)
    block = LayerCost("block", m.block_params, fwd, (2 + recompute) * fwd, (3 + recompute) * flops)
    t = b * s
    head_ops = [(2 * t * h * m.vocab, B * (t * h + h * m.vocab + t * m.vocab)), (0, 6 * t * m.vocab)]
    hf, hfl = _roofline(head_ops, cfg)
    embed = LayerCost("embed+head", m.embed_params, hf, 2 * hf, 3 * hfl)
    return [embed] + [block] * m.layers


def model_flops_per_token(cfg: Config) -> float:
    """Model FLOPs per token (no recompute): 6 per parameter plus attention (Narayanan et al. 2021)."""
    m = cfg.model
    return 6 * m.params + 12 * m.layers * m.hidden * m.seq


def activation_bytes(cfg: Config, micro_batch: int) -> tuple[float, float]:
    """(bytes kept across the iteration, peak bytes of the one block being back-propagated).
    Kept: each block's input (2 s h bytes per sequence) with checkpointing, else everything
    (s h (34 + 5 a s / h) per block, Korthikanti et al. table 2). Plus the logits and their fp32
    softmax for the loss."""
    m = cfg.model
    b, s, h, a = micro_batch, m.seq, m.hidden, m.heads
    full = s * b * h * (34 + 5 * a * s / h)
    logits = b * s * m.vocab * (cfg.dtype_bytes + 4)
    if cfg.checkpointing:
        return m.layers * 2 * s * b * h + logits, full
    return m.layers * full + logits, 0.0
