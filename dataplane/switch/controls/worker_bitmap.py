"""worker_bitmap: who has contributed to each set of a slot (SwitchML's two-set bitmap).

A packet ORs its bit into its set and clears it from the other set, so the set it leaves is
ready for the phase `pool_size` sequence numbers later without any reset. The two bitmaps are
one array here, `bitmap[set * slots + slot]`; both are indexed by slot in P4, so within a round
a slot (either set) appears at most once."""

from __future__ import annotations

import numpy as np


def apply(bitmap: np.ndarray, s, other, bit: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """Returns `before` (the set's contributors before this packet, 0 when fresh)."""
    before = bitmap[s].copy() if isinstance(s, slice) else bitmap[s]  # a slice would be a view
    if fresh.any():
        before = np.where(fresh, np.uint32(0), before)
    bitmap[s] = before | bit
    bitmap[other] &= ~bit
    return before
