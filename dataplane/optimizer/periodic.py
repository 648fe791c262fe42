"""Lazy checkpoints every N optimizer steps, requested by the node itself (`luwu node --checkpoint-every N`).

Each job is checkpointed at versions N, 2N, 3N, ...: every layer right after its step kN - 1, so a
checkpoint is one consistent version of the whole job, the version a restarted node
(`luwu node --restore latest`) resumes from and the step the workers restart at. The request for
version kN goes in when the job's first layer publishes a version in [(k-1)N, kN), well before
any layer reaches kN (a layer cannot run step kN - 1 before the workers have pulled every layer
at kN - 1); copies are lazy (checkpoint.py: copy-on-write, background writer), so training does
not wait. A request that comes too late anyway (a layer already past kN) is skipped and counted,
and the next multiple is requested.
"""

from __future__ import annotations

import logging
import threading

from .errors import OptimizerInputError

log = logging.getLogger("luwu.optimizer")


class PeriodicCheckpoints:
    """Requests a lazy checkpoint of every job of `node` at every multiple of `every` versions.

    Args:
        node: the `OptimizerNode` (with a checkpoint_dir).
        every: steps between checkpoints (>= 1).

    Examples::

        >>> node = OptimizerNode(NodeConfig(state_dir=..., checkpoint_dir=ckpt))
        >>> periodic = PeriodicCheckpoints(node, every=50)   # versions 50, 100, ... of every job
        >>> periodic.stats()                                   # {"requested": ..., "skipped": ...}
    """

    def __init__(self, node, every: int):
        if int(every) < 1:
            raise ValueError(f"checkpoint interval must be >= 1 steps, got {every}")
        if node.ckpt is None:
            raise ValueError("periodic checkpoints need a checkpoint directory (--checkpoint-dir)")
        self.node, self.every = node, int(every)
        self.target: dict[str, int] = {}  # job id -> the highest version requested
        self.counts = {"requested": 0, "skipped": 0}
        self._lock = threading.Lock()
        node.add_listener(self._published)

    def _published(self, job_id: str, layer_id: int, version: int) -> None:
        target = (version // self.every + 1) * self.every  # the next multiple above this version
        with self._lock:
            if self.target.get(job_id, 0) >= target:
                return
            self.target[job_id] = target
        try:
            self.node.request_checkpoint(target - 1, job_id)  # captured right after step target - 1
            self.counts["requested"] += 1
        except OptimizerInputError as exc:  # too late for this one; the next publish asks for the next
            self.counts["skipped"] += 1
            log.warning("periodic checkpoint of job %s at version %d skipped: %s", job_id, target, exc)

    def stats(self) -> dict:
        return {"every": self.every, **self.counts, "targets": dict(self.target)}
