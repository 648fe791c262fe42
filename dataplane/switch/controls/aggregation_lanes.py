"""aggregation_lanes: the sums, one int32 register per lane (generated per lane in P4; one
[2 * slots, lanes] array here). The first contributor overwrites, later ones add (wrapping
int32) or take the signed maximum (MAX flag), duplicates leave the sums alone.

A packet whose phase is complete (completion or a resend) gets the stored lanes written into
its own payload, big-endian: that row is what the sender emits. `s` and `rows` may be slices
(consecutive slots and rows, the common case), which avoids gather/scatter copies.
"""

from __future__ import annotations

import numpy as np

from ...kernels import use_numba


def apply(lanes: np.ndarray, payload: np.ndarray, rows, s, first: np.ndarray, dup: np.ndarray,
          is_max: np.ndarray, emit: np.ndarray, all_first: bool, plain: bool) -> None:
    """Update the lane registers of slots `s` from payload rows `rows`, then write the stored
    lanes into the payload of the rows that `emit`. Slots in `s` are unique. Compiled when
    kernels are on (`../../kernels/switch_lanes.py` `apply_rows`: one pass, same bits)."""
    flat = None
    if use_numba():
        from ...kernels.switch_lanes import apply_rows, lane_rows

        flat = lane_rows(payload.view(np.uint32))  # None: rows the kernel cannot stride over
    if flat is not None:
        n = len(first)
        s_i = np.arange(s.start, s.start + n) if isinstance(s, slice) else np.asarray(s, dtype=np.int64)
        r_i = np.arange(rows.start, rows.start + n) if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)
        apply_rows(lanes.view(np.uint32), flat[0], flat[1], s_i, r_i, np.asarray(first, dtype=np.bool_),
                   np.asarray(dup, dtype=np.bool_), np.asarray(is_max, dtype=np.bool_), np.asarray(emit, dtype=np.bool_))
        return
    _reference(lanes, payload, rows, s, first, dup, is_max, emit, all_first, plain)


def _reference(lanes: np.ndarray, payload: np.ndarray, rows, s, first: np.ndarray, dup: np.ndarray,
               is_max: np.ndarray, emit: np.ndarray, all_first: bool, plain: bool) -> None:
    """The readable numpy version of `apply` (the compiled kernel's reference)."""
    if all_first:
        lanes[s] = payload[rows]
    elif plain and not is_max.any():
        if isinstance(s, slice) and isinstance(rows, slice):
            lanes[s] += payload[rows]
        else:
            lanes[s] = lanes[s] + payload[rows]
    else:
        s_i = np.arange(s.start, s.stop) if isinstance(s, slice) else s
        r_i = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
        if first.any():
            lanes[s_i[first]] = payload[r_i[first]]
        add = ~first & ~dup & ~is_max
        if add.any():
            sa = s_i[add]
            lanes[sa] = lanes[sa] + payload[r_i[add]]
        mx = ~first & ~dup & is_max
        if mx.any():
            sm = s_i[mx]
            lanes[sm] = np.maximum(lanes[sm], payload[r_i[mx]])
    if emit.all():
        payload[rows] = lanes[s]
    elif emit.any():
        s_i = np.arange(s.start, s.stop) if isinstance(s, slice) else s
        r_i = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
        payload[r_i[emit]] = lanes[s_i[emit]]
