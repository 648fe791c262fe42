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
# operators Megatron-LM's tensor parallelism splits across the tp GPUs (the projections, the
# attention core by heads, the MLP and its GeLU); layer norms, dropout and residuals are replicated
# (no sequence parallelism). Narayanan et al. 2021 (arXiv 2104.04473), section 2.3.
TP_SPLIT = frozenset({1, 2, 3, 4, 5, 8, 9, 10})


@dataclass(frozen=True)
class LayerCost:
    """Seconds of GPU time of one unit the workers pull and push: a block, or the tied embedding."""

    name: str
    params: int
    fwd: float
    bwd: float  # including the recompute
    hw_flops: float  # FLOPs the GPU executes for this unit in one iteration (fwd + recompute + bwd)


def _ops(b: int, s: int, h: int, a: int, B: int, tp: int = 1) -> list[tuple[float, float]]:
    """(FLOPs, HBM bytes) of each forward operator of one block for b sequences of s tokens, on
    one of `tp` tensor-parallel GPUs."""
    t = b * s
    ops = [
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
    return [(f / tp, m / tp) if i in TP_SPLIT else (f, m) for i, (f, m) in enumerate(ops)]


def tp_allreduce(cfg: Config, nbytes: float) -> float:
    """Seconds of one ring allreduce of `nbytes` among the tp GPUs of a server over NVLink:
    2(t-1)/t of the bytes at NCCL's NVLink bus bandwidth plus 2(t-1) steps (0 when tp = 1)."""
    t, net = cfg.tp, cfg.net
    if t == 1:
        return 0.0
    return 2 * (t - 1) / t * nbytes / (net.nvlink * net.nvlink_efficiency) + 2 * (t - 1) * net.nvlink_alpha


def stage_layers(cfg: Config) -> int:
    """Blocks of the largest pipeline stage: ceil(L / pp) (the model's blocks when pp = 1)."""
    return -(-cfg.model.layers // cfg.pp)


def in_flight(cfg: Config) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once: min(pp, m) with
    1F1B, m with GPipe (Narayanan et al. 2021, section 2.2); 1 without pipelining."""
    if cfg.pp == 1:
        return 1
    m = micro_batches(cfg)
    return min(cfg.pp, m) if cfg.schedule == "1f1b" else m


def micro_batches(cfg: Config) -> int:
    """Micro-batches per iteration and data-parallel replica: the configured number, else 1
    without pipelining and 4 x pp with it."""
    return cfg.micro_batches or (1 if cfg.pp == 1 else 4 * cfg.pp)


def _roofline(ops, cfg: Config) -> tuple[float, float]:
    g = cfg.gpu
    secs = sum(max(f / (g.peak_flops * g.gemm_efficiency), m / (g.hbm * g.hbm_efficiency)) for f, m in ops)
    return secs, sum(f for f, _ in ops)


def layer_costs(cfg: Config, micro_batch: int, recompute: str = "full") -> list[LayerCost]:
    """The embedding (index 0, whose tied output head runs last in forward and first in backward)
    followed by the blocks in forward order. `recompute`: one of RECOMPUTE."""
    m, B, tp = cfg.model, cfg.dtype_bytes, cfg.tp
    b, s, h = micro_batch, m.seq, m.hidden
    ops = _ops(b, s, h, m.heads, B, tp)
    fwd, flops = _roofline(ops, cfg)
    redo, redo_flops = {"none": (0.0, 0.0), "full": (fwd, flops),
                        "selective": _roofline(ops[ATTENTION_CORE], cfg)}[recompute]
    # tensor parallelism: two allreduces of the block's b s h output in forward (after attention
    # and after the MLP), two in backward, two more when full recomputation redoes the forward
    ar = tp_allreduce(cfg, B * b * s * h)
    block = LayerCost("block", m.block_params // tp, fwd + 2 * ar,
                      2 * fwd + redo + (4 if recompute == "full" else 2) * ar, 3 * flops + redo_flops)
    t = b * s
    head_ops = [(2 * t * h * m.vocab / tp, B * (t * h + h * m.vocab / tp + t * m.vocab / tp)),
                (0, 6 * t * m.vocab / tp)]  # a vocabulary-parallel head when tp > 1
    hf, hfl = _roofline(head_ops, cfg)
    embed = LayerCost("embed+head", m.embed_params // tp, hf, 2 * hf, 3 * hfl)
    return [embed] + [block] * stage_layers(cfg)


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
    m, t = cfg.model, cfg.tp
    b, s = micro_batch, m.seq
    kept, redo = block_activations(cfg, micro_batch, recompute)
    logits = b * s * m.vocab * (cfg.dtype_bytes + 4) / t
    if cfg.activation_offload:  # two blocks' checkpoints on the GPU: one being copied out (or in), one in use
        return min(2, stage_layers(cfg) * in_flight(cfg)) * kept, max(redo, logits)
    return stage_layers(cfg) * kept * in_flight(cfg), max(redo, logits)


def block_activations(cfg: Config, micro_batch: int, recompute: str) -> tuple[float, float]:
    """(bytes one block keeps from forward to backward, bytes its recompute adds in backward) on
    one of tp GPUs: Korthikanti et al. table 2, s b h (10 + 24/t + 5 a s / (h t)) in all, of which
    the input 2 s b h is replicated across the tp GPUs (no sequence parallelism)."""
    m, t = cfg.model, cfg.tp
    b, s, h, a = micro_batch, m.seq, m.hidden, m.heads
    full = s * b * h * (34 + 5 * a * s / h) if t == 1 else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return {"full": (2 * s * b * h, full), "selective": ((34 if t == 1 else 10 + 24 / t) * s * b * h,
                                                          5 * a * s * s * b / t),
            "none": (full, 0.0)}[recompute]


def offloaded_activation_bytes(cfg: Config, micro_batch: int, recompute: str) -> float:
    """Host RAM the checkpointed activations take with `activation_offload` (else 0)."""
    if not cfg.activation_offload:
        return 0.0
    return stage_layers(cfg) * in_flight(cfg) * block_activations(cfg, micro_batch, recompute)[0]
