"""What a `ModelInNetwork` reports: its counters, waits, memory and engine traffic, and the steps
its optimizer nodes skipped for a non-finite gradient (asked over the nodes' control channels)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from luwu.worker.engine_link import EngineLink

    from .memory import MemoryTracker
    from .network import JobNetwork
    from .routes import Route
    from .units import Unit


class Reporting(Protocol):
    """What this module reads of a `ModelInNetwork` (model.py). Declared here, not imported: model.py
    imports this module, and no module imports one that imports it back (tests/test_layering.py)."""

    @property
    def routes(self) -> dict[int, Route]: ...
    @property
    def network(self) -> JobNetwork: ...
    @property
    def timeout(self) -> float: ...
    @property
    def units(self) -> list[Unit]: ...
    @property
    def keep(self) -> set[int]: ...
    @property
    def version(self) -> int: ...
    @property
    def stats(self) -> Counter[str]: ...
    @property
    def wait_seconds(self) -> dict[str, float]: ...
    @property
    def memory(self) -> MemoryTracker: ...
    @property
    def engine(self) -> EngineLink: ...
    def skipped_steps(self) -> dict[int, list[str]]: ...


def nodes(mnn: Reporting) -> list[int]:
    """The optimizer nodes this rank's pieces are on."""
    return sorted({p.node for r in mnn.routes.values() for p in r.pieces})


def skipped_steps(mnn: Reporting) -> dict[int, list[str]]:
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


def report(mnn: Reporting) -> dict:
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
