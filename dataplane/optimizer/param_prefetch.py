"""Read-ahead of served copies in pull order, for nodes whose served copies do not all fit in RAM.

Workers pull a layer's parameters in forward order (0, 1, ...) and again in backward order
during the backward pass. After each pull of layer i the prefetcher loads the next `depth`
layers in the direction of the last two pulls, on its own thread, so that the next pull finds
its copy in RAM. When every served copy is resident it does nothing.
"""

from __future__ import annotations

import collections
import threading

from .served import ServedCache


class ParamPrefetcher:
    def __init__(self, served: ServedCache, depth: int):
        self.served = served
        self.depth = depth
        self.cv = threading.Condition()
        self.todo: collections.deque[tuple] = collections.deque()
        self.last: dict[str, int] = {}  # job -> rank of its last pulled layer
        self.stop = False
        self.counts = {"hints": 0, "loads": 0, "errors": 0}
        self.thread = threading.Thread(target=self._run, name="luwu-opt-param-prefetch", daemon=True)
        self.thread.start()

    def hint(self, job_id: str, order: list[int], rank: int) -> None:
        """A layer at position `rank` of the job's forward `order` was just pulled."""
        if self.depth <= 0:
            return
        prev = self.last.get(job_id)
        self.last[job_id] = rank
        step = -1 if prev is not None and rank < prev else 1
        keys = [(job_id, order[r]) for r in range(rank + step, rank + step * (self.depth + 1), step)
                if 0 <= r < len(order)]
        keys = [k for k in keys if not self.served.resident(k)]
        if not keys:
            return
        with self.cv:
            self.counts["hints"] += 1
            self.todo.extend(k for k in keys if k not in self.todo)
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.todo and not self.stop:
                    self.cv.wait(1.0)
                if self.stop:
                    return
                key = self.todo.popleft()
            try:
                if not self.served.resident(key):
                    self.served.get(key)
                    with self.cv:
                        self.counts["loads"] += 1
            except Exception:  # a failed read-ahead only costs the pull its wait
                with self.cv:
                    self.counts["errors"] += 1

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.thread.join(5.0)

    def stats(self) -> dict:
        with self.cv:
            return dict(self.counts)
