"""The switch's registers (docs/protocol.md 6.2): state the data plane keeps and no controller writes.

Slot registers are indexed by `set * slots + slot` (the two bitmaps by `slot`); heartbeat
registers by session id. Lanes are one native int32 array `[2 * slots, lanes]` (the wire is
big-endian; conversion happens on the way in and out). Arrays start as lazily mapped zeros, so
a large pool costs memory only where sessions actually aggregate.
"""

from __future__ import annotations

import numpy as np

from ..protocol import MAX_SESSIONS


class Registers:
    def __init__(self, slots: int, lanes: int):
        self.slots = slots
        self.lanes_count = lanes
        self.reset()

    def reset(self) -> None:
        n = 2 * self.slots
        self.slot_owner = np.zeros(n, dtype=np.uint32)
        self.bitmap = np.zeros(n, dtype=np.uint32)  # bitmap_set0 then bitmap_set1 (P4: two registers by slot)
        self.contributors = np.zeros(n, dtype=np.uint32)
        self.exponents = np.zeros(n, dtype=np.int8)
        self.slot_flags = np.zeros(n, dtype=np.uint8)
        self.lanes = np.zeros((n, self.lanes_count), dtype=np.int32)
        self.hb_owner = np.zeros(MAX_SESSIONS, dtype=np.uint32)
        self.hb_bitmap = np.zeros(MAX_SESSIONS, dtype=np.uint32)
        self.hb_ack = np.zeros(MAX_SESSIONS, dtype=np.uint32)
        self.hb_credit = np.zeros(MAX_SESSIONS, dtype=np.uint32)

    def index(self, set_: np.ndarray, slot: np.ndarray) -> np.ndarray:
        return set_ * self.slots + slot
