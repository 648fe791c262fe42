"""aggregation_lanes: the sums, one int32 register per lane (generated per lane in P4; one
[2 * slots, lanes] array here). The first contributor overwrites, later ones add (wrapping
int32) or take the signed maximum (MAX flag), duplicates leave the sums alone.

A packet whose phase is complete (completion or a resend) gets the stored lanes written into
its own payload, big-endian: that row is what the sender emits. `s` and `rows` may be slices
(consecutive slots and rows, the common case), which avoids gather/scatter copies.
"""

from __future__ import annotations

import numpy as np


def apply(lanes: np.ndarray, payload: np.ndarray, rows, s, first: np.ndarray, dup: np.ndarray,
          is_max: np.ndarray, emit: np.ndarray, all_first: bool, plain: bool) -> None:
    """Update the lane registers of slots `s` from payload rows `rows`, then write the stored
    lanes into the payload of the rows that `emit`. Slots in `s` are unique."""
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
