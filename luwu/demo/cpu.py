"""CPU seconds per training step of every process a demo run started, by role: the workers, their
engine daemons, the software switch, the optimizer nodes, the controller and the demo itself.

On a machine with fewer cores than processes, tokens/s is decided by who uses the CPU: the
report sets what the network side costs per step against what the workers' training costs, and
against the DDP baseline's processes. Sampled from /proc (dataplane/process/children.py) at two steps of
rank 0 (a fifth of the way in, to skip start-up, and the last), so the figure is per steady step.
"""

from __future__ import annotations

import os

from luwu.dataplane.process.children import cpu_seconds, descendants

# role -> what its command line contains (first match wins, in this order)
ROLES = (("workers", "luwu.demo.worker"), ("engines", "luwu.dataplane.engine.daemon"), ("switch", " switch "),
         ("optimizer nodes", " node "), ("controller", " controller "))


def snapshot() -> dict[int, tuple[str, float]]:
    """{pid: (role, CPU seconds so far)} of this process and everything it started."""
    out = {os.getpid(): ("demo", cpu_seconds(os.getpid()))}
    for pid, argv in descendants(os.getpid()).items():
        role = next((r for r, needle in ROLES if needle in f" {argv} "), "other")
        out[pid] = (role, cpu_seconds(pid))
    return out


class StepCpu:
    """Feed it the workers' messages (`on_message`); `result()` is {role: CPU s per step, "total":
    ..., "steps": how many steps it covers}, or None when the run was too short to say."""

    def __init__(self, steps: int):
        self.first = max(1, steps // 5)
        self.last = steps - 1
        self.a: dict[int, tuple[str, float]] | None = None
        self.b: dict[int, tuple[str, float]] | None = None
        self.steps = 0
        self._first_seen: int | None = None

    def on_message(self, msg: dict) -> None:
        if msg.get("event") != "step" or msg.get("rank") != 0:
            return
        step = int(msg.get("step", -1))
        if self.a is None and step >= self.first and step < self.last:
            self.a, self._first_seen = snapshot(), step
        elif self.a is not None and step >= self.last and self.b is None and self._first_seen is not None:
            self.b, self.steps = snapshot(), step - self._first_seen

    def result(self) -> dict | None:
        if self.a is None or self.b is None or self.steps <= 0:
            return None
        per: dict[str, float] = {}
        for pid, (role, cpu) in self.b.items():
            before = self.a.get(pid, (role, 0.0))[1]  # a process started in between counts from zero
            per[role] = per.get(role, 0.0) + max(0.0, cpu - before)
        out: dict = {role: sec / self.steps for role, sec in sorted(per.items())}
        out["total"] = sum(per.values()) / self.steps
        out["steps"] = self.steps
        return out
