"""Mirrors: dataplane/switch/pipeline.py `Pipeline._aggregate` (one round of the slot state machine:
dataplane/switch/controls/slot_owner.py `apply`, dataplane/switch/controls/worker_bitmap.py `apply`,
dataplane/switch/controls/contributor_counter.py `apply`, dataplane/switch/controls/exponent_max.py
`apply`, dataplane/switch/controls/aggregation_lanes.py `apply`), for all the contributions to a
slot in one batch at once: the aggregation fast path (every aggregation dtype: FIXED16's lanes
are int32 lanes too, docs/protocol.md 5.2).

Declines: a group that does not qualify (below) is left untouched and marked not fast, and
`Pipeline._aggregation` runs it through `Pipeline._aggregate` in rounds; `fold` returns None,
having changed nothing, when no group qualifies.

In an allreduce every slot of a batch is usually hit by several workers' packets. Run as
rounds, that costs one pass of the register controls per contribution. A group may also be one
packet: on shared-memory ports most turns hold one endpoint's packets alone, and the rounds' fixed
cost (some twenty numpy calls of the register controls per turn) is then what the one-pass
kernel saves. This module handles,
in one pass, every slot whose group of packets provably behaves like the plain case of the
slot state machine, and leaves the other groups to the rounds. A group qualifies when its
packets share set, epoch and operation (add or MAX), carry distinct worker bits, none of which
is already in the set's bitmap (so no packet is a duplicate), and the countdown cannot pass
zero before the group's last packet. Then, processed one at a time, packet j of the group
(j = 0..m-1) sees `before = before_0 | bits of packets 0..j-1`, is first only for j = 0 with
an empty bitmap, and leaves `remaining_0 - j`; only the last packet can complete the phase,
and it emits the sum (or max) of the stored lanes and every packet's lanes. This is exactly
what sequential processing produces (the property tests check it against the reference).
"""

from __future__ import annotations

import numpy as np

from ...kernels import use_numba


class GroupPlan:
    """Which aggregation packets (positions in the batch's aggregation list) form qualifying groups."""

    __slots__ = ("fast", "order", "pos", "sizes", "starts")

    def __init__(self, fast: np.ndarray, order: np.ndarray, starts: np.ndarray, sizes: np.ndarray, pos: np.ndarray):
        self.fast = fast  # bool per aggregation packet: handled here
        self.order = order  # aggregation packets of qualifying groups, grouped by slot, arrival order inside
        self.starts = starts  # start of each group in `order`
        self.sizes = sizes
        self.pos = pos  # position j of each packet of `order` inside its group


def fold(slot: np.ndarray, a, regs, payload: np.ndarray, agg, write_out: bool = True,
         flat: tuple[np.ndarray, int] | None = None) -> np.ndarray | None:
    """Run every qualifying group of the aggregation inputs `a` (pipeline._AggInputs; `slot` per
    packet) through the slot state machine and the lane fold, writing their outcome into `agg`.

    Args:
        write_out: False leaves a completed phase's sum in its lane register only, not written
            into the completing packet's row (its handled packet with `agg.remaining` 0): the
            caller writes it once where the packet leaves from (shared-memory turns write it
            straight into a multicast pool row: Batch.results). No other packet of the batch
            touches that register (a group holds every packet of its slot), so it still holds
            the sum when the batch is emitted.
        flat: `lane_rows` of `payload`, when the caller keeps it (a shared-memory turn's arena
            is the same array turn after turn); used only when kernels are on.

    Returns:
        The mask of the packets handled (the caller runs the others in rounds), or None when no
        group qualified (nothing was changed).

    Compiled when kernels are on (dataplane/kernels/switch_lanes.py `phase_groups`: one pass per
    group, same registers, outcome and bits); `plan` + `apply` are its numpy reference.
    """
    if use_numba():
        from ...kernels.switch_lanes import lane_rows, phase_groups

        flat = flat or lane_rows(payload.view(np.uint32))
    else:
        flat = None
    if flat is None:  # the numpy reference (kernels off, or rows the kernel cannot stride over)
        p = plan(slot, a, regs)
        if p is None:
            return None
        apply(p, a, regs, payload, agg, write_out)
        return p.fast
    n = len(slot)
    fast, last = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    remaining, exponent, saturated = np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.int8), np.zeros(n, dtype=bool)
    handled = phase_groups(np.argsort(slot, kind="stable"), slot, a.s, a.other, a.epoch, a.is_max, a.bit, a.nw,
                           a.exponent, a.saturated, a.rows, regs.slot_owner, regs.bitmap, regs.contributors,
                           regs.exponents, regs.slot_flags, regs.lanes.view(np.uint32), flat[0], flat[1], fast, remaining,
                           exponent, saturated, last, write_out)
    if not handled:
        return None
    out = a.ai[fast]
    agg.dup[out] = False
    agg.remaining[out] = remaining[fast]
    tails = a.ai[last]
    agg.exponent[tails] = exponent[last]
    agg.saturated[tails] = saturated[last]
    return fast


def plan(slot: np.ndarray, a, regs) -> GroupPlan | None:
    """Find the qualifying groups among the aggregation inputs `a` (see pipeline._AggInputs)."""
    order = np.argsort(slot, kind="stable")
    ss = slot[order]
    n = len(ss)
    start = np.ones(n, dtype=bool)
    start[1:] = ss[1:] != ss[:-1]
    starts = np.flatnonzero(start)
    sizes = np.diff(np.append(starts, n))
    gid = np.cumsum(start) - 1
    head = order[starts][gid]  # the group's first packet, for every packet
    same = ((a.s[order] == a.s[head]) & (a.epoch[order] == a.epoch[head]) & (a.is_max[order] == a.is_max[head]))
    bits = a.bit[order]
    ok = np.logical_and.reduceat(same, starts)
    ok &= np.bitwise_or.reduceat(bits, starts).astype(np.int64) == np.add.reduceat(bits.astype(np.int64), starts)
    g_s = a.s[order[starts]]
    fresh = regs.slot_owner[g_s] != a.epoch[order[starts]]
    before = np.where(fresh, np.uint32(0), regs.bitmap[g_s])
    group_bits = np.bitwise_or.reduceat(bits, starts)
    ok &= (before & group_bits) == 0
    first = before == 0
    rem0 = np.where(first, a.nw[order[starts]].astype(np.int64) - 1, regs.contributors[g_s].astype(np.int64) - 1)
    ok &= rem0 >= sizes - 1
    if not ok.any():
        return None
    keep = ok[gid]  # whole groups are kept or left to the rounds
    fast = np.zeros(n, dtype=bool)
    fast[order[keep]] = True
    pos = (np.arange(n) - starts[gid])[keep]
    return GroupPlan(fast, order[keep], np.flatnonzero(start[keep]), sizes[ok], pos)


def _rows(r: np.ndarray):
    """Row indices as a slice when consecutive (a view instead of a gather copy)."""
    n = len(r)
    if n and int(r[-1]) - int(r[0]) == n - 1 and (n < 3 or bool((r[1:] - r[:-1] == 1).all())):
        return slice(int(r[0]), int(r[0]) + n)
    return r


def _combine(total: np.ndarray, x: np.ndarray, rows: np.ndarray | slice, is_max: np.ndarray, any_max: bool,
             all_max: bool) -> None:
    """total[rows] = total[rows] (+ or max, per group) x; x has one row per selected group."""
    if not any_max:
        total[rows] = total[rows] + x
    elif all_max:
        total[rows] = np.maximum(total[rows], x)
    else:
        t = total[rows]
        m = is_max[rows]
        t[m] = np.maximum(t[m], x[m])
        t[~m] = t[~m] + x[~m]
        total[rows] = t


def apply(p: GroupPlan, a, regs, payload: np.ndarray, agg, write_out: bool = True) -> None:
    """Run the qualifying groups through the slot state machine in one pass (`write_out`: as `fold`'s)."""
    o, st = p.order, p.starts
    heads = o[st]
    last = o[st + p.sizes - 1]
    g_s, g_other, g_epoch = a.s[heads], a.other[heads], a.epoch[heads]
    fresh = regs.slot_owner[g_s] != g_epoch
    before = np.where(fresh, np.uint32(0), regs.bitmap[g_s])
    first = before == 0
    group_bits = np.bitwise_or.reduceat(a.bit[o], st)
    # slot_owner, worker_bitmap
    regs.slot_owner[g_s] = g_epoch
    regs.bitmap[g_s] = before | group_bits
    regs.bitmap[g_other] &= ~group_bits
    # contributor_counter
    rem0 = np.where(first, a.nw[heads] - np.uint32(1), regs.contributors[g_s] - np.uint32(1)).astype(np.uint32)
    remaining = rem0[np.repeat(np.arange(len(st)), p.sizes)] - p.pos.astype(np.uint32)
    regs.contributors[g_s] = remaining[st + p.sizes - 1]
    # exponent_max (int8) and SATURATED
    e = np.maximum.reduceat(a.exponent[o], st)
    e = np.where(first, e, np.maximum(e, regs.exponents[g_s])).astype(np.int8)
    sat = np.logical_or.reduceat(a.saturated[o], st)
    sat = np.where(first, sat, sat | (regs.slot_flags[g_s] != 0))
    regs.exponents[g_s] = e
    regs.slot_flags[g_s] = sat
    done = remaining[st + p.sizes - 1] == 0
    _fold(p, a, regs, payload, g_s, first, heads, done & write_out)
    # outcome per packet, for the next step selector (exponent/flags matter only where emitted)
    agg.dup[a.ai[o]] = False
    agg.remaining[a.ai[o]] = remaining
    agg.exponent[a.ai[last]] = e
    agg.saturated[a.ai[last]] = sat


def _fold(p: GroupPlan, a, regs, payload: np.ndarray, g_s: np.ndarray, first: np.ndarray, heads: np.ndarray,
          done: np.ndarray) -> None:
    """The readable lane arithmetic of `apply` (with `plan`, the reference of the compiled
    `phase_groups` kernel)."""
    st = p.starts
    last = p.order[st + p.sizes - 1]
    o = p.order
    # aggregation_lanes: fold the group position by position (one vectorised op per position;
    # gathers of whole rows are fast, reductions across rows are not)
    rows_o = a.rows[o]
    is_max = a.is_max[heads]
    any_max, all_max = bool(is_max.any()), bool(is_max.all())
    gs = _rows(g_s)
    in_place = isinstance(gs, slice)  # consecutive slots: accumulate in the registers themselves
    total = regs.lanes[gs] if in_place else np.empty((len(st), payload.shape[1]), dtype=np.int32)
    x0 = payload[_rows(rows_o[st])]
    stored = ~first
    if not stored.any():
        total[:] = x0
    else:
        if not in_place:
            total[stored] = regs.lanes[g_s[stored]]
        if first.any():
            total[first] = x0[first]
        _combine(total, x0[stored], stored, is_max, any_max, all_max)
    uniform = bool((p.sizes == p.sizes[0]).all())
    for j in range(1, int(p.sizes.max())):
        gsel = slice(None) if uniform else p.sizes > j
        x = payload[_rows(rows_o[st[gsel] + j])]
        if uniform and not any_max:
            np.add(total, x, out=total)
        else:
            _combine(total, x, np.ones(len(st), dtype=bool) if uniform else gsel, is_max, any_max, all_max)
    if not in_place:
        regs.lanes[g_s] = total
    if done.any():
        if done.all():
            payload[_rows(a.rows[last])] = total
        else:
            payload[a.rows[last[done]]] = total[done]
