"""Assigns layers (or contiguous slices of large layers) to optimizer nodes by measured capacity.

Balanced and deterministic: every element of every layer lands on exactly one node. A layer
larger than the smallest node's fair share (or 1/8 of a node's average share, whichever is
larger) is cut into equal contiguous slices first, then the
pieces go largest-first to the node whose finish time (load / params per second) grows least
(LPT scheduling), ties broken by node order, so equal inputs always give the same map.
"""

from __future__ import annotations

from dataclasses import dataclass

SLICES_PER_NODE = 8  # bound on slicing: about this many pieces per node at most, plus one per layer


@dataclass(frozen=True)
class Piece:
    layer_id: int
    offset: int
    numel: int
    node_index: int


class ShardBalancer:
    def __init__(self, min_slice: int = 1):
        self.min_slice = max(1, int(min_slice))  # never cut slices smaller than this (elements)

    def assign(self, layers: list[tuple[int, int]], capacities: list[float]) -> list[Piece]:
        """layers: (layer_id, numel); capacities: params/s per node (<= 0 counts as 1)."""
        if not capacities:
            raise ValueError("no optimizer node to assign layers to")
        ids = [lid for lid, _ in layers]
        if len(set(ids)) != len(ids):
            raise ValueError("layer ids must be unique")
        caps = [c if c > 0 else 1.0 for c in capacities]
        total = sum(n for _, n in layers)
        if total == 0:
            return []
        fair = min(total * c / sum(caps) for c in caps)
        # cut at the smallest fair share, but never into more than ~SLICES_PER_NODE pieces per node
        # (a node a thousand times slower than the others would otherwise shred every layer)
        floor = -(-total // (len(caps) * SLICES_PER_NODE))
        limit = max(self.min_slice, int(fair), floor) if len(caps) > 1 else total
        pieces: list[tuple[int, int, int]] = []  # (layer_id, offset, numel)
        for lid, numel in layers:
            if numel <= 0:
                continue
            count = -(-numel // limit)
            for i in range(count):
                lo, hi = numel * i // count, numel * (i + 1) // count
                pieces.append((lid, lo, hi - lo))
        pieces.sort(key=lambda p: (-p[2], p[0], p[1]))
        load = [0] * len(caps)
        out = []
        for lid, offset, numel in pieces:
            best = min(range(len(caps)), key=lambda i: ((load[i] + numel) / caps[i], i))
            load[best] += numel
            out.append(Piece(lid, offset, numel, best))
        out.sort(key=lambda p: (p.layer_id, p.offset))
        return out


def split_even(numel: int, parts: int) -> list[tuple[int, int]]:
    """(offset, numel) of `parts` contiguous slices whose sizes differ by at most one."""
    return [(numel * k // parts, numel * (k + 1) // parts - numel * k // parts) for k in range(parts)]
