"""A pool of staging buffers, each the size of the largest unit: pulls land in one, pushes are
read from one until they complete. Buffers are made on demand and reused, so the pool grows to
the number of pulls and pushes in flight at once (prefetch depth + pushes in flight), and its
bytes count as the worker's resident memory."""

from __future__ import annotations

import torch

from luwu.worker.engine_link import EngineLink, Staging

from .memory import MemoryTracker


class StagingPool:
    def __init__(self, engine: EngineLink, capacity: int, memory: MemoryTracker):
        self.engine = engine
        self.capacity = capacity
        self.memory = memory
        self._free: list[Staging] = []
        self.created = 0
        self.in_use = 0

    def acquire(self) -> Staging:
        if self._free:
            st = self._free.pop()
        else:
            st = self.engine.staging(self.capacity)
            st.tensor = torch.from_numpy(st.array)  # once: gradients are copied in through it every step
            self.created += 1
            self.memory.add("staging", 4 * self.capacity)
        self.in_use += 1
        return st

    def release(self, st: Staging) -> None:
        self.in_use -= 1
        self._free.append(st)
