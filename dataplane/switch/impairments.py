"""Software-only link impairments of the drop simulator: duplication and depth-1 reordering.

Not part of the P4 program (a P4 switch cannot hold a packet back). Each direction of each
port has a `Link`: a packet is duplicated with probability `duplicate` (the copy follows it),
and each copy is held back with probability `reorder` and released right after the next packet
on that link, so no packet moves by more than one position (docs/protocol.md section 8). The
event loop also releases a held packet after `SwitchConfig.reorder_hold` seconds of silence.
Draws come from a seeded stream, one per packet and one per copy, in link order.
"""

from __future__ import annotations

import time

from .controls.drop_simulator import Random32


class Link:
    __slots__ = ("duplicate", "held", "held_since", "reorder", "rng", "stats")

    def __init__(self, rng: Random32):
        self.rng = rng
        self.duplicate = 0.0
        self.reorder = 0.0
        self.held = None
        self.held_since = 0.0
        self.stats = {"duplicated": 0, "reordered": 0}

    @property
    def active(self) -> bool:
        return self.duplicate > 0 or self.reorder > 0 or self.held is not None

    def pass_through(self, items: list) -> list:
        out = []
        for item in items:
            copies = 2 if self.duplicate > 0 and self.rng.uniform(1)[0] < self.duplicate else 1
            if copies == 2:
                self.stats["duplicated"] += 1
            for _ in range(copies):
                if self.held is None and self.reorder > 0 and self.rng.uniform(1)[0] < self.reorder:
                    self.held = item
                    self.held_since = time.monotonic()
                    self.stats["reordered"] += 1
                    continue
                out.append(item)
                if self.held is not None:
                    out.append(self.held)
                    self.held = None
        return out

    def release_stale(self, max_hold: float) -> list:
        """The held packet, if it has waited longer than max_hold seconds."""
        if self.held is not None and time.monotonic() - self.held_since >= max_hold:
            item, self.held = self.held, None
            return [item]
        return []
