"""drop_simulator: the P4 `ingress_drop_sim` / `egress_drop_sim` tables (drop when a 32-bit
uniform random number < the port's threshold; SIMULATED_LOSS).

Random numbers come from seeded streams (SwitchConfig.seed), one draw per packet that hits a
table entry, in packet order: a run is reproducible and does not depend on how packets were
batched.
"""

from __future__ import annotations

import numpy as np

RANDOM_BITS = 32
RAW_BITS = 64


class Random32:
    """A reproducible stream of 32-bit uniform numbers (PCG64, upper half of each output)."""

    def __init__(self, seed_sequence: np.random.SeedSequence):
        self._gen = np.random.PCG64(seed_sequence)

    def draw(self, n: int) -> np.ndarray:
        return (self._gen.random_raw(n) >> np.uint64(RAW_BITS - RANDOM_BITS)).astype(np.int64)

    def uniform(self, n: int) -> np.ndarray:
        """Floats in [0, 1) from the same stream (software-only impairments)."""
        return self.draw(n) / float(1 << RANDOM_BITS)


def simulate(ports: np.ndarray, candidates: np.ndarray, thresholds: np.ndarray, rng: Random32) -> np.ndarray:
    """Which of the candidate packets (bool mask over `ports`) the table drops."""
    dropped = np.zeros(len(ports), dtype=bool)
    thr = thresholds[ports]
    hit = candidates & (thr >= 0)
    n = int(hit.sum())
    if n:
        dropped[hit] = rng.draw(n) < thr[hit]
    return dropped


def threshold_for(probability: float) -> int:
    """The 32-bit threshold of a loss probability (1.0 maps to the largest threshold, 2^32 - 1)."""
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"drop probability {probability} must be in [0, 1]")
    return min(round(probability * (1 << RANDOM_BITS)), (1 << RANDOM_BITS) - 1)
