"""The numba code of `fused` (imported only when compiled kernels run: importing numba and
loading the kernel from numba's cache takes a moment, so `fused` does it on first use).

`shard` steps a shard's runs with AdamW and writes the bf16 copy in the same loop (`shard32`: an
fp32 copy); `fused`'s docstring gives the arithmetic and why it equals torch's bit for bit.
`cache=True`: compiled once per machine into `__pycache__`, loaded from there afterwards.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

BF16_NAN = np.uint16(0xFFFF)  # = fused.BF16_NAN (what torch's vectorized cast makes of any NaN)


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c with one rounding: LLVM's fma, one vfmadd with FMA (as torch's vec::fmadd and its
    compiler's contraction of a*b + c)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def bits32(typingctx, a):
    """The IEEE bits of a float32, as a uint32 (a register bitcast)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(inline="always")
def adamw(gi, pi, mi, vi, scale, use_scale, wdmul, use_wd, w, small, b2, c2, bc2s, eps, nstep):
    """One element's AdamW step, as torch's vectorized kernel computes it: (g, p, m, v) after
    it. Inlined into `run` and `run32` (one source for the arithmetic both serve)."""
    one = np.float32(1.0)
    if use_scale:
        gi = gi / scale
    if use_wd:
        pi = pi * wdmul
    if small:
        mi = fma32(w, gi - mi, mi)
    else:
        mi = fma32(w - one, gi - mi, gi)
    vi = fma32(c2 * gi, gi, vi * b2)
    pi = pi + nstep * mi / (np.sqrt(vi) / bc2s + eps)
    return gi, pi, mi, vi


@njit(inline="always")
def bf16(pi):
    """pi rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as torch's cast does."""
    u = bits32(pi)
    r = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return BF16_NAN if np.isnan(pi) else r  # a select, not a branch: the loop stays vectorized


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def run(p, m, v, g, out, lo, hi, scale, use_scale, wdmul, use_wd, w, small, b2, c2, bc2s, eps, nstep):
    # sliced so that the loop index starts at 0: numba then drops negative-index wraparound,
    # which otherwise keeps LLVM from vectorizing the loop
    p, m, v, g, out = p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], out[lo:hi]
    for i in range(p.size):
        gi, pi, mi, vi = adamw(g[i], p[i], m[i], v[i], scale, use_scale, wdmul, use_wd, w, small, b2, c2, bc2s,
                               eps, nstep)
        if use_scale:
            g[i] = gi
        m[i] = mi
        v[i] = vi
        p[i] = pi
        out[i] = bf16(pi)


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def run32(p, m, v, g, out, lo, hi, scale, use_scale, wdmul, use_wd, w, small, b2, c2, bc2s, eps, nstep):
    """`run` serving fp32: the new master written to the served copy in the same loop."""
    p, m, v, g, out = p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], out[lo:hi]
    for i in range(p.size):
        gi, pi, mi, vi = adamw(g[i], p[i], m[i], v[i], scale, use_scale, wdmul, use_wd, w, small, b2, c2, bc2s,
                               eps, nstep)
        if use_scale:
            g[i] = gi
        m[i] = mi
        v[i] = vi
        p[i] = pi
        out[i] = pi


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def cast(p, out, lo, hi):
    p, out = p[lo:hi], out[lo:hi]
    for i in range(p.size):
        out[i] = bf16(p[i])


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def shard(p, m, v, g, out, rows, hp, use_scale, small):
    """`rows`: (lo, hi, decay, kind) element ranges, kind 0 to step and cast, 1 to cast only;
    `hp`: float32 (grad scale, weight decay multiplier, w = 1 - beta1, beta2, 1 - beta2,
    sqrt(bc2), eps, -step size); `small`: |w| < 0.5 (which form of torch's lerp)."""
    for r in range(rows.shape[0]):
        if rows[r, 3] == 0:
            run(p, m, v, g, out, rows[r, 0], rows[r, 1], hp[0], use_scale, hp[1], rows[r, 2] != 0,
                hp[2], small, hp[3], hp[4], hp[5], hp[6], hp[7])
        else:
            cast(p, out, rows[r, 0], rows[r, 1])


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def copy32(p, out, lo, hi):
    p, out = p[lo:hi], out[lo:hi]
    for i in range(p.size):
        out[i] = p[i]


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def shard32(p, m, v, g, out, rows, hp, use_scale, small):
    """`shard` with an fp32 served copy (`out` float32): kind 0 steps and copies, 1 copies."""
    for r in range(rows.shape[0]):
        if rows[r, 3] == 0:
            run32(p, m, v, g, out, rows[r, 0], rows[r, 1], hp[0], use_scale, hp[1], rows[r, 2] != 0,
                  hp[2], small, hp[3], hp[4], hp[5], hp[6], hp[7])
        else:
            copy32(p, out, rows[r, 0], rows[r, 1])


@intrinsic
def f32_at(typingctx, addr):
    """The float32 pointer at integer address `addr` (an array's data, held alive by the caller)."""
    sig = types.CPointer(types.float32)(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return sig, codegen


@intrinsic
def u16_at(typingctx, addr):
    """The uint16 pointer at integer address `addr`."""
    sig = types.CPointer(types.uint16)(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(16)))

    return sig, codegen


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def many(addr, numel, rows, bounds, hps, flags):
    """`shard` for several shards in one call (one GIL release for all): shard t's arrays start at
    addr[t] (master, exp_avg, exp_avg_sq, gradient, bf16 copy) and hold numel[t] elements, its rows
    are rows[bounds[t]:bounds[t + 1]], its constants hps[t], flags[t] = (use_scale, small)."""
    for t in range(addr.shape[0]):
        n = numel[t]
        shard(carray(f32_at(addr[t, 0]), n), carray(f32_at(addr[t, 1]), n), carray(f32_at(addr[t, 2]), n),
              carray(f32_at(addr[t, 3]), n), carray(u16_at(addr[t, 4]), n), rows[bounds[t]:bounds[t + 1]], hps[t],
              flags[t, 0] != 0, flags[t, 1] != 0)


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def many32(addr, numel, rows, bounds, hps, flags):
    """`many` with fp32 served copies (`shard32`)."""
    for t in range(addr.shape[0]):
        n = numel[t]
        shard32(carray(f32_at(addr[t, 0]), n), carray(f32_at(addr[t, 1]), n), carray(f32_at(addr[t, 2]), n),
                carray(f32_at(addr[t, 3]), n), carray(f32_at(addr[t, 4]), n), rows[bounds[t]:bounds[t + 1]],
                hps[t], flags[t, 0] != 0, flags[t, 1] != 0)
