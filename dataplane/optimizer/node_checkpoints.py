"""The node's checkpoint API (a mixin of OptimizerNode): lazy checkpoints of a future step,
checkpoints of the current state, and restoring a node from a checkpoint directory.

Versions: `request_checkpoint(step)` captures every layer right after its optimizer step `step`
(0-based), i.e. at version step + 1. A restored node's layers are at the versions in the
manifest, and expect the gradients of the steps after them.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Self

from .checkpoint import CheckpointHandle, CheckpointManager
from .checkpoint_files import latest_checkpoint, read_manifest, verify_record
from .errors import CheckpointError, OptimizerInputError
from .job_state import JobRuntime, LayerRuntime
from .layout import plan_layer
from .spec import JobSpec, NodeConfig

if TYPE_CHECKING:
    from .store import StateStore


class CheckpointMixin:
    if TYPE_CHECKING:  # what the mixin uses of OptimizerNode (node.py), declared for the type checker
        config: NodeConfig
        store: StateStore
        ckpt: CheckpointManager | None
        jobs: dict[str, JobRuntime]
        _cv: threading.Condition

        def __init__(self, config: NodeConfig) -> None: ...
        def _emit_ckpt(self, event: str, info: dict) -> None: ...
        def _check_usable(self) -> None: ...
        def _job(self, job_id: str) -> JobRuntime: ...
        def _reject(self, e: OptimizerInputError) -> NoReturn: ...
        def _add_job(self, spec: JobSpec, max_shard_elems: int, restore: dict | None) -> None: ...
        def close(self, timeout: float = 30.0) -> None: ...

    def _make_checkpoints(self) -> None:
        cfg = self.config
        if cfg.checkpoint_dir is None:
            return
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, self.store, cfg.checkpoint_keep, cfg.checkpoint_staging,
                                      cfg.checkpoint_chunk, cfg.checkpoint_rate, self._job_json, self._emit_ckpt,
                                      cfg.checkpoint_nice)
        self.store.keep_hint = self.ckpt.has_capture

    def _job_json(self, job_id: str) -> dict:
        job = self.jobs[job_id]
        return {**job.spec.to_json(), "max_shard_elems": job.max_shard_elems}

    def _need_ckpt(self) -> CheckpointManager:
        if self.ckpt is None:
            e = OptimizerInputError("this node has no checkpoint_dir: set NodeConfig.checkpoint_dir to take "
                                    "checkpoints")
            self._reject(e)
        return self.ckpt

    def request_checkpoint(self, step: int, job_id: str | None = None) -> CheckpointHandle:
        """Checkpoint every layer (of `job_id`, or of every job) right after its optimizer step
        `step`, lazily, in the background. Call it before that step's gradients are in; a layer
        already past it is refused. Returns a handle whose wait() gives the directory."""
        ckpt = self._need_ckpt()
        version = int(step) + 1
        with self._cv:
            self._check_usable()
            jobs = [self._job(job_id)] if job_id is not None else list(self.jobs.values())
            if not jobs:
                self._reject(OptimizerInputError("no jobs to checkpoint"))
            targets, now = {}, []
            for job in jobs:
                for lid, lr in job.layers.items():
                    busy = self._busy(lr)
                    if lr.version > version or (lr.version == version and busy):
                        self._reject(OptimizerInputError(
                            f"too late to checkpoint step {step}: job {job.spec.job_id!r} layer {lid} is at version "
                            f"{lr.version}{' with its next step running' if busy else ''}; request it earlier"))
                    targets[(job.spec.job_id, lid)] = version
                    if lr.version == version:
                        now.append(lr)
            ck = ckpt.begin(targets, {k: self.jobs[k[0]].layers[k[1]].plan for k in targets})
            for lr in now:
                ckpt.capture_layer(lr.plan, version)
        return CheckpointHandle(ck)

    def checkpoint_now(self, timeout: float | None = None) -> Path:
        """Checkpoint every layer of every job at its current version (a layer whose step is
        running is taken right after that step); blocks until committed and returns the directory."""
        ckpt = self._need_ckpt()
        with self._cv:
            self._check_usable()
            targets, now = {}, []
            for job in self.jobs.values():
                for lid, lr in job.layers.items():
                    busy = self._busy(lr)
                    targets[(job.spec.job_id, lid)] = lr.version + (1 if busy else 0)
                    if not busy:
                        now.append(lr)
            if not targets:
                self._reject(OptimizerInputError("no jobs to checkpoint"))
            ck = ckpt.begin(targets, {k: self.jobs[k[0]].layers[k[1]].plan for k in targets})
            for lr in now:
                ckpt.capture_layer(lr.plan, lr.version)
        return CheckpointHandle(ck).wait(timeout)

    @staticmethod
    def _busy(lr: LayerRuntime) -> bool:
        """A step of the layer is running (its state is about to change)."""
        item = lr.in_flight
        return item is not None and hasattr(item, "published") and not item.published

    @classmethod
    def restore(cls, config: NodeConfig, checkpoint_path: Path | str) -> Self:
        """A node holding exactly the checkpoint's state. Every file is verified (size, CRC-32,
        header) before anything is loaded; a bad one raises CheckpointError naming it."""
        path = Path(checkpoint_path)
        manifest = read_manifest(path)
        jobs = []
        for job in manifest["jobs"]:
            try:
                spec = JobSpec.from_json(job["spec"])
                max_shard = int(job["spec"]["max_shard_elems"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"checkpoint {path}: job spec unreadable ({e})") from None
            plans = {ly.layer_id: plan_layer(spec, ly, max_shard) for ly in spec.layers}
            state = {int(s["layer_id"]): s for s in job["state"]}
            if set(state) != set(plans):
                raise CheckpointError(f"checkpoint {path}: job {spec.job_id!r} state covers layers {sorted(state)}, "
                                      f"its spec has {sorted(plans)}")
            for lid, plan in plans.items():
                files = state[lid]["shards"]
                if len(files) != len(plan.shards):
                    raise CheckpointError(f"checkpoint {path}: layer {lid} has {len(files)} shard files, "
                                          f"its layout needs {len(plan.shards)}")
                for shard, entry in zip(plan.shards, files):
                    verify_record(path, entry, shard, int(state[lid]["version"]), keep=False)
            jobs.append((spec, max_shard, plans, state))
        node = cls(config)
        try:
            for spec, max_shard, plans, state in jobs:
                restore = {}
                for lid, plan in plans.items():
                    version = int(state[lid]["version"])
                    loaders = {s.index: (lambda s=s, e=e, v=version: verify_record(path, e, s, v, keep=True))
                               for s, e in zip(plan.shards, state[lid]["shards"])}
                    restore[lid] = (version, loaders)
                node._add_job(spec, max_shard, restore)
        except BaseException:
            node.close()
            raise
        return node

    @staticmethod
    def latest_checkpoint(checkpoint_dir: Path | str) -> Path | None:
        """The newest committed checkpoint under `checkpoint_dir` (None if there is none)."""
        return latest_checkpoint(Path(checkpoint_dir))
