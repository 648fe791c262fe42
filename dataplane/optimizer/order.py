"""Predicted access order of shards, for prefetch and eviction.

Gradients arrive layer by layer in backward order, the same order every iteration, so each job's
shards form a cycle. The tracker learns the cycle from the last complete step's arrival order
(it starts from descending layer ids) and answers two questions: which shards come next
(prefetch) and how far away a shard's next use is (eviction evicts the farthest, Belady's rule,
which on a cycle keeps a fixed subset resident instead of thrashing like LRU).
"""

from __future__ import annotations

import threading


class OrderTracker:
    def __init__(self):
        self._lock = threading.Lock()
        self._order: dict[str, list[tuple]] = {}  # job -> shard keys in predicted order
        self._pos: dict[tuple, int] = {}
        self._cursor: dict[str, int] = {}

    def set_order(self, job_id: str, keys: list[tuple]) -> None:
        with self._lock:
            for k in self._order.get(job_id, []):
                self._pos.pop(k, None)
            self._order[job_id] = list(keys)
            for i, k in enumerate(keys):
                self._pos[k] = i
            self._cursor[job_id] = len(keys) - 1  # "just before the first"

    def order(self, job_id: str) -> list[tuple]:
        with self._lock:
            return list(self._order.get(job_id, []))

    def remove_job(self, job_id: str) -> None:
        self.set_order(job_id, [])
        with self._lock:
            self._order.pop(job_id, None)
            self._cursor.pop(job_id, None)

    def touch(self, key: tuple) -> None:
        with self._lock:
            pos = self._pos.get(key)
            if pos is not None:
                self._cursor[key[0]] = pos

    def distance(self, key: tuple) -> float:
        """How soon `key` is used again, as a fraction of its job's cycle: 0 = next, ~1 = just used."""
        with self._lock:
            order = self._order.get(key[0])
            pos = self._pos.get(key)
            if not order or pos is None:
                return 1.0
            n = len(order)
            return ((pos - self._cursor[key[0]] - 1) % n) / n

    def next_keys(self, job_id: str, count: int) -> list[tuple]:
        """The `count` shards predicted to follow the most recently used one."""
        with self._lock:
            order = self._order.get(job_id)
            if not order or count <= 0:
                return []
            c, n = self._cursor[job_id], len(order)
            return [order[(c + i) % n] for i in range(1, min(count, n) + 1)]

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._order)

    def upcoming(self, key: tuple, count: int) -> list[tuple]:
        """The `count` shards predicted to follow `key`."""
        with self._lock:
            order = self._order.get(key[0])
            pos = self._pos.get(key)
            if not order or pos is None or count <= 0:
                return []
            n = len(order)
            return [order[(pos + i) % n] for i in range(1, min(count, n - 1) + 1)]
