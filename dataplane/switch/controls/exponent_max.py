"""exponent_max: the shared exponent (maximum over contributors, int8) and the OR of the
contributors' SATURATED flags, per (set, slot) (registers `exponents` and `slot_flags`)."""

from __future__ import annotations

import numpy as np


def apply(exponents: np.ndarray, slot_flags: np.ndarray, s, first: np.ndarray, dup: np.ndarray,
          exponent: np.ndarray, saturated: np.ndarray, all_first: bool, plain: bool) -> tuple[np.ndarray, np.ndarray]:
    """Returns (exponent, saturated) of the phase after this packet."""
    if all_first:
        e, sat = exponent, saturated
    elif plain:
        e = np.maximum(exponents[s], exponent)
        sat = (slot_flags[s] != 0) | saturated
    else:
        e_stored = exponents[s]
        e = np.where(first, exponent, np.where(dup, e_stored, np.maximum(e_stored, exponent))).astype(np.int8)
        f_stored = slot_flags[s] != 0
        sat = np.where(first, saturated, np.where(dup, f_stored, f_stored | saturated))
    exponents[s] = e
    slot_flags[s] = sat
    return e, sat
