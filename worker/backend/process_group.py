"""`LuwuProcessGroup`: a pure-Python torch.distributed process group whose collectives run through the
SmartNIC engine and the switch (docs/architecture.md).

Through in-network aggregation: allreduce, reduce and reduce_scatter (SUM/AVG/MAX/MIN; float32,
bfloat16, float16 via fixed point for sums and exact max/min; small ints exact; int64 SUM exact).
Sparse COO allreduce (SUM): the ranks' entries exchanged exactly and summed on the hosts (sparse.py).
Exact moves over the same engine: broadcast, allgather, all_gather_single (bytes as int32, summed
with zeros that travel as header-only ZERO packets, codec.py), barrier (a 1-element allreduce).
gather, scatter, all_to_all(_single) and send/recv: TCP between ranks (luwu.worker.p2p, direct.py),
each block once, since the switch has no unicast path. On a rail-only plan every allreduce is
hierarchical over the server's ranks (hierarchy.py).

Every collective validates its arguments in the caller's thread (bad dtypes and ops raise at once),
then returns a `LuwuWork`; the scheduler submits it to the engine in call order and completes it.
Tensors on CUDA (or any non-CPU device) go through host buffers (staging.py).
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from luwu.worker import metrics as worker_metrics
from luwu.worker.engine_link import EngineHost, open_engine

from . import cleanup, startup
from . import collectives as C
from .codec import UnsupportedCollective, nbytes, reduction_encoding, tensor_bytes, write_bytes
from .config import BackendConfig
from .diagnostics import LuwuError
from .direct import DirectMoves
from .fallback import ExactFallback
from .fingerprint import Fingerprint, detail
from .plan_source import default_workdir, discard_prestarted_switch, obtain_plan, prestart_switch, release_plan
from .scheduler import Scheduler
from .sparse import sparse_allreduce
from .staging import staged
from .torch_view import TorchView
from .work import LuwuWork

if TYPE_CHECKING:
    from .hierarchy import RailHierarchy

BACKEND_NAME = "luwu"
_GROUP_IDS = itertools.count()  # names the process's groups in its metrics
SMALL_BYTES = 4 << 20  # a collective of at most this many bytes takes the latency path (scheduler.py);
# LUWU_SMALL_BYTES overrides it per process (-1: no latency path, for comparisons)
_env_small = os.environ.get("LUWU_SMALL_BYTES", "").strip()
if _env_small.lstrip("-").isdigit():
    SMALL_BYTES = int(_env_small)
_REDUCE_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM")


def op_name(reduce_op) -> str:
    for name in _REDUCE_OPS:
        cand = getattr(dist.ReduceOp, name, None)
        if cand is not None and reduce_op == cand:
            return name.lower()
    return str(reduce_op)


def _check_tensors(tensors, what: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"luwu {what}: expected tensors, got {type(t).__name__}")
        if t.device.type != "cpu":  # device tensors are staged through host buffers first (staging.py)
            raise UnsupportedCollective(f"luwu {what}: tensor on {t.device} reached the host path unstaged")
        if t.layout != torch.strided:
            raise UnsupportedCollective(f"luwu {what}: {t.layout} tensors are not supported (dense tensors only)")
    return tensors


def _one(tensors, what: str) -> torch.Tensor:
    tensors = _check_tensors(tensors, what)
    if len(tensors) != 1:
        raise ValueError(f"luwu {what}: takes exactly one tensor per call (one per device; CPU has one), "
                         f"got {len(tensors)}")
    return tensors[0]


def _small(tensors: list[torch.Tensor]) -> bool:
    """Whether a collective takes the scheduler's latency path (SMALL_BYTES or less in all)."""
    return sum(t.numel() * t.element_size() for t in tensors) <= SMALL_BYTES


def _describe(t: torch.Tensor) -> str:
    return f"{t.numel()} x {t.dtype}"


class LuwuProcessGroup(TorchView, dist.ProcessGroup):  # TorchView: the device table torch's tools read
    """The luwu process group (what `init_process_group("luwu")` and `new_group` create).

    Args:
        store: the c10d store of the group.
        rank (int), world_size (int): this rank and the group's size.
        timeout (timedelta): deadline of every operation (and of the plan's exchange).
        config (BackendConfig): settings (`BackendConfig.from_env()` when None).
        workdir (str): the work directory whose child processes `startup.prestart_children` launched.
        deferred (bool): return at once and finish the start-up (plan, engine, start barrier) on a
            thread; the group's first operation waits for it and raises its error
            (`init_process_group` does this unless LUWU_EAGER_START=1; docs/backend.md "Start-up").
            False: the start-up runs here and its error is raised here.
    """

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta | None = None,
                 config: BackendConfig | None = None, workdir: str | None = None, deferred: bool = False):
        super().__init__(rank, world_size)
        self._cfg = cfg = config or BackendConfig.from_env()
        self._timeout = timeout if timeout is not None else timedelta(minutes=30)
        self._store = store
        self._closed = False
        self._parts: dict = {}  # what the start-up made: link, sched, p2p, lease (set on its thread)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._start_thread: threading.Thread | None = None
        self._kernels_wait: tuple | None = None  # (lease, link) until the first operation (_work)
        self._workdir = workdir or default_workdir(cfg, rank)  # given: startup.prestart_children launched them
        cleanup.track(self._workdir, temporary=not cfg.workdir)  # removed when the last group closes, or on exit
        # both child processes start now (the switch already did: startup.prestart_children; idempotent
        # for this workdir) and load while the plan is worked out (docs/backend.md "Start-up")
        prestart_switch(rank, cfg, self._workdir)
        try:
            if cfg.engine == "process":
                EngineHost.prestart(self._workdir)
        except BaseException:
            discard_prestarted_switch(self._workdir)
            cleanup.untrack(self._workdir)
            raise
        before = startup.chain(self._started)  # the previous group of this process starts first
        if deferred:
            self._start_thread = threading.Thread(target=self._start_up, args=(before, False),
                                                  name=f"luwu-start-r{rank}", daemon=True)
            self._start_thread.start()
        else:
            self._start_up(before, True)
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())

    # -- start-up (here, or on a thread: deferred) -------------------------------------------------------
    def _start_up(self, before: threading.Event | None, eager: bool) -> None:
        try:
            if before is not None and not before.wait(self._start_deadline()):
                raise LuwuError("an earlier luwu process group of this process did not finish its start-up")
            self._build(self._store if eager else startup.own_client(self._store))
        except BaseException as e:
            self._start_error = e
            self.shutdown()  # stops what was launched for this group (on this thread: no wait on itself)
            self._started.set()
            if eager:
                raise
            return
        self._started.set()

    def _build(self, store) -> None:
        cfg, rank, world_size = self._cfg, self.rank(), self.size()
        self._parts["lease"] = lease = obtain_plan(store, rank, world_size, self._timeout, cfg, self._workdir)
        try:
            if self._closed:
                raise LuwuError("the process group was shut down during its start-up")
            self._parts["link"] = link = open_engine(cfg.engine, lease.plan, self._workdir, cfg.connect_timeout,
                                                     defer_kernels=True)
            from luwu.worker.p2p import P2PChannel

            self._parts["p2p"] = p2p = P2PChannel(store, rank, world_size, cfg.p2p_host, self._timeout)
            self._parts["sched"] = sched = Scheduler(link, lease, f"r{rank}", cfg.watchdog_tick,
                                                     ExactFallback(p2p, rank, world_size),
                                                     DirectMoves(p2p, rank, world_size),
                                                     self._rail_hierarchy(store, lease, p2p, rank, world_size))
            sched.mismatch, sched.shapes = (store, rank, world_size), detail()  # fingerprint.py
            self._probe(sched)
            self._kernels_wait = (lease, link)  # until the user's first operation has completed (_work)
            self._metrics_name = f"rank{rank}-group{next(_GROUP_IDS)}"
            worker_metrics.track(self._metrics_name, link, rank)  # LUWU_METRICS: serve its engine's stats
        except ConnectionRefusedError as e:  # a shared-memory switch port whose rings are gone (UDP: the probe)
            raise LuwuError(f"the switch at {lease.switch_address} is unreachable: {e.strerror}. "
                            f"Check {lease.hint}") from None

    def _start_deadline(self) -> float:
        """Seconds a start-up may take: the plan's exchange (the group's timeout), then the engine."""
        return self._timeout.total_seconds() + 2 * self._cfg.connect_timeout + 60.0

    def _part(self, name: str):
        """A part the start-up makes (waiting for a deferred start-up; its error raised here)."""
        if not self._started.is_set():
            if self._start_thread is threading.current_thread():
                return self._parts.get(name)
            if not self._started.wait(self._start_deadline()):
                raise LuwuError(f"luwu: the process group's start-up did not finish within "
                                f"{self._start_deadline():.0f} s (rank {self.rank()}); its logs: {self._workdir}")
        if self._start_error is not None:
            raise LuwuError(f"luwu: this process group could not start: {self._start_error}") \
                from self._start_error
        return self._parts.get(name)

    @property
    def _link(self):
        return self._part("link")

    @property
    def _sched(self):
        return self._part("sched")

    @property
    def _p2p(self):
        return self._part("p2p")

    @property
    def _lease(self):
        return self._part("lease")

    def _rail_hierarchy(self, store, lease, p2p, rank: int, world_size: int) -> RailHierarchy | None:
        k = lease.local_size
        if k <= 1:
            return None
        from .hierarchy import RailHierarchy, check_rails  # rail-only plans only (its rails module: ~5 ms of CPU)

        check_rails(store, rank, world_size, k, [s.session for s in lease.plan.sessions if s.kind == "collective"],
                    self._timeout.total_seconds())
        return RailHierarchy(p2p, rank, world_size, k, self._timeout.total_seconds())

    # -- identity ----------------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    # c10d names groups through these (init_process_group / new_group set them, destroy_process_group
    # reads the name back); the C++ defaults keep the name in registered backends, which a process
    # group written in Python does not have ("ProcessGroup name not set")
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    @property
    def plan_source(self) -> str:
        return self._lease.source

    @property
    def workdir(self) -> str:
        return self._workdir

    # -- plumbing ----------------------------------------------------------------------------------------
    def _work(self, name: str, outputs: list[torch.Tensor], start, fp: Fingerprint | None = None,
              small: bool = False) -> LuwuWork:
        sched = self._sched  # waits for a deferred start-up; raises its error
        if self._closed:
            raise LuwuError(f"luwu {name}: the process group has been shut down")
        work = LuwuWork(name, outputs, self._timeout.total_seconds())
        work.fingerprint = fp  # every rank's must agree (fingerprint.py)
        work.small = small and SMALL_BYTES >= 0  # the scheduler's latency path (scheduler.py)
        kernels, self._kernels_wait = self._kernels_wait, None
        if kernels is not None:  # the first: the compiled kernels load once it is done
            work._done_future.add_done_callback(lambda _: self._after_startup(*kernels))
        return sched.run(work, start)

    def _probe(self, sched: Scheduler) -> None:
        """A barrier at start-up, so that an unreachable switch is reported by the start-up."""
        work = LuwuWork("startup barrier", [], self._cfg.connect_timeout)
        work.probe = True
        work.fingerprint = Fingerprint("barrier", [], 0)
        sched.run(work, lambda ctx: C.barrier(ctx))
        sched._seq = 0  # the user's first collective is #0, as torch's wrapper numbers them
        work.wait()

    def _after_startup(self, lease, link) -> None:
        """The start-up and the user's first operation are over: the switch process rank 0 started
        and an embedded engine may load their compiled kernels now (they defer them, at most a few
        seconds, so that numba's import, which holds the GIL of their process, competes with neither:
        docs/backend.md "Start-up"). The switch's in a thread: nothing waits for its answer."""
        link.startup_over()
        switch = lease.switch
        if switch is not None:
            threading.Thread(target=switch.load_kernels, name="luwu-switch-kernels", daemon=True).start()

    # -- reductions through the switch ------------------------------------------------------------------
    @staged(outputs=(0,))
    def allreduce(self, tensors, opts=None):
        tensors = list(tensors)
        op = op_name(opts.reduceOp) if opts is not None else "sum"
        if any(isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo for t in tensors):
            if len(tensors) != 1:
                raise ValueError(f"luwu allreduce: a sparse tensor is reduced alone, got {len(tensors)} tensors")
            return sparse_allreduce(self, tensors[0], op)  # an exact exchange summed on the hosts (sparse.py)
        tensors = _check_tensors(tensors, "allreduce")
        encs = [reduction_encoding(t.dtype, op, "allreduce") for t in tensors]
        name = f"allreduce({', '.join(_describe(t) for t in tensors)}, {op.upper()})"
        return self._work(name, tensors, lambda ctx: C.reduce_tensors(ctx, tensors, encs, op, True, self.size(),
                                                                          self.rank()),
                          Fingerprint.of("all_reduce", tensors, op), small=_small(tensors))

    @staged(outputs=(0,))
    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    @staged(outputs=(0,))
    def reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        op = op_name(opts.reduceOp)
        enc = reduction_encoding(t.dtype, op, "reduce")
        keep = self.rank() == opts.rootRank
        return self._work(f"reduce({_describe(t)}, {op.upper()}, root {opts.rootRank})", [t],
                          lambda ctx: C.reduce_tensors(ctx, [t], [enc], op, keep, self.size(), self.rank()),
                          Fingerprint.of("reduce", [t], op, opts.rootRank), small=_small([t]))

    @staged(outputs=(0,))
    def reduce_scatter(self, outputs, inputs, opts):
        out = _one(outputs, "reduce_scatter")
        ins = _check_tensors(inputs[0] if len(inputs) == 1 else [], "reduce_scatter")
        if len(inputs) != 1 or len(ins) != self.size():
            raise ValueError(f"luwu reduce_scatter: needs one input list of {self.size()} tensors (one per rank)")
        for i, t in enumerate(ins):
            if t.numel() != out.numel() or t.dtype != out.dtype:
                raise ValueError(f"luwu reduce_scatter: input {i} is {_describe(t)} but the output is {_describe(out)}")
        op = op_name(opts.reduceOp)
        enc = reduction_encoding(out.dtype, op, "reduce_scatter")
        return self._work(f"reduce_scatter({self.size()} x {_describe(out)}, {op.upper()})", [out],
                          lambda ctx: C.reduce_scatter(ctx, out, lambda: torch.cat([C.flat(t) for t in ins]), enc, op,
                                                       self.rank(), self.size(), fresh=True),
                          Fingerprint.of("reduce_scatter", ins, op))

    @staged(outputs=(0,))
    def reduce_scatter_single(self, output, input, opts):
        _check_tensors([output, input], "reduce_scatter_tensor")
        if input.numel() != output.numel() * self.size() or input.dtype != output.dtype:
            raise ValueError(f"luwu reduce_scatter_tensor: the input ({_describe(input)}) must hold world_size "
                             f"({self.size()}) times the output ({_describe(output)})")
        op = op_name(opts.reduceOp)
        enc = reduction_encoding(output.dtype, op, "reduce_scatter_tensor")
        return self._work(f"reduce_scatter_tensor({_describe(input)}, {op.upper()})", [output],
                          lambda ctx: C.reduce_scatter(ctx, output, lambda: C.flat(input), enc, op, self.rank(),
                                                       self.size()),
                          Fingerprint.of("reduce_scatter_tensor", [input], op))

    _reduce_scatter_base = reduce_scatter_single

    @staged(outputs=(0,))
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        outputs = _check_tensors(outputs, "reduce_scatter_tensor_coalesced")
        inputs = _check_tensors(inputs, "reduce_scatter_tensor_coalesced")
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._join(works, outputs, "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- exact moves over the engine ---------------------------------------------------------------------
    @staged(outputs=(0,))
    def broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        root = opts.rootRank
        self._check_rank(root, "broadcast root")
        return self._work(f"broadcast({_describe(t)}, root {root})", [t],
                          lambda ctx: C.broadcast(ctx, t, root, self.rank()), Fingerprint.of("broadcast", [t], root=root),
                          small=_small([t]))

    @staged(outputs=(0,))
    def allgather(self, outputs, inputs, opts=None):
        t = _one(inputs, "allgather")
        if len(outputs) != 1 or len(outputs[0]) != self.size():
            raise ValueError(f"luwu allgather: needs one output list of {self.size()} tensors (one per rank)")
        outs = _check_tensors(outputs[0], "allgather")
        mine = outs[self.rank()]
        if nbytes(mine) != nbytes(t):
            raise ValueError(f"luwu allgather: output {self.rank()} holds {nbytes(mine)} bytes but this rank's "
                             f"input has {nbytes(t)}")
        return self._work(f"allgather({_describe(t)})", outs, lambda ctx: C.allgather(ctx, outs, t, self.rank()),
                          Fingerprint.of("all_gather", outs))  # the outputs: equal on every rank, even uneven

    @staged(outputs=(0,))
    def all_gather_single(self, output, input, opts=None):
        _check_tensors([output, input], "all_gather_into_tensor")
        if nbytes(output) != nbytes(input) * self.size():
            raise ValueError(f"luwu all_gather_into_tensor: the output ({_describe(output)}) must hold world_size "
                             f"({self.size()}) times the input ({_describe(input)})")
        return self._work(f"all_gather_into_tensor({_describe(input)})", [output],
                          lambda ctx: C.allgather_into(ctx, output, input, self.size(), self.rank()),
                          Fingerprint.of("all_gather_into_tensor", [input]))

    _allgather_base = all_gather_single

    @staged(outputs=(0,))
    def allgather_coalesced(self, outputs, inputs, opts=None):
        # c10d's layout (as Gloo's): outputs[r][j] receives rank r's input j
        ins = _check_tensors(inputs, "allgather_coalesced")
        outputs = [list(o) for o in outputs]
        if len(outputs) != self.size() or any(len(o) != len(ins) for o in outputs):
            raise ValueError(f"luwu allgather_coalesced: needs {self.size()} output lists (one per rank) of "
                             f"{len(ins)} tensors (one per input)")
        works = [self.allgather([[outputs[r][j] for r in range(self.size())]], [t], opts) for j, t in enumerate(ins)]
        return self._join(works, [t for o in outputs for t in o], "allgather_coalesced")

    @staged(outputs=(0,))
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._join(works, list(outputs), "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @staged(outputs=(0,))
    def gather(self, outputs, inputs, opts):
        t = _one(inputs, "gather")
        root = opts.rootRank
        self._check_rank(root, "gather root")
        outs: list[torch.Tensor] = []
        if self.rank() == root:
            if len(outputs) != 1 or len(outputs[0]) != self.size():
                raise ValueError(f"luwu gather: the root needs one output list of {self.size()} tensors")
            outs = _check_tensors(outputs[0], "gather")
            for i, o in enumerate(outs):
                if nbytes(o) != nbytes(t):
                    raise ValueError(f"luwu gather: output {i} holds {nbytes(o)} bytes, the input {nbytes(t)} "
                                     "(every rank gathers tensors of one size)")
        return self._work(f"gather({_describe(t)}, root {root})", outs,
                          lambda ctx: C.gather(ctx, outs, t, self.size(), self.rank(), root))

    @staged(outputs=(0,))
    def scatter(self, outputs, inputs, opts):
        out = _one(outputs, "scatter")
        root = opts.rootRank
        self._check_rank(root, "scatter root")
        ins: list[torch.Tensor] = []
        if self.rank() == root:
            if len(inputs) != 1 or len(inputs[0]) != self.size():
                raise ValueError(f"luwu scatter: the root needs one input list of {self.size()} tensors")
            ins = _check_tensors(inputs[0], "scatter")
            for i, t in enumerate(ins):
                if nbytes(t) != nbytes(out):
                    raise ValueError(f"luwu scatter: input {i} holds {nbytes(t)} bytes, the output {nbytes(out)}")
        return self._work(f"scatter({_describe(out)}, root {root})", [out],
                          lambda ctx: C.scatter(ctx, out, ins, self.size(), self.rank(), root))

    @staged(outputs=(0,))
    def alltoall(self, outputs, inputs, opts=None):
        outs, ins = _check_tensors(outputs, "all_to_all"), _check_tensors(inputs, "all_to_all")
        if len(outs) != self.size() or len(ins) != self.size():
            raise ValueError(f"luwu all_to_all: needs {self.size()} input and {self.size()} output tensors")
        return self._work(f"all_to_all({sum(t.numel() for t in ins)} elements)", outs,
                          lambda ctx: C.alltoall(ctx, [lambda t=t: tensor_bytes(t) for t in ins],
                                                 [nbytes(o) for o in outs],
                                                 lambda chunks: [write_bytes(o, c) for o, c in zip(outs, chunks)],
                                                 self.size(), self.rank()))

    @staged(outputs=(0,))
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        _check_tensors([output, input], "all_to_all_single")
        send = C.split_bytes(input, list(input_split_sizes), self.size(), "input")
        recv = C.split_bytes(output, list(output_split_sizes), self.size(), "output")

        def deliver(chunks: list[np.ndarray]) -> None:
            write_bytes(output, np.concatenate(chunks) if chunks else np.zeros(0, np.uint8))

        return self._work(f"all_to_all_single({_describe(input)})", [output],
                          lambda ctx: C.alltoall(ctx, [lambda a=a, n=n: tensor_bytes(input)[a: a + n] for a, n in send],
                                                 [n for _, n in recv], deliver, self.size(), self.rank()))

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._work("barrier", [], lambda ctx: C.barrier(ctx), Fingerprint("barrier", [], 0), small=True)

    # -- point to point (TCP, luwu.worker.p2p) -------------------------------------------------------------
    @staged(outputs=())
    def send(self, tensors, dst: int, tag: int = 0):
        t = _one(tensors, "send")
        work = LuwuWork(f"send({_describe(t)} to rank {dst}, tag {tag})", [t])
        self._p2p.send(dst, tag, tensor_bytes(t), lambda err: work._fail(err) if err else work._complete())
        return work

    @staged(outputs=(0,))
    def recv(self, tensors, src: int, tag: int = 0):
        t = _one(tensors, "recv")
        name = f"recv({_describe(t)} from rank {src}, tag {tag})"
        work = LuwuWork(name, [t])

        def deliver(payload: bytes) -> None:
            if len(payload) != nbytes(t):
                raise ValueError(f"luwu {name}: the message has {len(payload)} bytes but the tensor holds "
                                 f"{nbytes(t)} ({tuple(t.shape)} x {t.dtype})")
            write_bytes(t, np.frombuffer(payload, dtype=np.uint8))

        self._p2p.recv(src, tag, deliver, lambda err: work._fail(err) if err else work._complete())
        return work

    @staged(outputs=(0,))
    def recv_anysource(self, tensors, tag: int = 0):
        t = _one(tensors, "recv")
        name = f"recv({_describe(t)} from any rank, tag {tag})"
        work = LuwuWork(name, [t])

        def deliver(src: int, payload: bytes) -> None:
            if len(payload) != nbytes(t):
                raise ValueError(f"luwu {name}: rank {src}'s message has {len(payload)} bytes but the tensor holds "
                                 f"{nbytes(t)} ({tuple(t.shape)} x {t.dtype})")
            write_bytes(t, np.frombuffer(payload, dtype=np.uint8))
            work.source = src  # before completion: dist.recv(src=None) reads it after wait()

        self._p2p.recv_any(tag, deliver, lambda err: work._fail(err) if err else work._complete())
        return work

    # -- lifecycle -----------------------------------------------------------------------------------------
    def shutdown(self, *args, **kwargs) -> None:
        thread = self._start_thread
        if thread is not None and thread is not threading.current_thread():
            self._started.wait(self._start_deadline())  # a deferred start-up finishes (or fails) first
        if self._closed:
            return
        self._closed = True
        worker_metrics.untrack(getattr(self, "_metrics_name", ""))
        for name in ("sched", "p2p", "link"):
            part = self._parts.get(name)
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001 - shutting down: free what can be freed
                    pass
        lease = self._parts.get("lease")
        if lease is not None:
            release_plan(self._store, lease, self.rank(), self.size(), self._cfg.shutdown_wait)
        else:  # the start-up failed before it had a plan: stop the child processes it launched
            EngineHost.stop_if_unused()
            discard_prestarted_switch(self._workdir)
        cleanup.untrack(self._workdir)  # the last group's: the processes are stopped, their directories go

    def abort(self) -> None:
        self.shutdown()

    # -- helpers -------------------------------------------------------------------------------------------
    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.size():
            raise ValueError(f"luwu: {what} {rank} is not a rank of this group (0..{self.size() - 1})")

    def _join(self, works: list[LuwuWork], outputs, name: str) -> LuwuWork:
        joined = LuwuWork(name, list(outputs))
        remaining = [len(works)]
        lock = threading.Lock()

        def one(fut) -> None:
            try:
                fut.wait()
            except Exception as e:  # noqa: BLE001
                joined._fail(e)
                return
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                joined._complete()

        if not works:
            joined._complete()
        for w in works:
            w._done_future.add_done_callback(one)
        return joined


def create_luwu_process_group(store, rank: int, world_size: int, timeout: timedelta,
                              config: BackendConfig | None = None, workdir: str | None = None,
                              deferred: bool = False) -> LuwuProcessGroup:
    """The creator registered with `dist.Backend.register_backend` (through `_create_process_group`,
    which hands it the config, the workdir whose child processes it already launched, and
    `deferred` unless LUWU_EAGER_START=1)."""
    return LuwuProcessGroup(store, rank, world_size, timeout, config, workdir, deferred)
