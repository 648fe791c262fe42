"""The event half of the model: serial resources (a GPU, one direction of a link, a disk, the
node's cores) and tasks that hold one or more of them, scheduled in the order they are issued
(list scheduling). A task starts when its inputs are ready and all its resources are free, and
holds them for its duration; a streaming transfer that crosses several resources (worker link,
switch, node link) holds them all at once, so the slowest sets its pace.

This is enough for a layer-by-layer iteration: the issue order is the order each system's
runtime issues work, and no resource ever reorders (a NIC queue, a CUDA stream, a disk queue).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Task:
    resources: dict[str, float]  # resource -> seconds it is busy (the task lasts the longest)
    start: float
    end: float
    label: str
    iteration: int


@dataclass
class Timeline:
    iteration: int = 0
    free: dict[str, float] = field(default_factory=dict)
    tasks: list[Task] = field(default_factory=list)

    def run(self, work: dict[str, float], ready: float, label: str) -> float:
        """Schedule a task needing `work[r]` seconds of each resource r, no earlier than `ready`.
        The resources stream together, so the task holds all of them for the longest of those
        times (the others count as busy only for their own seconds). Returns the end time."""
        start = max([ready] + [self.free.get(r, 0.0) for r in work])
        end = start + max(0.0, max(work.values()))
        for r in work:
            self.free[r] = end
        self.tasks.append(Task(dict(work), start, end, label, self.iteration))
        return end

    def window(self, iteration: int) -> tuple[float, float]:
        ts = [t for t in self.tasks if t.iteration == iteration]
        return min(t.start for t in ts), max(t.end for t in ts)

    def busy(self, t0: float, t1: float) -> dict[str, float]:
        """Seconds each resource works inside [t0, t1]: its own seconds of each task, counted from
        the task's start (a resource is serial, so these never overlap)."""
        out: dict[str, float] = {}
        for t in self.tasks:
            for r, secs in t.resources.items():
                lo, hi = max(t.start, t0), min(t.start + secs, t1)
                if hi > lo:
                    out[r] = out.get(r, 0.0) + hi - lo
        return out
