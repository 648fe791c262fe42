"""numba kernels for the software switch's lane arithmetic: the compiled twins of the aggregation
fast path (dataplane/switch/phase_groups.py `apply`, `fold_groups`) and of one round of
dataplane/switch/controls/aggregation_lanes.py (`apply_rows`).

numpy folds a batch's groups position by position, and every step converts the packets'
big-endian lanes into a temporary, adds and stores; this kernel does each group in one pass:
read each packet's lanes once (byte-swapped in registers), accumulate into the slot's lane
register, and, when the phase completes, write the sum big-endian into the completing packet's
row. Arithmetic is on uint32 words (wrapping adds are the same bits as int32's) and signed
maximum for MAX groups, so the result is the numpy path's bit for bit
(tests/switch/test_switch_vectorised_equivalence.py runs the pipeline both ways against a
plain-Python model). Imported only when kernels are on (dataplane/kernels).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .fixed_point import _bswap32


@njit(cache=True, nogil=True)
def _combine_row(acc, src, is_max, assign):
    """acc = src (assign), acc + src (wrapping) or signed max(acc, src), src big-endian words."""
    if assign:
        for j in range(acc.size):
            acc[j] = _bswap32(src[j])
    elif is_max:
        for j in range(acc.size):
            v = np.int32(_bswap32(src[j]))
            a = np.int32(acc[j])
            acc[j] = np.uint32(v if v > a else a)
    else:
        for j in range(acc.size):
            acc[j] = np.uint32(acc[j] + _bswap32(src[j]))


@njit(cache=True, nogil=True)
def fold_groups(regs, payload, slots, first, is_max, done, starts, sizes, rows):
    """For every group g (its packets at rows[starts[g]:starts[g] + sizes[g]], arrival order):
    regs[slots[g]] = (first[g] ? p0 : regs[slots[g]] op p0) op p1 ... op p_last, op being + or
    signed max (is_max[g]); and where done[g], the completing (last) packet's payload row gets
    the result big-endian. `regs` is the lane registers as uint32 [slots, lanes], `payload` the
    batch's big-endian lane words as uint32 [rows, lanes] (a strided view of the packet rows)."""
    for g in range(slots.size):
        acc = regs[slots[g]]
        s0 = starts[g]
        mx = is_max[g]
        _combine_row(acc, payload[rows[s0]], mx, first[g])
        for p in range(s0 + 1, s0 + sizes[g]):
            _combine_row(acc, payload[rows[p]], mx, False)
        if done[g]:
            out = payload[rows[s0 + sizes[g] - 1]]
            for j in range(acc.size):
                out[j] = _bswap32(acc[j])


@njit(cache=True, nogil=True)
def apply_rows(regs, payload, slots, rows, first, dup, is_max, emit):
    """One round of aggregation_lanes (dataplane/switch/controls/aggregation_lanes.py) with unique
    slots: packet i's lanes overwrite (first[i]), add to or take the signed max with (is_max[i])
    its slot's register unless it is a duplicate; then rows that `emit` get the stored lanes
    big-endian. Same uint32 views as `fold_groups`."""
    for i in range(slots.size):
        acc = regs[slots[i]]
        src = payload[rows[i]]
        if first[i] or not dup[i]:
            _combine_row(acc, src, is_max[i], first[i])
        if emit[i]:
            for j in range(acc.size):
                src[j] = _bswap32(acc[j])


def warm_up() -> None:
    """Compile (or load from numba's cache) both kernels on tiny inputs, so that the switch's
    first aggregation batch does not wait for it while the endpoints' timers run."""
    regs = np.zeros((2, 4), dtype=np.uint32)
    payload = np.zeros((2, 4), dtype=np.uint32)
    one = np.ones(1, dtype=np.int64)
    yes, no = np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.bool_)
    fold_groups(regs, payload, one, yes, no, yes, np.zeros(1, np.int64), one, one)
    apply_rows(regs, payload, one, one, yes, no, no, yes)
