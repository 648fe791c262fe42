"""Job events: stored for replay, fanned out to every live WatchJob stream of the job.

Subscribers are asyncio queues on the controller's event loop; a slow watcher whose queue is
full loses its stream (it is told so) rather than slowing the controller down.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .store import StateStore

QUEUE_DEPTH = 1000  # events buffered per watcher before it is dropped
END = None  # queued to close a watcher's stream


@dataclass
class Event:
    job_id: str
    seq: int
    time: float
    kind: str
    subject: str
    message: str


class JobEvents:
    def __init__(self, store: StateStore):
        self.store = store
        self._watchers: dict[str, list[asyncio.Queue]] = {}

    def emit(self, job_id: str, kind: str, subject: str = "", message: str = "") -> Event:
        seq, now = self.store.add_event(job_id, kind, subject, message)
        event = Event(job_id, seq, now, kind, subject, message)
        for q in list(self._watchers.get(job_id, [])):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                self._watchers[job_id].remove(q)
        return event

    def past(self, job_id: str) -> list[Event]:
        return [Event(job_id, *row) for row in self.store.events(job_id)]

    def subscribe(self, job_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(QUEUE_DEPTH)
        self._watchers.setdefault(job_id, []).append(q)
        return q

    def unsubscribe(self, job_id: str, q: asyncio.Queue) -> None:
        if q in self._watchers.get(job_id, []):
            self._watchers[job_id].remove(q)

    def close(self, job_id: str) -> None:
        """The job ended: every watcher's stream finishes after the events already queued."""
        for q in self._watchers.pop(job_id, []):
            try:
                q.put_nowait(END)
            except asyncio.QueueFull:
                pass
