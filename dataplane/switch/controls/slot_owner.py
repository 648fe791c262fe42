"""slot_owner: the epoch of the session that last used a (set, slot). A different epoch makes
the packet the phase's first contributor, so a new session on reused slots never adds to stale
sums and no controller ever has to clear a register.

The first step of the slot state machine, twin of p4/include/slot_owner.p4. The machine itself
(owner epoch, then worker_bitmap.py, contributor_counter.py, exponent_max.py, aggregation_lanes.py,
whose outcome next_step_selector.py routes) runs in ../pipeline.py `Pipeline._aggregate`, one
round at a time; ../fast/aggregate_groups.py and ../fast/aggregate_one.py are its fast paths."""

from __future__ import annotations

import numpy as np


def apply(slot_owner: np.ndarray, s, epoch: np.ndarray) -> np.ndarray:
    """fresh = slot_owner[s] != epoch ; slot_owner[s] = epoch (indices unique within a round;
    `s` may be a slice when the round's slots are consecutive)."""
    fresh = slot_owner[s] != epoch
    slot_owner[s] = epoch
    return fresh
