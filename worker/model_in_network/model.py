"""`ModelInNetwork`: train a torch model whose parameters and optimizer live in the network.

    mnn = ModelInNetwork(model, optimizer=luwu.AdamW(lr=3e-4), network=job_network)
    loss = loss_fn(mnn(x), y); loss.backward(); mnn.step()

FSDP-like, but the shards are on optimizer nodes: the model is cut into units (units.py); a
unit's parameters are pulled just before its forward (prefetched one or more units ahead) and
freed after it; before its backward they are pulled again (unless kept, or unless its backward
needs no parameters); as soon as its gradients are accumulated they are pushed (whole, or per
slice where the controller cut the layer for several nodes: routes.py), summed by the switch into
the node, and freed. On a rail-only plan the server's ranks reduce-scatter each gradient over
NVLink before the push and all-gather each pulled unit after the pull (hierarchy.py). `step()` waits for the pushes and advances the version:
the node's optimizer has already run, layer by layer, while backward went on. A worker holds
no optimizer state and only the units in flight. Tied parameters: the unit's other modules (sites)
pull it for each use; a forward recomputed in backward (checkpointing) pulls it again (README.md).

This module is the wrapper's public API (construction and the start barrier, `step()`, the
nn.Module surface, saving, `close()`); the hooks that pull, free and push around each unit are
hooks.py (`UnitHooks`, mixed in).
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import tempfile
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from luwu.dataplane.engine.config import GRAD_FORMATS
from luwu.dataplane.engine.handles import Handle
from luwu.dataplane.observe import trace
from luwu.worker import metrics as worker_metrics
from luwu.worker.engine_link import Staging, open_engine

from .checkpoint_io import meta_model_from_pretrained, pull_unit
from .checkpoint_io import save_pretrained as save_units
from .devices import HostStage, claim_devices
from .flat import FlatParams, pull_bits
from .hierarchy import ServerSteps
from .hooks import UnitHooks
from .inflight import ArrivingGrads, issued
from .job import REPORT_TIMEOUT, barrier, fingerprint, hand_over, join, names_join_failures, node_jobs, report_failure
from .materialize import Materializer
from .memory import MemoryTracker, return_freed_memory
from .network import JobNetwork
from .optimizers import OptimizerSpec, as_optimizer_spec
from .reporting import report, skipped_steps
from .routes import PlanError, Route, plan_routes
from .schedule import PullSchedule, use_phase
from .staging import StagingPool
from .units import split_units
from .watch import SavedWatch

if TYPE_CHECKING:  # annotations only: torch.distributed and the engine client load where used
    from torch.distributed import Store

    from luwu.dataplane.engine import Engine
    from luwu.dataplane.engine.client import EngineClient

DEFAULT_TIMEOUT = 300.0  # s a pull or push may take before the worker gives up (shared, slow machines)
END_BARRIER_TIMEOUT = 60.0  # s close() waits for the other workers to close too


class ModelInNetwork(UnitHooks, nn.Module):
    """Wraps `model` (a plain nn.Module) for training with parameters in the network.

    Every rank of the job constructs one with the same model and optimizer; rank 0 hands the
    units' initial values and the optimizer spec to the optimizer nodes, and all ranks wait at a
    start barrier. Afterwards call it like the model, `backward()` the loss, then `step()`.

    Args:
        model (nn.Module): the model; its parameters are moved to the nodes and freed here. They
            may be float32, bfloat16 or float16 (one dtype per unit), all on one device (CPU,
            CUDA or another torch device): the worker computes in their dtype on their device.
            The nodes keep fp32 master weights whatever it is: a bf16 model trains with fp32
            masters, as mixed precision does, and its gradients travel as float32.
        optimizer: the optimizer the nodes run, e.g. ``luwu.AdamW(lr=3e-4, weight_decay=0.1)``.
        network (JobNetwork or str): this worker's view of the job (or its JSON), from
            ``JobNetwork.from_star`` (loopback) or ``JobNetwork.from_controller``.
        units (optional): modules or module paths to cut the model at (default: the
            containers' children, see units.py).
        keep_last (int): units at the end of forward kept resident for backward.
        keep_budget (int, optional): at most this many bytes of kept units.
        prefetch (int): timeline entries pulled ahead of the one being computed.
        served_dtype (str): how the nodes serve parameters: "bf16", "fp16" or "fp32". The worker
            rounds what it pulls to the parameters' dtype: exact when this is their dtype (bf16 for
            a bf16 model, fp16 for a fp16 one); a fp16 model served bf16 computes with 8
            significant bits instead of 11 (README.md, "Dtypes and devices").
        engine: "process" (an engine daemon beside this process), "embedded", or a running
            Engine / EngineClient.
        grad_format (str, optional): how gradients cross the network: "fixed32" (32-bit lanes,
            an exponent per packet, ~4 B per parameter) or "fixed16" (16-bit values, an exponent
            per 112 elements, ~2.06 B per parameter; docs/protocol.md 5.2). Every rank of the job must
            pass the same. Default: the engine's (`LUWU_GRAD_FORMAT`, else fixed32).
        store (optional): a c10d Store for the start barrier (else an allreduce through the engine).
            Required on a rail-only plan: the NVLink channel's ranks find each other through it.
        p2p_host (str): the address this rank's NVLink channel listens on (rail-only plans only: the
            server's ranks reduce-scatter gradients and all-gather parameters over it).
        max_inflight_pushes (int): gradient pushes in flight before backward waits.
        timeout (float): seconds a pull or push may take before this raises.
        start_version (int): the version training starts at (0; k to resume from optimizer nodes
            restored from a checkpoint of version k, `luwu node --restore`): the first pull is of
            version k and the first push is the gradient of step k. Every worker passes the same value.
        init_from (str, optional): a `save_pretrained` safetensors directory the initial values
            are streamed from, tensor by tensor, unit by unit (checkpoint_io.py).
        seed (int): a model built on the meta device is initialised by the network: unit i by its
            modules' own init under ``torch.manual_seed(seed + i)``, on the rank that hands the
            nodes their layers, one unit at a time (materialize.py). Every worker passes the same.
        device (optional): where a meta-built model computes (default: the CPU).

    Examples:
        >>> net = JobNetwork.from_json(os.environ["LUWU_JOB_NETWORK"])  # doctest: +SKIP
        >>> mnn = ModelInNetwork(model, optimizer=luwu.AdamW(lr=3e-4), network=net)
        >>> loss = loss_fn(mnn(x), y); loss.backward(); mnn.step()
    """

    @names_join_failures  # a rank that fails before the start barrier is named on every other rank (job.py)
    def __init__(self, model: nn.Module, optimizer: OptimizerSpec | dict[str, Any], network: JobNetwork | str, *,
                 units: list[Any] | None = None, keep_last: int = 1, keep_budget: int | None = None, prefetch: int = 1,
                 served_dtype: str = "bf16", engine: str | Engine | EngineClient = "process", store: Store | None = None,
                 max_inflight_pushes: int = 2, timeout: float = DEFAULT_TIMEOUT, start_version: int = 0,
                 p2p_host: str = "127.0.0.1", init_from: str | os.PathLike | None = None, seed: int = 0,
                 device: str | torch.device | None = None, grad_format: str | None = None) -> None:
        super().__init__()
        if grad_format is not None and grad_format not in GRAD_FORMATS:
            raise ValueError(f"grad_format {grad_format!r}: choose one of {', '.join(GRAD_FORMATS)}")
        self.module = model
        self.optimizer = as_optimizer_spec(optimizer)
        self.network = JobNetwork.from_json(network) if isinstance(network, str) else network
        self.rank = self.network.rank
        self.world_size = self.network.world_size
        self.timeout = timeout
        self.served_dtype = served_dtype
        if int(start_version) < 0:
            raise ValueError(f"start_version must be >= 0, got {start_version}")
        self.version = int(start_version)
        self.memory = MemoryTracker()
        return_freed_memory()  # freed units, gradients, activations leave the process (memory.py)
        self.init = Materializer.for_model(model, init_from, seed, device)  # meta-built or a checkpoint; else None
        self.units = split_units(model, units)
        self._pull_stage, self._push_stage = HostStage(self.memory), HostStage(self.memory)  # non-CPU devices
        self.flats = (self.init.flats(self.units, self.memory, self._pull_stage) if self.init is not None else
                      [FlatParams(u, self.memory, self._pull_stage) for u in self.units])
        # SharedDeviceError: another rank of this job computes on the same GPU in this process (devices.py)
        self._release_devices = claim_devices(self.network.job_id, self.rank, {f.flat.device for f in self.flats})
        self.local_size = self.network.local_size  # > 1: rail-only, hierarchical push/pull
        self.routes: dict[int, Route] = plan_routes(self.units, self.network)  # PlanError: cannot be honoured
        if self.local_size > 1 and store is None:
            raise PlanError(f"this job sums its {self.world_size} ranks in {self.local_size} rails: ModelInNetwork "
                            "reduce-scatters and all-gathers over the server's NVLink, whose ranks find each other "
                            "through a c10d store; pass store=")
        sliced = [self.units[i].label() for i, r in self.routes.items() if not r.whole]
        if sliced and self.optimizer.clip_grad_norm is not None:  # a node would clip by the norm of its slices only
            raise PlanError(f"units {sliced[:4]} are cut into slices for several optimizer nodes (a controller's "
                            "shard map or rail-only), so no node sees their whole gradient: clip_grad_norm cannot be "
                            "computed there; train without gradient clipping, or with one node and no rails")
        self.placement = {i: r.pieces[0].node for i, r in self.routes.items() if r.pieces}  # unit -> (first) node
        self.session_of = {i: r.pieces[0].session for i, r in self.routes.items() if r.pieces}
        self._wire_bytes = {i: 4 * sum(p.numel for p in r.pieces) for i, r in self.routes.items()}  # a push's or pull's
        self._pull_dtype = {u.index: np.uint16 if pull_bits(u, served_dtype) else np.float32 for u in self.units}
        self.server: ServerSteps | None = None
        self.keep_last, self.keep_budget = keep_last, keep_budget
        self.keep = self._keep_set([u.index for u in self.units])
        self.stats: collections.Counter[str] = collections.Counter()
        self.wait_seconds: collections.defaultdict[str, float] = collections.defaultdict(float)  # kind -> s waited
        self._p2p_host = p2p_host
        self._workdir = tempfile.mkdtemp(prefix="luwu-mnn-")  # its engine's socket and log; removed by a clean close()
        self.engine = open_engine(engine, self.network.endpoint, self._workdir)
        self.engine.grad_format = grad_format
        worker_metrics.track(f"rank{self.rank}-model_in_network", self.engine, self.rank)  # LUWU_METRICS
        self.pool = StagingPool(self.engine, max(u.numel for u in self.units), self.memory)
        self.max_inflight_pushes = max(1, max_inflight_pushes)
        self.schedule = PullSchedule([u.index for u in self.units], self.keep, prefetch, self._issue_pull)
        self._pushes: collections.deque[tuple[int, Handle, Staging]] = collections.deque()  # in push order
        self._grad: dict[int, ArrivingGrads | None] = {u.index: None for u in self.units}  # unit -> its gradients arriving
        self._pushed: dict[int, int] = {}  # unit -> version its gradient was pushed for
        self._saving: dict[int, str] = {}  # unit -> how its forward with autograd on learns what it saves (watch.py)
        self._watch = SavedWatch()
        self._spans: dict[tuple[str, int], trace.OpenSpan] = {}  # open timeline events (luwu.dataplane.observe.trace)
        self._observed: list[int] = []
        self._hooks: list[RemovableHandle] = []
        self.closed = False
        self._store = store
        self._started = False  # past the start barrier: close() then waits for every rank (job.py)
        self._failed = False  # a pull or push failed: close() does not wait for the others
        try:
            self._start(store)
        except BaseException:
            self.close()
            raise
        self._install_hooks()

    # -- setup --------------------------------------------------------------------------------
    def _keep_set(self, order: list[int]) -> set[int]:
        """The last `keep_last` units of forward order, within `keep_budget` bytes; never a unit with
        sites (tied parameters: pulled for each use)."""
        keep, used = set(), 0
        for uid in reversed(order[max(0, len(order) - self.keep_last):] if self.keep_last > 0 else []):
            if self.units[uid].sites:
                continue
            elif self.keep_budget is not None and used + self.units[uid].nbytes > self.keep_budget:
                break
            keep.add(uid)
            used += self.units[uid].nbytes
        return keep

    def _start(self, store: Store | None) -> None:
        if self.local_size > 1:  # the server's NVLink channel, before anything moves
            self.server = ServerSteps(store, self.network.job_id, self.rank, self.world_size, self.local_size,
                                      self._p2p_host, self.timeout)
        try:
            if self.rank < self.local_size:  # the first rank of its group (rail) hands that group's nodes their layers
                initial = (functools.partial(self.init.values, self.units, self.flats) if self.init is not None else
                           lambda i: self.flats[i].flat.detach().to("cpu", torch.float32, copy=True).numpy())
                jobs = node_jobs(self.network.job_id, self.optimizer, self.units, self.routes, initial,
                                 self.served_dtype)
                hand_over(jobs, self.network.node_sessions, self.network.node_controls, self.world_size,
                          self.timeout, self.network.control_token)
            for f in self.flats:
                f.free()
        except Exception as e:  # joined with the error: every other rank raises JoinError naming this one
            self._join_attempted = True
            report_failure(self.network.job_id, self.rank, self.world_size, store, self.engine,
                           min(self.timeout, REPORT_TIMEOUT), e)
            raise
        self._join_attempted = True
        join(self.network.job_id, self.rank, self.world_size, store, self.engine, self.timeout,
             model=fingerprint(self.units))
        self._started = True
        self.setup_memory = self.memory.snapshot()  # the units made here before training (materialize.py)
        self.memory.reset_peak()  # the peak is over training; the caller built the whole model before
        self.schedule.prefetch_next_pass(self.version)

    # -- the hooks around each unit (pull, free, push): hooks.py, UnitHooks --------------------------

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> int:
        """Wait for this step's pushes, then move to the next version. Returns the new version."""
        if not any(v == self.version for v in self._pushed.values()):
            raise RuntimeError("step() without a backward pass: there is no gradient to send")
        for u in self.units:  # units backward never reached (unused this step): every rank pushes them in order
            if self._pushed.get(u.index) != self.version:
                if self._grad[u.index] is None:
                    self._grad[u.index] = ArrivingGrads(self._push_staging(), u)
                self._push(u.index)
        while self._pushes:
            self._finish_oldest_push()
        for f in self.flats:
            f.free()
        for t in self.schedule.drain():
            handle, staging = issued(t)
            try:
                self._wait(handle, f"prefetched pull of unit {self.units[t.unit].label()}", "pull")
            finally:
                self.pool.release(staging)
        self._learn_order()
        self.version += 1
        self.stats["steps"] += 1
        self.schedule.prefetch_next_pass(self.version)
        return self.version

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients leave the worker as soon as they are complete."""

    def _learn_order(self) -> None:
        """Forward order as observed (registration order is only the first guess); every rank
        observes the same, so the pull policy stays identical."""
        seen = list(dict.fromkeys(self._observed))
        if sorted(seen) != sorted(self.schedule.order):
            return
        if seen != self.schedule.order:
            self.schedule.order = seen
            self.keep = self.schedule.keep = self._keep_set(seen)
            self.stats["order_changes"] += 1
        # every use of a unit is a timeline entry; backward in reverse order of last use (a tied head's embedding first)
        self.schedule.uses = [(u, use_phase(self._observed[:i].count(u))) for i, u in enumerate(self._observed)]
        self.schedule.last_use = list(dict.fromkeys(reversed(self._observed)))[::-1]

    # -- nn.Module surface --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise RuntimeError("this ModelInNetwork was closed")
        return self.module(*args, **kwargs)

    def gather(self) -> dict[str, torch.Tensor]:
        """The model's trainable parameters at the current version, by name, in their dtype on
        their device (the node's served copies, rounded to the parameters' dtype as a pull is).
        A collective: every rank calls it at the same point, since pulls are matched across workers."""
        return {k: v for u in self.units for k, v in pull_unit(self, u).items()}

    def save_pretrained(self, path: str | os.PathLike, rank: int = 0) -> os.PathLike | None:
        """Write the model at the current version as a `save_pretrained` directory (one safetensors
        file per unit, its index, config.json), pulling one unit at a time: `from_pretrained(path)`
        loads it. A collective like `gather()`; rank `rank` writes (checkpoint_io.py).

        Returns:
            The directory on the writing rank, None on the others.

        Examples:
            >>> mnn.save_pretrained("out/")  # doctest: +SKIP  (every rank)
            >>> AutoModelForCausalLM.from_pretrained("out/")  # doctest: +SKIP
        """
        return save_units(self, path, rank)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, optimizer: OptimizerSpec | dict[str, Any],
                        network: JobNetwork | str, **kwargs: Any) -> ModelInNetwork:
        """The `transformers` model of a `save_pretrained` directory, built on the meta device and
        streamed to the nodes unit by unit (`init_from=path`): no worker holds it whole.

        Examples:
            >>> mnn = ModelInNetwork.from_pretrained("ckpt/", luwu.AdamW(lr=3e-4), net)  # doctest: +SKIP
        """
        return cls(meta_model_from_pretrained(path), optimizer, network, init_from=path, **kwargs)

    def skipped_steps(self) -> dict[int, list[str]]:
        """The steps the optimizer nodes skipped for some unit because its summed gradient held
        inf or NaN (a rank's overflow or NaN), as torch's GradScaler skips a step: that unit's
        parameters and optimizer state stayed as they were, its version advanced, training went on.

        Returns:
            {step (0-based: version step + 1 repeats version step's parameters): unit labels},
            the latest 1024 steps that had one; {} when nothing was skipped.

        Raises:
            ControlError: a node's control channel cannot be reached (its address is in the network
            description only where this rank was given it).

        Example::

            loss.backward(); mnn.step()
            if mnn.skipped_steps():      # e.g. {41: ["blocks.3"]}
                scaler_like_backoff()
        """
        return skipped_steps(self)

    def report(self) -> dict:
        """Counters, time spent waiting on the network, memory, the engine's traffic, and the
        steps the nodes skipped for non-finite gradients (`skipped_steps()`, when the nodes'
        control channels are known)."""
        return report(self)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        release = getattr(self, "_release_devices", None)
        if release is not None:
            release()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        worker_metrics.untrack(f"rank{self.rank}-model_in_network")
        if getattr(self, "_started", False) and not getattr(self, "_failed", True):
            # leave together: a node paces its parameters by every worker's heartbeats, so a rank
            # whose engine stopped early would stall another rank's last pulls (gather, say)
            try:
                barrier(self.network.job_id, self.world_size, self._store, engine, END_BARRIER_TIMEOUT, "end")
            except Exception as e:  # noqa: BLE001 - closing anyway; say why the others may stall
                warnings.warn(f"rank {self.rank}: the other workers did not reach close() within "
                              f"{END_BARRIER_TIMEOUT:g} s ({e}); closing this engine anyway", stacklevel=2)
        engine.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
        if not getattr(self, "_failed", True):  # after a failure the engine's log stays for the error naming it
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> ModelInNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort when a caller forgets close()
        try:
            self.close()
        except Exception:
            pass

