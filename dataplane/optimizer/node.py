"""The optimizer node's core: jobs, the gradient/parameter API, versions, listeners, checkpoints.

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
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np
import torch

from luwu.dataplane import kernels as kernel_mode

from . import budget, fused, kernels
from .checkpoint import CheckpointManager
from .errors import (
    BadGradient,
    NodeFailed,
    NonFiniteGradient,
    OptimizerInputError,
    StepOutOfOrder,
    UnknownJob,
    UnknownLayer,
)
from .initial import Filler, check_initial, fresh_filler, initial_master, layer_values, record_filler, values_filler
from .job_state import JobRuntime, LayerRuntime
from .layout import LayerPlan, ShardPlan, plan_layer
from .node_checkpoints import CheckpointMixin
from .order import OrderTracker
from .param_prefetch import ParamPrefetcher
from .pipeline import LayerStep, Pipeline
from .served import ServedCache
from .shard_file import FileSet
from .spec import JobSpec, NodeConfig
from .store import StateStore

if TYPE_CHECKING:
    from luwu.dataplane.protocol import Dtype

log = logging.getLogger("luwu.optimizer")
WIRE_DTYPE_NAMES = {"bf16": "BF16", "fp16": "FP16", "fp32": "FP32"}  # luwu.dataplane.protocol.Dtype member names
_QUIESCE = object()  # in_flight marker while a caller reads a layer's state
SKIP_HISTORY = 1024  # steps with a skipped layer remembered per job (skipped_steps())


class ParamProvider(Protocol):
    """The engine's ParamProvider shape (`OptimizerNode.provider`; this package never imports the engine)."""

    def lookup(self, tensor: int, version: int) -> tuple[np.ndarray, Dtype] | None: ...


class OptimizerNode(CheckpointMixin):
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

    # -- gradients in ----------------------------------------------------------------------------
    def submit_gradient(self, job_id: str, layer_id: int, step: int, grad: np.ndarray | torch.Tensor,
                        contributors: int = 1, saturated: bool = False, finite: bool = False) -> None:
        """Queue layer `layer_id`'s summed gradient for step `step`; the optimizer steps the layer
        in the background and publishes version `step + 1`.

        Args:
            job_id (str): the job (added with `add_job`).
            layer_id (int): the layer.
            step (int): 0-based; must be the layer's next step.
            grad: flat float32 (numpy or CPU torch), the sum over `contributors` workers. The node
                owns it until that version is published and may scale it in place.
            contributors (int): how many workers summed into `grad`; the node applies their mean
                (1 = use as is).
            saturated (bool): the network's fixed-point sum saturated (counted in
                ``counts["saturated_gradients"]``); the values are checked like any others.
            finite (bool): the caller guarantees no NaN/Inf (a fixed-point sum from the network
                that no contributor saturated is finite by construction), which saves a read pass.

        Returns:
            None, once the step is queued; `params` (blocking) or a listener (`add_listener`)
            tells when the new version is published. A layer of at most `NodeConfig.inline_elems`
            elements whose state is in RAM is stepped and published before this returns (on the
            caller's thread, listeners included).

        Raises:
            OptimizerInputError: (counted by reason) an unknown job or layer, a step out of order,
                a gradient of the wrong shape or dtype, or NaN/Inf (NonFiniteGradient); nothing
                is applied and the caller may submit the step again. (The network path,
                `gradient_sink`, skips a non-finite step instead, as torch's GradScaler would.)

        Examples:
            >>> node.submit_gradient("job", 3, step, grad, contributors=4)  # doctest: +SKIP
            >>> new_params = node.params("job", 3, step + 1, timeout=60)
        """
        try:
            self._submit(job_id, layer_id, step, grad, contributors, saturated, finite)
        except OptimizerInputError as e:
            self._reject(e)

    def _submit(self, job_id: str, layer_id: int, step: int, grad: np.ndarray | torch.Tensor, contributors: int,
                saturated: bool, finite: bool = False, skip_non_finite: bool = False) -> None:
        job, lr = self._layer(job_id, layer_id)
        skip = False
        try:
            g = self._check_gradient(job_id, lr.plan, grad, finite)
        except NonFiniteGradient as e:
            if not skip_non_finite:
                raise
            skip, g = True, None
            log.warning("skipping step %s of job %r layer %s: %s (the version advances with the parameters and "
                        "optimizer state unchanged, as torch's GradScaler skips a step)", step, job_id, layer_id, e)
        if not isinstance(contributors, (int, np.integer)) or contributors < 1:
            raise BadGradient(f"contributors must be an integer >= 1, got {contributors!r}")
        if not isinstance(step, (int, np.integer)):
            raise StepOutOfOrder(f"step must be an integer, got {step!r}")
        with self._cv:
            self._check_usable()
            if step != lr.next_step:
                raise StepOutOfOrder(f"job {job_id!r} layer {layer_id}: got step {step}, expected step {lr.next_step} "
                                     f"(steps are 0-based and each is submitted once, in order)")
            lr.next_step += 1
            item = LayerStep(job_id, job.spec.optimizer, lr.plan, int(step), g, int(contributors), len(job.layers),
                             skip=skip)
            if skip:
                self.counts["skipped_steps"] += 1
                job.skipped.setdefault(int(step), []).append(lr.plan.layer_id)
                while len(job.skipped) > SKIP_HISTORY:
                    del job.skipped[min(job.skipped)]
            self.counts["submitted"] += 1
            self.counts["saturated_gradients"] += bool(saturated)
            self._note_arrival(job, int(step), lr.plan.layer_id)
            start = lr.in_flight is None
            if start:
                lr.in_flight = item
            else:
                lr.pending.append(item)
        if start:  # outside the lock: a small layer in RAM is stepped right here (Pipeline.submit_inline)
            self.pipeline.submit_inline(item)

    def _check_gradient(self, job_id: str, plan: LayerPlan, grad: object, finite: bool = False) -> np.ndarray:
        where = f"job {job_id!r} layer {plan.layer_id}"
        if isinstance(grad, torch.Tensor):
            if grad.device.type != "cpu" or grad.dtype != torch.float32:
                raise BadGradient(f"{where}: gradient must be a CPU float32 tensor, got {grad.dtype} on {grad.device}")
            grad = grad.detach().numpy()
        if not isinstance(grad, np.ndarray):
            raise BadGradient(f"{where}: gradient must be a numpy array or torch tensor, got {type(grad).__name__}")
        if grad.dtype != np.float32:
            raise BadGradient(f"{where}: gradient dtype is {grad.dtype}, expected float32")
        if grad.size != plan.numel:
            raise BadGradient(f"{where}: gradient has {grad.size} elements, the layer has {plan.numel}")
        if not grad.flags.c_contiguous or not grad.flags.writeable:
            raise BadGradient(f"{where}: gradient must be a C-contiguous, writeable array")
        g = grad.reshape(-1)
        # one read pass; a sum is finite iff every element is (unless finite values overflow float32 when summed)
        if not finite and not math.isfinite(float(torch.sum(torch.from_numpy(g)))):
            raise NonFiniteGradient(f"{where}: gradient has NaN or Inf (or values too large to sum in float32)")
        return g

    def _note_arrival(self, job: JobRuntime, step: int, layer_id: int) -> None:
        arr = job.arrivals.setdefault(step, [])
        arr.append(layer_id)
        if len(arr) == len(job.layers):
            del job.arrivals[step]
            keys = [s.key for lid in arr for s in job.layers[lid].plan.shards]
            if keys != self.order.order(job.spec.job_id):
                self.order.set_order(job.spec.job_id, keys)

    def gradient_sink(self, job_id: str, contributors: int) -> Callable[[int, np.ndarray, bool], None]:
        """The engine's GradientSink shape: (tensor, summed gradient, saturated), each tensor's
        gradients in step order. Runs on the engine's loop, so a bad gradient is counted (in
        stats()["node"]["rejected"]), logged and dropped rather than raised into the loop; a
        failed node still raises NodeFailed. A non-finite sum (a contributor's inf/NaN or
        overflow: the engine delivers those chunks as NaN) skips the layer's step like torch's
        GradScaler: the version advances with the parameters and optimizer state unchanged, so
        the workers' pulls complete; `skipped_steps()` and stats()["node"]["skipped_steps"] say so."""
        def sink(tensor: int, grad: np.ndarray, saturated: bool) -> None:
            try:
                with self._cv:
                    step = self._layer(job_id, tensor)[1].next_step
                # the engine flags a sum that may hold non-finite values as saturated (node_server.py)
                try:
                    self._submit(job_id, tensor, step, grad, contributors, saturated, not saturated,
                                 skip_non_finite=True)
                except OptimizerInputError as e:
                    self._reject(e)
            except OptimizerInputError as e:
                if isinstance(e, (UnknownJob, UnknownLayer)):  # _layer raised before submit could count it
                    self.counts["rejected"][e.reason] += 1
                log.warning("dropped a gradient of job %r tensor %s: %s", job_id, tensor, e)

        return sink

    # -- parameters out --------------------------------------------------------------------------
    def params(self, job_id: str, layer_id: int, version: int, timeout: float | None = None) -> np.ndarray:
        """The layer's parameters once it has had `version` optimizer steps (the latest version,
        which is >= `version`): flat, read-only, in the served dtype (bf16 as np.uint16 bits,
        fp16 as np.float16, fp32 as np.float32). Raises TimeoutError after `timeout` seconds."""
        self.wait_version(job_id, layer_id, version, timeout)
        arr = self.served.get((job_id, layer_id))[0]
        job = self.jobs[job_id]
        self.param_prefetch.hint(job_id, job.order, job.rank[layer_id])
        return arr

    def wait_version(self, job_id: str, layer_id: int, version: int, timeout: float | None = None) -> int:
        """Block until the layer has had `version` optimizer steps; returns its version."""
        try:
            _, lr = self._layer(job_id, layer_id)
        except OptimizerInputError as e:
            self._reject(e)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while lr.version < version:
                self._check_usable()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {job_id!r} layer {layer_id}: version {version} not reached within "
                                       f"{timeout} s (at {lr.version})")
                self._cv.wait(left if left is not None else 1.0)
            return lr.version

    def lookup(self, job_id: str, layer_id: int, version: int) -> tuple[np.ndarray, str] | None:
        """Non-blocking: (array, wire dtype name) once `version` is reached, else None."""
        _, lr = self._layer(job_id, layer_id)
        if lr.version < version:
            return None
        return self.served.get((job_id, layer_id))[0], WIRE_DTYPE_NAMES[self.jobs[job_id].spec.served_dtype]

    def provider(self, job_id: str) -> ParamProvider:
        """The engine's ParamProvider shape for one job: lookup(tensor, version) -> (array, Dtype) | None,
        KeyError for a tensor the job does not have."""
        from luwu.dataplane.protocol import Dtype

        node = self
        job = self._job(job_id)
        layers, served, dtype = job.layers, self.served, Dtype[WIRE_DTYPE_NAMES[job.spec.served_dtype]]

        class _Provider:
            # `lookup` without its name lookups (the engine's loop asks once per pull)
            def lookup(self, tensor: int, version: int) -> tuple[np.ndarray, Dtype] | None:
                lr = layers.get(tensor)
                if lr is None:
                    try:
                        node._layer(job_id, tensor)  # raises the error that says why
                    except UnknownLayer as e:
                        raise KeyError(str(e)) from None
                    raise KeyError(f"job {job_id!r} has no layer {tensor!r}")
                if lr.version < version:
                    return None
                return served.get((job_id, tensor))[0], dtype

        return _Provider()

    def version(self, job_id: str, layer_id: int) -> int:
        return self._layer(job_id, layer_id)[1].version

    def skipped_steps(self, job_id: str) -> dict[int, list[int]]:
        """The job's skipped steps: {step (0-based; version step + 1 repeats version step's
        parameters): layer ids}, the latest SKIP_HISTORY steps that had any.

        Example::

            node.skipped_steps("job")    # {3: [0, 2]}: step 3 of layers 0 and 2 met inf/NaN
        """
        job = self.jobs.get(job_id)
        if job is None:
            self._reject(UnknownJob(f"no job {job_id!r} on this node"))
        with self._cv:
            return {s: list(ids) for s, ids in sorted(job.skipped.items())}

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
