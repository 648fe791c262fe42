"""AdamW and the bf16 cast (or the fp32 copy) in one compiled pass (numba): the fast twin of
`kernels.step_shard`.

The reference path (`kernels.step_shard`) runs `torch._fused_adamw_` on a cache-sized group and
then rounds that group's master weights to bf16 with `Tensor.copy_`: two passes over the master.
Here one loop reads master, exp_avg, exp_avg_sq and the gradient once and writes them and the
served bf16 copy, element by element, with exactly the arithmetic of torch's vectorized CPU
kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp as built in the torch wheel):

    g  = g / scale                                 (when the sum is over several workers; stored)
    p  = p * f32(1 - lr * wd)                      (when wd != 0)
    m  = fma(w, g - m, m)        if |w| < 0.5      (exp_avg.lerp_(g, w), w = f32(1 - beta1))
       = fma(w - 1, g - m, g)    otherwise
    v  = fma(f32(1 - beta2) * g, g, v * f32(beta2))   (the compiler contracts torch's a*b + c*g*g)
    p  = p + (f32(-lr / bc1) * m) / (sqrt(v) / f32(sqrt(bc2)) + f32(eps))
    bf16 = (bits(p) + 0x7FFF + (bits(p) >> 16 & 1)) >> 16            (round to nearest even)
    fp32 = p                                       (an fp32 served copy: the same bits)

Bias corrections are computed in double as torch does. torch's scalar remainder loop (the last
`len % VECTOR` elements of each tensor) rounds differently, so those few elements are stepped by
torch itself, on the remainder slice alone (which takes the same scalar path), and cast by torch.
torch's vectorized float->bf16 cast turns every NaN into 0xFFFF (c10's scalar one would give
0x7FC0); the kernel does the same, and `usable` checks once that this torch build still does.
tests/optimizer/test_optimizer_fused.py checks all of it bit for bit against torch.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable

import numpy as np
import torch

from luwu.dataplane import kernels as kernel_mode
from luwu.dataplane.process.usage import UserError

from .layout import ShardPlan, plan_layer
from .spec import SHARD_ALIGN_ELEMS, JobSpec, LayerSpec, OptimizerSpec

# float32 lanes of torch's Vectorized<float> per CPU capability: the scalar remainder of a tensor
# is its last `numel % lanes` elements. Capabilities not listed keep the reference path.
VECTOR_LANES = {"AVX512": 16, "AVX2": 8}
BF16_NAN = np.uint16(0xFFFF)  # what torch's vectorized cast makes of any NaN (checked: _torch_casts_nan_as; = fused_numba.BF16_NAN)


@functools.lru_cache(maxsize=1)
def vector_lanes() -> int | None:
    return VECTOR_LANES.get(torch.backends.cpu.get_cpu_capability())


@functools.lru_cache(maxsize=1)
def _torch_casts_nan_as() -> set[int]:
    """The bf16 bit patterns torch's cast gives NaNs (quiet, signalling, negative, payloads),
    at vector and remainder positions of a tensor."""
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000],
                    dtype=np.uint32)
    x = torch.from_numpy(np.resize(nans, 37).view(np.float32))
    return set(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).tolist())


def usable(opt: OptimizerSpec, served: torch.Tensor | None) -> bool:
    """Whether the fused pass runs this step: AdamW with a bf16 or fp32 served copy, compiled
    kernels on (`luwu.dataplane.kernels`), and a CPU and torch build whose kernels it is known to
    match (for bf16, whose NaN casts it is known to match)."""
    if opt.name != "adamw" or served is None or served.dtype not in (torch.bfloat16, torch.float32):
        return False
    return _usable_copy(served.dtype == torch.float32)


def _usable_copy(fp32: bool) -> bool:
    """`usable` once the optimizer is AdamW and the served copy bf16 (False) or fp32 (True)."""
    if not kernel_mode.use_numba() or vector_lanes() is None:
        return False
    return fp32 or _torch_casts_nan_as() == {int(BF16_NAN)}


@functools.lru_cache(maxsize=1)
def _compiled():
    """The compiled kernels (bf16 served copy, fp32 served copy): numba is imported, and the
    kernels compiled or loaded from numba's on-disk cache, on first use, never at import."""
    from . import fused_numba

    return fused_numba.shard, fused_numba.shard32


STEP, CAST = 0, 1  # row kinds of the compiled call (fused_numba.shard): step and cast (or copy); cast only (torch stepped it)


@functools.lru_cache(maxsize=4096)
def _split(plan: ShardPlan, lanes: int) -> tuple[np.ndarray, tuple[tuple[tuple[int, int], ...], ...]]:
    """The compiled call's rows (lo, hi, decay, kind) and the scalar remainders torch steps
    (ranges with weight decay, ranges without)."""
    rows: list[tuple[int, int, int, int]] = []
    tails: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
    for lo, hi, decay in plan.runs:
        cut = hi - (hi - lo) % lanes
        if cut > lo:
            rows.append((lo, cut, int(decay), STEP))
        if hi > cut:
            rows.append((cut, hi, int(decay), CAST))
            tails[0 if decay else 1].append((cut, hi))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
    arr.flags.writeable = False
    return arr, (tuple(tails[0]), tuple(tails[1]))


@functools.lru_cache(maxsize=256)
def hyper(opt: OptimizerSpec, step: int, grad_scale: float | None) -> tuple[np.ndarray, bool, torch.Tensor]:
    """The kernel's float32 constants for 0-based step `step`, rounded as torch rounds them; and
    torch's step counter for the remainders (cached: a step's shards share them, read-only)."""
    lr, (b1, b2), n = opt.lr_at(step), opt.betas, float(step + 1)
    bc1, bc2 = 1.0 - b1 ** n, 1.0 - b2 ** n  # double, as torch (step read back from a float32 tensor)
    w = np.float32(1.0 - b1)
    hp = np.array([grad_scale if grad_scale is not None else 1.0, 1.0 - lr * opt.weight_decay, w, b2, 1.0 - b2,
                   math.sqrt(bc2), opt.eps, -(lr / bc1)], dtype=np.float32)
    hp.flags.writeable = False
    return hp, bool(abs(w) < 0.5), torch.tensor(n)


def step_shard(opt: OptimizerSpec, plan: ShardPlan, states: list[torch.Tensor], grad: torch.Tensor, step: int,
               grad_scale: torch.Tensor | None, served: torch.Tensor) -> None:
    """`kernels.step_shard` for AdamW with a bf16 or fp32 served copy, in one pass (same arguments)."""
    fn, args = split_step(opt, plan, states, grad, step, grad_scale, served)
    fn(*args)


def split_step(opt: OptimizerSpec, plan: ShardPlan, states: list[torch.Tensor], grad: torch.Tensor, step: int,
               grad_scale: torch.Tensor | None, served: torch.Tensor) -> tuple[Callable[..., None], tuple]:
    """`step_shard` in two parts: torch's scalar remainders are stepped now, and the compiled call
    that steps (and casts) the rest is returned as (function, numpy arguments), to be called as
    `fn(*args)`. The pipeline runs the first part on the thread that readies the shard, so the
    optimizer's thread makes one call per shard, which releases the GIL once (every torch call
    releases and re-takes it, and re-taking it waits for whichever pipeline thread holds it)."""
    rows, tails = _split(plan, vector_lanes())
    scale = None if grad_scale is None else float(grad_scale)
    hp, small, step_t = hyper(opt, step, scale)
    if tails[0] or tails[1]:  # torch's scalar remainder loop, run by torch (a few elements per tensor)
        for sel, wd in zip(tails, (opt.weight_decay, 0.0)):
            if sel:
                torch._fused_adamw_([states[0][a:b] for a, b in sel], [grad[a:b] for a, b in sel],
                                    [states[1][a:b] for a, b in sel], [states[2][a:b] for a, b in sel], [],
                                    [step_t] * len(sel), lr=opt.lr_at(step), beta1=opt.betas[0],
                                    beta2=opt.betas[1], weight_decay=wd, eps=opt.eps, amsgrad=False,
                                    maximize=False, grad_scale=grad_scale, found_inf=None)
    out = served.numpy() if served.dtype == torch.float32 else served.view(torch.int16).numpy().view(np.uint16)
    return _call([s.numpy() for s in states], grad.numpy(), out, rows, hp, scale, small)


def _call(states: list[np.ndarray], grad: np.ndarray, out: np.ndarray, rows: np.ndarray, hp: np.ndarray,
          scale: float | None, small: bool) -> tuple[Callable[..., None], tuple]:
    """The compiled call, (function, arguments), for the served copy `out` (uint16 bf16 bits or float32)."""
    to_bf16, to_fp32 = _compiled()
    return (to_fp32 if out.dtype == np.float32 else to_bf16), (states[0], states[1], states[2], grad, out, rows, hp,
                                                                scale is not None, small)


def lean_call(opt: OptimizerSpec, plan: ShardPlan, states: list[np.ndarray], grad: np.ndarray, step: int,
              scale: float | None, served: np.ndarray) -> tuple[Callable[..., None], tuple] | None:
    """`split_step`'s call from numpy arrays alone (the state, the shard's gradient slice, its slice of
    the served copy as uint16 bf16 bits or float32; `scale` as a float), for a shard with nothing
    for torch to step first (no scalar remainder): the same function and arguments, without the
    torch views, slices and conversions (most of a small layer's step on the engine's thread).
    None when `split_step` must run instead (another optimizer, a remainder, no compiled kernel)."""
    if opt.name != "adamw" or served.dtype not in (_U16, _F32) or not _usable_copy(served.dtype == _F32):
        return None
    rows, tails = _split(plan, vector_lanes())
    if tails[0] or tails[1]:
        return None
    hp, small, _ = hyper(opt, step, scale)
    return _call(states, grad, served, rows, hp, scale, small)


_U16, _F32 = np.dtype(np.uint16), np.dtype(np.float32)


def batch_entry(call: tuple[Callable[..., None], tuple]) -> tuple | None:
    """What `run_batch` needs of a call from `split_step` (computed ahead, off the optimizer's
    thread): (fp32 copy?, data addresses, elements, rows, constants, flags); None for a call
    that is not the compiled kernel's. The entry holds addresses, not arrays: keep `call` (which
    holds the arrays) until `run_batch` returns."""
    fn, args = call
    if _compiled.cache_info().currsize == 0:  # no compiled call was ever made: do not import numba here
        return None
    to_bf16, to_fp32 = _compiled()
    if fn is not to_bf16 and fn is not to_fp32:
        return None
    p, m, v, g, out, rows, hp, use_scale, small = args
    return (fn is to_fp32, tuple(a.ctypes.data for a in (p, m, v, g, out)), p.size, rows, hp,
            (bool(use_scale), bool(small)))


def run_batch(entries: list[tuple]) -> None:
    """Several shards' compiled calls (`batch_entry`s of one kind: all bf16 or all fp32 copies) in
    one call, which releases the GIL once for all of them: the same results, bit for bit, as
    each call on its own (the same compiled `shard` per entry). Each entry's call (holding its
    arrays) must stay alive until it returns."""
    many, many32 = _compiled_many()
    (many32 if entries[0][0] else many)(
        np.array([e[1] for e in entries], dtype=np.intp), np.array([e[2] for e in entries], dtype=np.intp),
        np.concatenate([e[3] for e in entries]), np.cumsum([0] + [len(e[3]) for e in entries]),
        np.stack([e[4] for e in entries]), np.array([e[5] for e in entries], dtype=np.uint8))


@functools.lru_cache(maxsize=1)
def _compiled_many():
    from . import fused_numba

    return fused_numba.many, fused_numba.many32


_warming = {"bf16": threading.Lock(), "fp32": threading.Lock()}
WARM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def warm_async(served_dtype: str) -> None:
    """Import numba and compile (or load from the cache) the kernel the node's pipeline runs for
    `served_dtype` ("bf16" or "fp32": `run_batch`'s) on a background thread, once per process and
    dtype, so that a node's first AdamW step does not wait for it (0.5-2 s). The node calls this
    when a job that will use the kernel is added. Only that one kernel: loading more would
    still be reading numba's cache files after the first step."""
    lock = _warming.get(served_dtype)
    if lock is not None and lock.acquire(blocking=False):  # never released: once per process
        threading.Thread(target=_warm, args=(WARM_DTYPES[served_dtype],), name="luwu-opt-kernel-warmup",
                         daemon=True).start()


def _warm(dtype: torch.dtype) -> None:
    opt = OptimizerSpec("adamw")
    layer = LayerSpec(0, {"w": (40,)})
    (shard,) = plan_layer(JobSpec("warmup", opt, [layer], "bf16"), layer, SHARD_ALIGN_ELEMS).shards
    served = torch.empty(40, dtype=dtype)
    try:
        if not usable(opt, served):
            return
    except UserError:  # a bad LUWU_KERNELS: the node's constructor or first step says so
        return
    call = split_step(opt, shard, [torch.zeros(40) for _ in range(3)], torch.zeros(40), 0, None, served)
    entry = batch_entry(call)  # `call` holds the arrays whose addresses the entry has
    if entry is not None:
        run_batch([entry])
