"""What a ModelInNetwork worker has in flight: a unit's gradient while its parameters' gradients
arrive (`ArrivingGrads`), one handle for a unit's pieces (`joined`), a pull ticket's handle and
staging buffer (`issued`)."""

from __future__ import annotations

import threading

import torch

from luwu.dataplane.engine.handles import Handle
from luwu.worker.engine_link import Staging

from .schedule import Ticket
from .units import Unit


class ArrivingGrads:
    """A unit's gradient while its parameters' gradients arrive: the staging buffer they are copied
    into, which parameters have arrived, and how many are still to come (0: push)."""

    __slots__ = ("done", "left", "slots", "staging", "tensor")

    def __init__(self, staging: Staging, unit: Unit):
        if staging.tensor is None:
            raise RuntimeError("a gradient staging buffer without its torch view (StagingPool.acquire makes it)")
        self.staging = staging
        self.tensor: torch.Tensor = staging.tensor
        self.slots = grad_slots(staging, unit)
        self.done = [False] * len(unit.params)
        self.left = len(unit.params)


def grad_slots(staging: Staging, unit: Unit) -> list[torch.Tensor]:
    """Each parameter's place in `staging` for `unit`'s gradient, shaped as the parameter: its
    gradient is copied in with no slice or reshape per call (~50 per step). Made once per buffer
    and unit and kept on the buffer (views: they hold no memory of their own)."""
    slots = staging.views.get(unit.index)
    if slots is None:
        t = staging.tensor
        if t is None:  # ArrivingGrads says so first
            raise RuntimeError("a gradient staging buffer without its torch view")
        slots = staging.views[unit.index] = [t[lo:hi].view(p.shape) for (_, p), (lo, hi) in zip(unit.params, unit.offsets)]
    return slots


def joined(handles: list[Handle], name: str) -> Handle:
    """One handle for a unit's pieces: done when every piece is (the first error fails it)."""
    if len(handles) == 1:
        return handles[0]
    out = Handle(name)
    left = [len(handles)]
    lock = threading.Lock()

    def one(h: Handle) -> None:
        with lock:
            if out.done() or left[0] == 0:
                return
            left[0] = 0 if h.error is not None else left[0] - 1
            finished = left[0] == 0
        if finished:
            if h.error is not None:
                out.set_error(h.error)
            else:
                out.set_result(None)

    if not handles:  # an empty shard (a unit smaller than the rails): nothing to move
        out.set_result(None)
    for h in handles:
        h.add_done_callback(one)
    return out


def issued(ticket: Ticket) -> tuple[Handle, Staging]:
    """A pull ticket's handle and staging buffer (`_issue_pull` fills both; only a bug leaves one out)."""
    if ticket.handle is None or ticket.staging is None:
        raise RuntimeError(f"the pull ticket of unit {ticket.unit} carries no engine handle or staging buffer")
    return ticket.handle, ticket.staging
