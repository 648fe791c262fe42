"""Which pulls a worker issues, and when: a deterministic policy, so every worker issues the same
pulls in the same order (the node answers pull ids, docs/protocol.md 7.3).

A pass's timeline is the forward needs in forward order, then (with autograd on) the backward
needs in reverse order of each unit's last forward use (a tied embedding used again by the head
is needed first in backward): the units that are neither kept resident after forward nor free of
saved parameters (an embedding's backward needs only the indices). When a unit is needed, its
pull (issued earlier as a prefetch, or now) is taken, and once its values are in, the next
`prefetch` entries of the timeline are issued. Decisions depend only on the sequence of needs,
never on timing, so workers running the same model agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the schedule decides, the engine link moves the data
    from luwu.dataplane.engine.handles import Handle
    from luwu.worker.engine_link import Staging

FORWARD, BACKWARD = "f", "b"


def use_phase(n: int) -> str:
    """The phase of a unit's use number `n` (0-based) in one forward pass: FORWARD, then "f1", "f2"...
    (a tied parameter's unit used again by another module, a module called twice)."""
    return FORWARD if n == 0 else f"{FORWARD}{n}"


@dataclass
class Ticket:
    unit: int
    phase: str
    version: int
    handle: Handle | None = None  # the engine's Handle
    staging: Staging | None = None  # where the values land


class PullSchedule:
    def __init__(self, order: list[int], keep: set[int], prefetch: int,
                 issue: Callable[[int, str, int], Ticket]):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.order = list(order)
        self.keep = set(keep)
        self.prefetch = prefetch
        self._issue = issue
        self.saves_params = dict.fromkeys(order, True)  # learned each forward; True until known
        self.uses: list[tuple[int, str]] | None = None  # a pass's forward uses (unit, use_phase(n)), once seen
        self.last_use: list[int] | None = None  # units by their last forward use (a unit used twice), once seen
        self.pending: dict[tuple[int, str], Ticket] = {}
        self.grad = True
        self.issued: set[tuple[int, str]] = set()
        self.issued_count = 0

    def backward_units(self) -> list[int]:
        order = self.last_use if self.last_use is not None else self.order
        return [u for u in reversed(order) if u not in self.keep and self.saves_params[u]]

    def timeline(self) -> list[tuple[int, str]]:
        """This pass's needs in order. Built when asked: the backward part uses what this pass's
        forward has learned so far about saved parameters."""
        out = self.forward_uses()
        if self.grad:
            out += [(u, BACKWARD) for u in self.backward_units()]
        return out

    def forward_uses(self) -> list[tuple[int, str]]:
        """A pass's forward needs: each use of each unit as last seen, else each unit once in order."""
        return list(self.uses) if self.uses is not None else [(u, FORWARD) for u in self.order]

    def begin_pass(self, grad: bool) -> None:
        """A forward pass starts (the first unit's forward)."""
        self.grad = grad
        self.issued = set(self.pending)

    def take(self, unit: int, phase: str, version: int, resident: bool) -> Ticket | None:
        """The ticket whose values the unit must take now: its prefetched pull, or one issued now;
        None when it is resident and nothing was pulled for it."""
        key = (unit, phase)
        ticket = self.pending.pop(key, None)
        if ticket is None and not resident:
            ticket = self._issue(unit, phase, version)
            self.issued_count += 1
        self.issued.add(key)
        return ticket

    def prefetch_after(self, unit: int, phase: str, version: int) -> None:
        """Issue the `prefetch` timeline entries that follow (unit, phase) and are not issued yet.
        Called once the unit's own values are in, so a staging buffer is free again."""
        if not self.prefetch:
            return
        timeline = self.timeline()
        try:
            pos = timeline.index((unit, phase))
        except ValueError:
            return
        for e in timeline[pos + 1: pos + 1 + self.prefetch]:
            if e not in self.issued and e not in self.pending:
                self.pending[e] = self._issue(e[0], e[1], version)
                self.issued.add(e)
                self.issued_count += 1

    def prefetch_next_pass(self, version: int) -> None:
        """After a step: the first forward entries of the next pass (the node serves them as soon
        as their new version is published)."""
        for key in self.forward_uses()[: self.prefetch]:
            if key not in self.pending:
                self.pending[key] = self._issue(key[0], key[1], version)
                self.issued_count += 1

    def drain(self) -> list[Ticket]:
        """Every pending ticket (a step makes them stale); the caller waits for and drops them."""
        out = list(self.pending.values())
        self.pending.clear()
        self.issued.clear()
        return out
