"""The optimizer node's core: jobs, versions, listeners, failure and teardown; its data path
(gradients in, parameters out) is node_data.py and its checkpoints node_checkpoints.py, the two
mixins `OptimizerNode` is made of.

The network side (the engine that reassembles summed gradients from AGG packets and answers
PULLs with PARAM packets) hosts one `OptimizerNode`; `provider(job)` and `gradient_sink(job, n)`
adapt it to the engine's ParamProvider / GradientSink shapes. This package never imports the engine.

Input errors raise `OptimizerInputError` subclasses (all `ValueError`s) synchronously from the
call that got the bad input, are counted in `stats()["rejected"]`, and leave the state untouched.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from luwu.dataplane import kernels as kernel_mode

from . import budget, fused, kernels
from .checkpoint import CheckpointManager
from .errors import NodeFailed, OptimizerInputError, StepOutOfOrder, UnknownJob, UnknownLayer
from .initial import Filler, check_initial, fresh_filler, initial_master, layer_values, record_filler, values_filler
from .job_state import JobRuntime, LayerRuntime
from .layout import LayerPlan, ShardPlan, plan_layer
from .node_checkpoints import CheckpointMixin
from .node_data import DataPathMixin
from .order import OrderTracker
from .param_prefetch import ParamPrefetcher
from .pipeline import LayerStep, Pipeline
from .served import ServedCache
from .shard_file import FileSet
from .spec import JobSpec, NodeConfig
from .store import StateStore

log = logging.getLogger("luwu.optimizer")
_QUIESCE = object()  # in_flight marker while a caller reads a layer's state


class OptimizerNode(DataPathMixin, CheckpointMixin):
    def __init__(self, config: NodeConfig):
        if kernel_mode.mode() == "numba":  # a bad LUWU_KERNELS is a UserError here, not in a pipeline thread
            kernel_mode.use_numba()
        self.config = config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(config.state_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise OptimizerInputError(f"state_dir {config.state_dir} is in use by another optimizer node") from None
        self.files = FileSet(config.direct_io)
        self.order = OrderTracker()
        self.store = StateStore(self.files, self.order, config.ram_budget, config.prefetch)
        self.served = ServedCache(self.files, self.store.fd, config.ram_budget)
        self.param_prefetch = ParamPrefetcher(self.served, config.prefetch)
        self.ckpt: CheckpointManager | None = None
        self.jobs: dict[str, JobRuntime] = {}
        self._cv = threading.Condition()
        self._listeners: list[Callable[[str, int, int], None]] = []
        self._ckpt_listeners: list[Callable[[str, dict], None]] = []
        # ints, but "rejected": a Counter by reason
        self.counts: dict[str, Any] = {"submitted": 0, "published": 0, "saturated_gradients": 0, "listener_errors": 0,
                       "skipped_steps": 0, "rejected": collections.Counter()}
        self.error: BaseException | None = None
        self.closed = False
        self.started = time.monotonic()
        self._make_checkpoints()
        self.pipeline = Pipeline(config, self)

    # -- jobs ------------------------------------------------------------------------------------
    def add_job(self, spec: JobSpec) -> None:
        """Register a job: plan its shards, create their files, set its starting state (version 0)."""
        try:
            self._add_job(spec, self._shard_elems_for(spec), None)
        except OptimizerInputError as e:
            self._reject(e)

    def _shard_elems_for(self, spec: JobSpec) -> int:
        """The job's shard size: `max_shard_elems`, or smaller where the budget needs (budget.py)."""
        if not isinstance(spec, JobSpec):
            return self.config.max_shard_elems  # _add_job says what is wrong
        return budget.shard_elems_for(self.config, [lr.plan for j in self.jobs.values() for lr in j.layers.values()],
                                      spec)

    def _add_job(self, spec: JobSpec, max_shard_elems: int, restore: dict | None) -> None:
        """`restore`: {layer_id: (version, {shard index: record loader})} from a checkpoint."""
        if not isinstance(spec, JobSpec):
            raise OptimizerInputError(f"add_job takes a JobSpec, got {type(spec).__name__}")
        with self._cv:
            self._check_usable()
            if spec.job_id in self.jobs:
                raise OptimizerInputError(f"job {spec.job_id!r} is already on this node")
        plans = [plan_layer(spec, ly, max_shard_elems) for ly in spec.layers]
        self._set_budgets(extra=plans)
        job = JobRuntime(spec, max_shard_elems, {}, {p.layer_id: i for i, p in enumerate(plans)},
                         [p.layer_id for p in plans])
        # predicted arrival order: backward, i.e. descending layer ids
        self.order.set_order(spec.job_id, [s.key for p in sorted(plans, key=lambda p: -p.layer_id) for s in p.shards])
        if restore is None:
            check_initial(plans, spec.initial)  # names and shapes, before any file is made
        building = None  # (plan, served buffer) of the layer being registered
        try:
            for plan in sorted(plans, key=lambda p: -p.layer_id):
                version = 0
                if restore is None:
                    master = initial_master(plan, spec.initial)
                    fillers: list[Filler] = [fresh_filler(s, master) for s in plan.shards]
                else:
                    version, loaders = restore[plan.layer_id]
                    fillers = [record_filler(s, loaders[s.index]) for s in plan.shards]
                buf = self.served.new_buffer(plan)
                building = (plan, buf)
                for shard, fill in zip(plan.shards, fillers):
                    self.store.register(shard, self._state_path(shard), self._with_served(plan, shard, fill, buf))
                self.served.publish(plan, version, buf)
                building = None
                job.layers[plan.layer_id] = LayerRuntime(plan, version=version, next_step=version)
        except BaseException:
            # nothing of a job that failed to register stays: entries, copies, files, budget share
            if building is not None:
                self.served.discard(*building)
            self.store.remove_job(spec.job_id)
            self.served.remove_job(spec.job_id)
            self.order.remove_job(spec.job_id)
            self.files.close_under(self.config.state_dir / spec.job_id)
            if self.jobs:
                self._set_budgets(extra=[])
            raise
        finally:
            self.store.end_registration()
        with self._cv:
            self.jobs[spec.job_id] = job
        if spec.optimizer.name == "adamw" and spec.served_dtype in ("bf16", "fp32"):
            fused.warm_async(spec.served_dtype)  # the kernel loads while the workers start, not in the first step

    def set_initial(self, job_id: str, layer_id: int, values: dict) -> None:
        """Replace a layer's starting parameters before its first step: master weights from
        `values` ({tensor name: fp32 array}, as `JobSpec.initial` gives a layer), optimizer state
        zero, the served copy of version 0 rounded from them. So a job's values can come layer by
        layer after a seeded `add_job`, and the node never holds more than one layer of them
        (`ModelInNetwork`'s hand-over does this: issue 26).

        Raises:
            OptimizerInputError: an unknown job or layer, values of the wrong names or shapes, NaN,
                or a layer that has had a step or a gradient already (nothing is changed).
        """
        try:
            lr = self._layer(job_id, layer_id)[1]
            flat = layer_values(lr.plan, values)
            with self._cv:
                self._check_usable()
                if lr.next_step != 0 or lr.in_flight is not None:
                    raise StepOutOfOrder(f"job {job_id!r} layer {layer_id}: its starting values can be set only "
                                         f"before its first gradient (it is at step {lr.next_step})")
                lr.in_flight = _QUIESCE  # a gradient arriving meanwhile waits in `pending`
        except OptimizerInputError as e:
            self._reject(e)
        try:
            buf = self.served.new_buffer(lr.plan)
            for shard in lr.plan.shards:
                entry = self.store.acquire(shard.key)
                try:
                    if entry.buf is None:  # acquire() returns it pinned in memory
                        raise AssertionError(f"shard {shard.name()} acquired but not in memory")
                    self._with_served(lr.plan, shard, values_filler(lr.plan, shard, flat), buf)(entry.buf)
                    entry.step = 0
                finally:
                    self.store.release(entry, dirty=True)
            self.served.publish(lr.plan, 0, buf)
        finally:
            with self._cv:
                self._release_layer(lr)

    def _with_served(self, plan: LayerPlan, shard: ShardPlan, fill: Filler, served_buf: np.ndarray) -> Filler:
        def go(buf: np.ndarray) -> int:
            step = fill(buf)
            kernels.publish_copy(plan, served_buf, shard, torch.from_numpy(shard.state_views(buf)[0]))
            return step

        return go

    def _state_path(self, shard: ShardPlan) -> Path:
        return self.config.state_dir / shard.job_id / f"{shard.name()}.state"

    def _set_budgets(self, extra: list[LayerPlan]) -> None:
        state, served = budget.split(self.config, [lr.plan for j in self.jobs.values() for lr in j.layers.values()]
                                     + list(extra))
        self.store.set_budget(state)
        self.served.set_budget(served)

    def _job(self, job_id: str) -> JobRuntime:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"unknown job {job_id!r}; this node has {sorted(self.jobs) or 'no jobs'}")
        return job

    def _layer(self, job_id: str, layer_id: int) -> tuple[JobRuntime, LayerRuntime]:
        job = self._job(job_id)
        lr = job.layers.get(layer_id) if isinstance(layer_id, (int, np.integer)) else None
        if lr is None:
            raise UnknownLayer(f"job {job_id!r} has no layer {layer_id!r} "
                               f"(layers {min(job.layers)}..{max(job.layers)})")
        return job, lr

    def layer_rank(self, job_id: str, layer_id: int) -> int:
        return self.jobs[job_id].rank[layer_id]

    # -- gradients in, parameters out: node_data.py ----------------------------------------------

    # -- listeners -------------------------------------------------------------------------------
    def add_listener(self, callback: Callable[[str, int, int], None]) -> None:
        """callback(job_id, layer_id, version) after each new version is published (from a
        pipeline thread, in version order per layer; keep it short)."""
        self._listeners.append(callback)

    def add_checkpoint_listener(self, callback: Callable[[str, dict], None]) -> None:
        """callback(event, info): "file" per shard file written, "commit" when a manifest is
        committed, "error" when a checkpoint fails."""
        self._ckpt_listeners.append(callback)

    # -- pipeline callbacks ----------------------------------------------------------------------
    def new_served_buffer(self, plan: LayerPlan) -> np.ndarray:
        return self.served.new_buffer(plan)

    def on_published(self, item: LayerStep) -> None:
        version = item.step + 1
        if item.served_buf is None:  # _prepare gave every step its buffer
            raise AssertionError(f"layer {item.plan.layer_id} step {item.step} published without a served copy")
        self.served.publish(item.plan, version, item.served_buf)
        item.served_buf = item.grad = item.grad_t = None
        lr = self._layer(item.job_id, item.plan.layer_id)[1]
        with self._cv:
            lr.version = version
            item.published = True
            if self.ckpt is not None and self.ckpt.wants(item.job_id, item.plan.layer_id, version):
                self.ckpt.capture_layer(item.plan, version)
            self.counts["published"] += 1
            self._cv.notify_all()
        for cb in list(self._listeners):
            try:
                cb(item.job_id, item.plan.layer_id, version)
            except Exception:  # a listener's bug must not stop the pipeline
                self.counts["listener_errors"] += 1
                log.exception("optimizer listener failed")
        with self._cv:
            self._release_layer(lr)

    def _release_layer(self, lr: LayerRuntime) -> None:
        lr.in_flight = None
        if lr.pending:
            lr.in_flight = nxt = lr.pending.popleft()
            self.pipeline.submit(nxt)
        self._cv.notify_all()

    def fail(self, exc: BaseException, where: str) -> None:
        with self._cv:
            if self.error is None:
                self.error = exc
                log.error("optimizer node failed in %s: %r", where, exc)
            self._cv.notify_all()
        self.store.close()
        self.served.close()
        if self.ckpt is not None:
            self.ckpt.fail_all(NodeFailed(f"the node failed: {exc!r}"))

    def failed(self) -> bool:
        return self.error is not None

    def _check_usable(self) -> None:
        if self.error is not None:
            raise NodeFailed(f"the optimizer node failed ({self.error!r}); restore it from a checkpoint")
        if self.closed:
            raise NodeFailed("the optimizer node is closed")

    def _reject(self, e: OptimizerInputError) -> NoReturn:
        self.counts["rejected"][e.reason] += 1
        raise e

    def _emit_ckpt(self, event: str, info: dict) -> None:
        for cb in list(self._ckpt_listeners):
            try:
                cb(event, info)
            except Exception:
                log.exception("checkpoint listener failed")

    # -- waiting and reading state ---------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted gradient is applied and published. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while any(lr.in_flight is not None or lr.pending for j in self.jobs.values() for lr in j.layers.values()):
                self._check_usable()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(min(left, 1.0) if left is not None else 1.0)
        return True

    def layer_state(self, job_id: str, layer_id: int, timeout: float | None = None) -> dict:
        """Copies of a layer's fp32 arrays (by state name), its served copy and version, taken
        between steps."""
        job, lr = self._layer(job_id, layer_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while lr.in_flight is not None:
                self._check_usable()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"layer {layer_id} stayed busy for {timeout} s")
                self._cv.wait(1.0)
            lr.in_flight = _QUIESCE
        try:
            names = job.spec.optimizer.state_names
            out: dict[str, Any] = {n: np.empty(lr.plan.numel, dtype=np.float32) for n in names}
            for shard in lr.plan.shards:
                e = self.store.acquire(shard.key)
                try:
                    if e.buf is None:  # acquire() returns it pinned in memory
                        raise AssertionError(f"shard {shard.name()} acquired but not in memory")
                    for n, v in zip(names, shard.state_views(e.buf)):
                        out[n][shard.elem_lo: shard.elem_lo + shard.numel] = v
                finally:
                    self.store.release(e, dirty=False)
            arr, version = self.served.get((job_id, layer_id))
            out["served"] = arr.copy()
            out["version"] = version
            return out
        finally:
            with self._cv:
                self._release_layer(lr)

    def stats(self) -> dict:
        with self._cv:
            node = {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in self.counts.items()}
            node["error"] = None if self.error is None else repr(self.error)
        return {"node": node, "pipeline": self.pipeline.stats(), "store": self.store.stats(),
                "served": self.served.stats(), "param_prefetch": self.param_prefetch.stats(),
                "io": {**self.files.counters.snapshot(), "direct": self.files.direct},
                "checkpoint": None if self.ckpt is None else self.ckpt.stats(),
                "uptime_s": time.monotonic() - self.started}

    # -- teardown --------------------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued steps (up to `timeout`), pending checkpoints, then stop and delete
        the scratch state files."""
        if self.closed:
            return
        if self.error is None:
            self.wait_idle(timeout)
        if self.ckpt is not None:
            self.ckpt.close(timeout)
        with self._cv:
            self.closed = True
            self._cv.notify_all()
        self.pipeline.close()
        self.param_prefetch.close()
        self.store.close()
        self.served.close()
        self.files.close_all(remove=True)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    def __enter__(self) -> OptimizerNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
