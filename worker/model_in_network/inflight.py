"""What a ModelInNetwork worker has in flight: a unit's gradient while its parameters' gradients
arrive (`ArrivingGrads`), one handle for a unit's pieces (`joined`), a pull ticket's handle and
staging buffer (`issued`)."""

from __future__ import annotations

import threading

import torch

from luwu.dataplane.engine.handles import Handle
from luwu.worker.engine_link import Staging

from .schedule import Ticket


class ArrivingGrads:
    """A unit's gradient while its parameters' gradients arrive: the staging buffer they are copied
    into, which parameters have arrived, and how many are still to come (0: push)."""

    __slots__ = ("done", "left", "staging", "tensor")

    def __init__(self, staging: Staging, nparams: int):
        if staging.tensor is None:
            raise RuntimeError("a gradient staging buffer without its torch view (StagingPool.acquire makes it)")
        self.staging = staging
        self.tensor: torch.Tensor = staging.tensor
        self.done = [False] * nparams
        self.left = nparams


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
