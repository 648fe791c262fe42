"""contributor_counter: countdown of contributors still missing in a (set, slot).

The first contributor sets it to num_workers - 1, each new one decrements it, a duplicate
leaves it; zero means complete. A 32-bit register: it wraps like the P4 register would if a
misconfigured session ever let it go below zero."""

from __future__ import annotations

import numpy as np


def apply(contributors: np.ndarray, s, first: np.ndarray, dup: np.ndarray, num_workers: np.ndarray,
          all_first: bool, plain: bool) -> np.ndarray:
    """`all_first`: every packet is its phase's first; `plain`: none is first or duplicate."""
    if all_first:
        remaining = num_workers - np.uint32(1)
    else:
        stored = contributors[s]
        if plain:
            remaining = stored - np.uint32(1)
        else:
            remaining = np.where(first, num_workers - np.uint32(1),
                                 np.where(dup, stored, stored - np.uint32(1))).astype(np.uint32)
    contributors[s] = remaining
    return remaining
