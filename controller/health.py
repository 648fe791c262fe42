"""Liveness of switches and optimizer nodes from their heartbeats (ReportHealth).

A component is "up" while its last report is younger than the health timeout. Everything
registered starts with the controller's start time as its last sign of life, so a restarted
controller gives every daemon one full timeout to report before calling it down.
"""

from __future__ import annotations

import time


class HealthMonitor:
    def __init__(self, timeout: float, clock=time.time):
        self.timeout = timeout
        self.clock = clock
        self.started = clock()
        self.last_seen: dict[tuple[str, str], float] = {}  # (kind, name) -> time
        self.counters: dict[tuple[str, str], dict[str, int]] = {}
        self.state: dict[tuple[str, str], str] = {}  # "up" | "down"

    def track(self, kind: str, name: str) -> None:
        self.last_seen.setdefault((kind, name), self.started)
        self.state.setdefault((kind, name), "up")

    def forget(self, kind: str, name: str) -> None:
        for d in (self.last_seen, self.counters, self.state):
            d.pop((kind, name), None)

    def report(self, kind: str, name: str, counters: dict[str, int] | None = None) -> bool:
        """Record a heartbeat; True when the component was down and is back."""
        key = (kind, name)
        self.last_seen[key] = self.clock()
        if counters:
            self.counters[key] = dict(counters)
        back = self.state.get(key) == "down"
        self.state[key] = "up"
        return back

    def sweep(self) -> list[tuple[str, str]]:
        """Mark silent components down; return the ones that just went down."""
        now, gone = self.clock(), []
        for key, seen in self.last_seen.items():
            if self.state.get(key) == "up" and now - seen > self.timeout:
                self.state[key] = "down"
                gone.append(key)
        return gone

    def health(self, kind: str, name: str) -> str:
        return self.state.get((kind, name), "unknown")

    def seen(self, kind: str, name: str) -> float:
        return self.last_seen.get((kind, name), 0.0)
