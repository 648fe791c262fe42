"""The node's data path (a mixin of OptimizerNode, node.py): gradients in, parameters out.

`submit_gradient` (a trainer's call) and `gradient_sink(job, n)` (the engine's GradientSink shape)
queue a layer's summed gradient for its next optimizer step; `params` / `wait_version` block
until a version is published, `lookup` and `provider(job)` (the engine's ParamProvider shape)
do not. This package never imports the engine: the shapes are declared here as Protocols.

Input errors raise `OptimizerInputError` subclasses synchronously and are counted by reason
(`_reject`); on the engine's loop (`gradient_sink`) they are counted and logged instead, and a
non-finite sum skips the layer's step as torch's GradScaler would.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np
import torch

from .errors import BadGradient, NonFiniteGradient, OptimizerInputError, StepOutOfOrder, UnknownJob, UnknownLayer
from .job_state import JobRuntime, LayerRuntime
from .layout import LayerPlan
from .pipeline import LayerStep

if TYPE_CHECKING:
    from luwu.dataplane.protocol import Dtype

    from .order import OrderTracker
    from .param_prefetch import ParamPrefetcher
    from .pipeline import Pipeline
    from .served import ServedCache

log = logging.getLogger("luwu.optimizer")
WIRE_DTYPE_NAMES = {"bf16": "BF16", "fp16": "FP16", "fp32": "FP32"}  # luwu.dataplane.protocol.Dtype member names
SKIP_HISTORY = 1024  # steps with a skipped layer remembered per job (skipped_steps())


class ParamProvider(Protocol):
    """The engine's ParamProvider shape (`OptimizerNode.provider`; this package never imports the engine)."""

    def lookup(self, tensor: int, version: int) -> tuple[np.ndarray, Dtype] | None: ...


class DataPathMixin:
    if TYPE_CHECKING:  # what the mixin uses of OptimizerNode (node.py), declared for the type checker
        jobs: dict[str, JobRuntime]
        order: OrderTracker
        served: ServedCache
        param_prefetch: ParamPrefetcher
        pipeline: Pipeline
        counts: dict[str, Any]
        _cv: threading.Condition

        def _job(self, job_id: str) -> JobRuntime: ...
        def _layer(self, job_id: str, layer_id: int) -> tuple[JobRuntime, LayerRuntime]: ...
        def _check_usable(self) -> None: ...
        def _reject(self, e: OptimizerInputError) -> NoReturn: ...

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
