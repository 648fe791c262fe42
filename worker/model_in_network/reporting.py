"""What a `ModelInNetwork` reports: its counters, waits, memory and engine traffic, and the steps
its optimizer nodes skipped for a non-finite gradient (asked over the nodes' control channels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import ModelInNetwork


def nodes(mnn: ModelInNetwork) -> list[int]:
    """The optimizer nodes this rank's pieces are on."""
    return sorted({p.node for r in mnn.routes.values() for p in r.pieces})


def skipped_steps(mnn: ModelInNetwork) -> dict[int, list[str]]:
    """`ModelInNetwork.skipped_steps()`: {step: unit labels} from every node this rank reaches."""
    from luwu.dataplane.optimizer.control import ControlClient

    out: dict[int, list[str]] = {}
    for node in nodes(mnn):
        client = ControlClient(mnn.network.node_controls[node], timeout=mnn.timeout,
                               token=mnn.network.control_token, job_id=mnn.network.job_id)
        try:
            for step, ids in client.skipped_steps(mnn.network.job_id).items():
                labels = out.setdefault(step, [])  # a sliced unit is skipped on each of its nodes: named once
                labels.extend(x for x in dict.fromkeys(mnn.units[i].label() for i in ids) if x not in labels)
        finally:
            client.close()
    return dict(sorted(out.items()))


def report(mnn: ModelInNetwork) -> dict:
    """`ModelInNetwork.report()`."""
    from luwu.dataplane.optimizer.control import ControlError

    controls = mnn.network.node_controls
    skipped = None  # unknown: this rank cannot ask the nodes
    if all(n < len(controls) and controls[n] for n in nodes(mnn)):
        try:
            skipped = mnn.skipped_steps()
        except (ControlError, OSError):
            pass
    return {"version": mnn.version, "units": len(mnn.units), "keep": sorted(mnn.keep),
            "model_bytes": sum(u.nbytes for u in mnn.units),
            "largest_unit_bytes": max(u.nbytes for u in mnn.units),
            "counters": dict(mnn.stats), "wait_seconds": dict(mnn.wait_seconds),
            "memory": mnn.memory.snapshot(), "engine": mnn.engine.stats(), "skipped_steps": skipped}
