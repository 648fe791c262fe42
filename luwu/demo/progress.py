"""The demo's live view (rich): one bar per training run with step, loss, tokens/s and the bytes
the workers have sent into the network for aggregation. Worker messages arrive from reader
threads; `StepTracker` turns per-rank step lines into global steps (every rank has reported)."""

from __future__ import annotations

import threading
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class StepTracker:
    """Collects per-rank step messages; a step is complete when every rank has reported it."""

    def __init__(self, workers: int):
        self.workers = workers
        self._lock = threading.Lock()
        self._pending: dict[int, list[dict]] = {}
        self.done_steps = 0
        self.tokens = 0
        self.pushed = 0
        self.loss = float("nan")
        self.started = time.perf_counter()
        self.last_rate = 0.0

    def add(self, msg: dict) -> bool:
        """True when this message completed a step."""
        with self._lock:
            rows = self._pending.setdefault(int(msg["step"]), [])
            rows.append(msg)
            if len(rows) < self.workers:
                return False
            del self._pending[int(msg["step"])]
            self.done_steps += 1
            self.tokens += sum(int(m["tokens"]) for m in rows)
            self.pushed = max(self.pushed, sum(int(m.get("pushed_bytes", 0)) for m in rows))
            self.loss = sum(float(m["loss"]) for m in rows) / len(rows)
            elapsed = time.perf_counter() - self.started
            self.last_rate = self.tokens / elapsed if elapsed > 0 else 0.0
            return True


class DemoProgress:
    def __init__(self, console=None, enabled: bool = True):
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("{task.fields[net]}"), TimeElapsedColumn(), console=console, disable=not enabled)

    def __enter__(self) -> DemoProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def run(self, name: str, steps: int, workers: int, in_network: bool):
        """A callback for WorkerGroup messages that drives one bar; returns (callback, tracker)."""
        task = self.progress.add_task(name, total=steps, loss="-", rate="-", net="")
        tracker = StepTracker(workers)

        def on_message(msg: dict) -> None:
            if msg.get("event") != "step" or not tracker.add(msg):
                return
            net = f"aggregated {human_bytes(tracker.pushed)}" if in_network else "gloo allreduce"
            self.progress.update(task, completed=tracker.done_steps, loss=f"{tracker.loss:.4f}",
                                 rate=f"{tracker.last_rate:,.0f}", net=net)

        return on_message, tracker
