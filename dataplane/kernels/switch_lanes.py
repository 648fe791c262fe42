"""numba kernels for the software switch's aggregation: the compiled twins of the aggregation
fast path (dataplane/switch/phase_groups.py `plan` + `apply`: `phase_groups`) and of one round of
dataplane/switch/controls/aggregation_lanes.py (`apply_rows`).

numpy finds the qualifying groups of a batch and runs their slot state machine in some fifty
small array calls per batch (a fixed cost of a few hundred microseconds per event-loop turn),
then folds the groups position by position, every step converting the packets' big-endian
lanes into a temporary; `phase_groups` does both in one pass per group: qualify it, update the
slot registers, read each packet's lanes once (byte-swapped in registers), accumulate into the
slot's lane register, and, when the phase completes, write the sum big-endian into the
completing packet's row. Arithmetic is on uint32 words (wrapping adds are the same bits as
int32's) and signed maximum for MAX groups, so the result is the numpy path's bit for bit
(tests/switch/test_switch_vectorised_equivalence.py runs the pipeline both ways against a
plain-Python model; tests/switch/test_switch_phase_groups_kernel.py compares the kernel with
`plan` + `apply` on random register states). Imported only when kernels are on (dataplane/kernels).
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
def phase_groups(order, slot, s, other, epoch, is_max, bit, nw, exponent, saturated, rows,
                 slot_owner, bitmap, contributors, exponents, slot_flags, regs, payload,
                 fast, remaining, out_exponent, out_saturated, last):
    """The aggregation fast path over one batch's aggregation packets (arrays indexed by their
    position; `order` sorts them by `slot`, arrival order inside a slot): every group of the
    packets on one slot (one or more) that qualifies (phase_groups.py: same register index, epoch and
    operation; distinct worker bits, none already in the bitmap; the countdown reaching zero at
    the last packet at the earliest) runs through the slot state machine and the lane fold, and
    its packets get fast = True, their `remaining`, and the last one its exponent and
    SATURATED (out_*, with last = True). Other groups are untouched (the caller runs them in
    rounds). Registers as in dataplane/switch/registers.py, lanes as the uint32 views of
    `apply_rows`. Returns how many packets it handled."""
    n = order.size
    handled = 0
    i = 0
    while i < n:
        h = order[i]
        j = i + 1
        while j < n and slot[order[j]] == slot[h]:
            j += 1
        m = j - i
        lo, i = i, j
        g = s[h]
        gbits = np.uint32(0)
        bsum = np.int64(0)
        ok = True
        for q in range(lo, lo + m):
            p = order[q]
            if s[p] != g or epoch[p] != epoch[h] or is_max[p] != is_max[h]:
                ok = False
                break
            gbits |= bit[p]
            bsum += np.int64(bit[p])
        if not ok or np.int64(gbits) != bsum:
            continue
        before = np.uint32(0) if slot_owner[g] != epoch[h] else bitmap[g]
        if (before & gbits) != 0:
            continue
        first = before == 0
        rem0 = np.int64(nw[h]) - 1 if first else np.int64(contributors[g]) - 1
        if rem0 < m - 1:
            continue
        # slot_owner, worker_bitmap, contributor_counter
        slot_owner[g] = epoch[h]
        bitmap[g] = before | gbits
        bitmap[other[h]] &= ~gbits
        e = exponent[h]
        sat = False
        for q in range(lo, lo + m):
            p = order[q]
            fast[p] = True
            remaining[p] = np.uint32(rem0 - (q - lo))
            if exponent[p] > e:
                e = exponent[p]
            sat = sat or saturated[p]
        rest = rem0 - (m - 1)
        contributors[g] = np.uint32(rest)
        # exponent_max and SATURATED
        if not first:
            if exponents[g] > e:
                e = exponents[g]
            sat = sat or slot_flags[g] != 0
        exponents[g] = e
        slot_flags[g] = 1 if sat else 0
        tail = order[lo + m - 1]
        out_exponent[tail] = e
        out_saturated[tail] = sat
        last[tail] = True
        # aggregation_lanes: the group's lanes folded in arrival order
        acc = regs[g]
        mx = is_max[h]
        _combine_row(acc, payload[rows[h]], mx, first)
        for q in range(lo + 1, lo + m):
            _combine_row(acc, payload[rows[order[q]]], mx, False)
        if rest == 0:
            out = payload[rows[tail]]
            for k in range(acc.size):
                out[k] = _bswap32(acc[k])
        handled += m
    return handled


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
    """Compile (or load from numba's cache) both kernels on tiny inputs of the pipeline's dtypes,
    so that the switch's first aggregation batch does not wait for it while the endpoints'
    timers run."""
    regs = np.zeros((2, 4), dtype=np.uint32)
    payload = np.zeros((2, 48), dtype=np.uint8)[:, 32:48].view(np.uint32)  # strided rows, as a batch's
    one = np.ones(1, dtype=np.int64)
    yes, no = np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.bool_)
    apply_rows(regs, payload, one, one, yes, no, no, yes)
    two = np.zeros(2, dtype=np.int64)
    u32, b2 = np.zeros(2, dtype=np.uint32), np.zeros(2, dtype=np.bool_)
    phase_groups(np.arange(2), two, two, two, u32, b2, np.array([1, 2], np.uint32), u32 + 2, np.zeros(2, np.int8), b2,
                 np.arange(2), np.zeros(2, np.uint32), np.zeros(2, np.uint32), np.zeros(2, np.uint32),
                 np.zeros(2, np.int8), np.zeros(2, np.uint8), regs, payload, b2.copy(), u32.copy(),
                 np.zeros(2, np.int8), b2.copy(), b2.copy())
