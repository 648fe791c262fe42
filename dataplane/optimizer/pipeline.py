"""The step-centric pipeline: receive gradient -> read state -> optimizer step -> write state ->
publish parameters, a thread pool per step and bounded queues between them (LuWu's design); and
the layer-centric alternative it is measured against, where one thread runs a layer's whole
sequence.

Layers rotate through the steps: while layer i is in the optimizer, layer i-1's state is being
read and layer i+1's written back. Torch kernels and file I/O release the GIL, so the threads
overlap real work. One step per layer is in the pipeline at a time (the node dispatches a
layer's next gradient when its previous version is published), which keeps versions in order.

A shard whose state is in RAM takes a fast lane: the receive thread pins it and readies its
step (clipping, torch's scalar remainders, the kernel's arguments), the optimizer's thread
steps every such shard queued for it in one GIL-releasing call, unpins them and publishes
finished layers itself when nothing else waits (else the publish thread does, in batches). Shards that need I/O (out of core) go through the
read and write threads as before, as do a checkpoint capture and a store that needs room.
Thread hand-offs and GIL hand-overs, not Python, were most of the pipeline's cost
(docs/optimizer.md "Memory traffic"). A small layer in RAM (`NodeConfig.inline_elems`) skips
them all: the submitting thread runs the fast lane's steps itself (`submit_inline`).

Gradient clipping by the global norm needs every layer's gradient of a step before any layer
can step: the receive step holds the step's gradients in a gate until the last one arrives.
That gives up the overlap of optimizer work with the backward pass (the whole step's optimizer
work then runs after the last layer's gradient); clipping per layer keeps it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..observe import trace
from . import fused, kernels
from .layout import LayerPlan, ShardPlan
from .spec import NodeConfig, OptimizerSpec
from .store import Entry

STAGES = ("receive", "read", "optimize", "write", "publish")
_STOP = object()


@dataclass(eq=False)
class LayerStep:
    """One layer's gradient for one step, on its way through the pipeline."""

    job_id: str
    opt: OptimizerSpec
    plan: LayerPlan
    step: int
    grad: np.ndarray | None  # None once published, or for a skipped step
    contributors: int
    num_layers: int  # of the job (for the global clipping gate)
    grad_t: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    coef: torch.Tensor | None = None
    norms: list | None = None
    served_buf: np.ndarray | None = None
    remaining: int = 0
    published: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    # a skipped step (a non-finite gradient, as torch's GradScaler skips): the version advances with the
    # parameters and optimizer state unchanged; `grad` is None
    skip: bool = False


@dataclass(eq=False)
class ShardTask:
    item: LayerStep
    shard: ShardPlan
    entry: Entry | None = None
    call: tuple | None = None  # the optimizer's call, (fn, args), readied by _ready
    batch: tuple | None = None  # the call as a fused.run_batch entry (the compiled kernel's calls)
    fast: bool = False  # readied in the fast lane (its state was in RAM)


class Pipeline:
    def __init__(self, cfg: NodeConfig, node):
        self.node = node  # new_served_buffer(plan), ckpt (or None), store, on_published(item), fail(exc, where)
        self.mode = cfg.pipeline
        self.threads_per_step = cfg.threads_per_step
        self.lock = threading.Lock()
        self.work_cv = threading.Condition()
        self.work: collections.deque = collections.deque()  # ("recv" | "run", LayerStep)
        self.gates: dict[tuple[str, int], list[LayerStep]] = {}
        self.busy = dict.fromkeys(STAGES, 0.0)
        # shards that skipped the read / write thread; layers stepped on their submitter's thread
        self.fast = {"fast_reads": 0, "fast_writes": 0, "inline_layers": 0}
        self.stopping = False
        self.queue_depth = cfg.queue_depth
        self.inline_elems = cfg.inline_elems
        self._scales: dict[int, tuple[torch.Tensor, float]] = {}  # contributors -> divisor (one entry: threads race)
        self.threads: list[threading.Thread] = []
        if self.mode == "step":
            self.queues: dict[str, queue.Queue] = {s: queue.Queue(maxsize=cfg.queue_depth) for s in STAGES[1:]}
            self._spawn("receive", self._receive_loop)
            self._spawn("read", lambda: self._stage_loop("read", self._read, "optimize"))
            self._spawn("optimize", self._optimize_loop)
            self._spawn("write", lambda: self._stage_loop("write", self._write, None))
            self._spawn("publish", self._publish_loop)
        else:
            self.queues = {}
            for i in range(self.threads_per_step * len(STAGES)):
                t = threading.Thread(target=self._layer_loop, name=f"luwu-opt-layer-{i}", daemon=True)
                t.start()
                self.threads.append(t)

    def _spawn(self, stage: str, target) -> None:
        for i in range(self.threads_per_step):
            t = threading.Thread(target=target, name=f"luwu-opt-{stage}-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    # -- entry -----------------------------------------------------------------------------------
    def submit(self, item: LayerStep) -> None:
        with self.work_cv:
            self.work.append(("recv", item))
            self.work_cv.notify()

    def submit_inline(self, item: LayerStep) -> None:
        """`submit`, but a small layer whose state is in RAM is stepped and published on the
        calling thread (the inline lane), when nothing would make that thread wait: the step
        pipeline, at most `inline_elems` elements, no global-norm clipping gate, every shard
        resident (`StateStore.try_acquire`). Anything else goes to the receive thread as before.

        For a layer of the demo's size (100-300k elements) the step is 0.1-0.4 ms of kernel,
        while the receive, optimize and publish hand-offs of the threaded lane cost more CPU
        than that in wake-ups and GIL hand-overs (docs/optimizer.md "Pipeline")."""
        entries = self._inline_entries(item)
        if entries is None:
            self.submit(item)
            return
        try:
            self._run_inline(item, entries)
        except BaseException as e:
            self.node.fail(e, "inline")

    def _inline_entries(self, item: LayerStep) -> list[Entry] | None:
        """Every shard of the layer pinned (the fast lane's read step), or None (nothing pinned)
        when the layer is not for the inline lane."""
        opt = item.opt
        if (self.mode != "step" or item.plan.numel > self.inline_elems or self.stopping or self.node.failed()
                or (opt.clip_grad_norm is not None and opt.clip_scope != "layer")):
            return None
        entries: list[Entry] = []
        for shard in item.plan.shards:
            e = self.node.store.try_acquire(shard.key)
            if e is None:
                for got in entries:
                    self.node.store.release(got, dirty=False)
                return None
            entries.append(e)
        return entries

    def _run_inline(self, item: LayerStep, entries: list[Entry]) -> None:
        """The fast lane's receive, read, optimize, write and publish steps of one layer in a row
        (same calls, so the same bits); a capture or a store that needs room still goes to the
        write thread. A single shard's kernel is called directly: `fused.run_batch` exists to
        release the GIL once for several shards, and building its arguments cost several times
        the call (the same compiled function per shard, so the same bits)."""
        perf = time.perf_counter
        layer_id, step = item.plan.layer_id, item.step
        t0 = perf()
        with trace.span("receive", "optimizer", layer=layer_id, step=step):
            self._receive(item)  # no gate (see _inline_entries): returns [item]
        t1 = perf()
        tasks = self._prepare(item)
        ckpt = self.node.ckpt
        for task, entry in zip(tasks, entries):
            task.entry, task.fast = entry, True
            if ckpt is not None:
                ckpt.before_modify(entry)
            self._ready(task, batch=len(tasks) > 1)
        t2 = perf()
        with trace.span("optimize", "optimizer", layer=layer_id, step=step, shards=len(tasks),
                        layers=[[layer_id, step]]):
            self._optimize_many(tasks)
        t3 = perf()
        done: list[LayerStep] = []
        written = 0
        for task in tasks:
            if self._fast_write(task, done, account=False):
                written += 1
            else:
                self._put("write", task)  # the write thread publishes the layer after its last shard
        t4 = perf()
        with self.lock:  # one acquisition for the layer's accounting, not one per step
            busy, fast = self.busy, self.fast
            busy["receive"] += t1 - t0
            busy["read"] += t2 - t1
            busy["optimize"] += t3 - t2
            busy["write"] += t4 - t3
            fast["inline_layers"] += 1
            fast["fast_reads"] += len(tasks)
            fast["fast_writes"] += written
        self._publish_items(done)

    def _take(self, kinds: tuple[str, ...]):
        with self.work_cv:
            while True:
                if self.stopping:
                    return None
                for i, (kind, item) in enumerate(self.work):
                    if kind in kinds:
                        del self.work[i]
                        return kind, item
                self.work_cv.wait(1.0)

    # -- the five steps --------------------------------------------------------------------------
    def _receive(self, item: LayerStep) -> list[LayerStep]:
        """Gradient in: mean over contributors and clipping; returns the items ready to step."""
        opt = item.opt
        if item.skip:  # not stepped; in a global-norm gate it adds no norm, so the step's other layers go on
            item.norms = []
            if opt.clip_grad_norm is None or opt.clip_scope == "layer":
                return [item]
        else:
            if item.grad is None:  # only a skipped step comes without one
                raise AssertionError(f"layer {item.plan.layer_id} step {item.step} has no gradient")
            if opt.clip_grad_norm is None:
                if item.contributors > 1:
                    item.grad_scale = self._scale(item.contributors)[0]  # divided inside the kernel
                return [item]  # the torch view of the gradient is made if _ready needs it
            item.grad_t = torch.from_numpy(item.grad)
            if item.contributors > 1:
                item.grad_t.div_(item.contributors)  # the norm is the mean's norm
            item.norms = kernels.tensor_norms(item.plan, item.grad_t)
            if opt.clip_scope == "layer":
                item.coef = kernels.clip_coefficient(item.norms, opt.clip_grad_norm)
                return [item]
        gate_key = (item.job_id, item.step)
        with self.lock:
            gate = self.gates.setdefault(gate_key, [])
            gate.append(item)
            if len(gate) < item.num_layers:
                return []
            del self.gates[gate_key]
        # every layer of the step is here: the norm over all of them, in the job's layer order
        ordered = sorted(gate, key=lambda it: self.node.layer_rank(it.job_id, it.plan.layer_id))
        norms: list = []  # none when every layer of the step was skipped
        for it in ordered:
            if it.norms is None:  # every item is given its norms (maybe none) before its gate
                raise AssertionError(f"layer {it.plan.layer_id} step {it.step} reached the clipping gate without norms")
            norms += it.norms
        coef = kernels.clip_coefficient(norms, opt.clip_grad_norm) if norms else None
        for it in gate:
            it.coef = coef
        return gate  # arrival order

    def _prepare(self, item: LayerStep) -> list[ShardTask]:
        item.served_buf = self.node.new_served_buffer(item.plan)
        if item.skip:  # the new version serves the same parameters (the buffer is raw bytes)
            cur = np.ascontiguousarray(self.node.served.get((item.job_id, item.plan.layer_id))[0]).reshape(-1)
            item.served_buf.reshape(-1).view(np.uint8)[:cur.nbytes] = cur.view(np.uint8)
        item.remaining = len(item.plan.shards)
        return [ShardTask(item, s) for s in item.plan.shards]

    def _read(self, task: ShardTask) -> None:
        """The shard's state, pinned in RAM; a checkpoint copy of it still pending gets its
        snapshot here, on this thread, while the optimizer works on the previous shard. (No new
        capture of this version can appear: the layer counts as busy from dispatch on.)"""
        task.entry = self.node.store.acquire(task.shard.key)
        if self.node.ckpt is not None:
            self.node.ckpt.before_modify(task.entry)

    def _ready(self, task: ShardTask, batch: bool = True) -> None:
        """Everything of the shard's step that can run before the optimizer's thread takes it:
        clipping its gradient slice, torch's scalar remainders, the kernel's arguments
        (`kernels.prepare_step`). Every torch call releases the GIL and has to take it back,
        which on the optimizer's thread waits for whichever pipeline thread holds it; here it
        runs on the thread that readied the shard (after the checkpoint's copy-on-write)."""
        item, shard, e = task.item, task.shard, task.entry
        if item.skip:
            return
        if e is None or e.views is None:  # acquired just before
            raise AssertionError(f"shard {shard.name()} readied while not in memory")
        if item.grad is None or item.served_buf is None:  # set by the submitter and _prepare
            raise AssertionError(f"layer {item.plan.layer_id} step {item.step} reached the optimizer unprepared")
        call = None
        if item.coef is None and e.arrays is not None:
            # nothing to clip: the compiled call straight from numpy arrays (torch's views and slices of
            # the general path were most of a small layer's step on the engine's thread)
            scale = None if item.grad_scale is None else self._scale(item.contributors)[1]
            call = kernels.lean_step(item.opt, shard, e.arrays, item.grad, item.step, scale, item.plan,
                                     item.served_buf)
        if call is not None:
            task.call = call
            if batch:
                task.batch = fused.batch_entry(call)
            return
        if item.grad_t is None:  # with clipping, _receive made it (and divided the gradient through it)
            item.grad_t = torch.from_numpy(item.grad)
        g = item.grad_t[shard.elem_lo: shard.elem_lo + shard.numel]
        kernels.apply_clip(g, item.coef)
        task.call = kernels.prepare_step(item.opt, shard, e.views, g, item.step, item.grad_scale,
                                         kernels.served_view(item.plan, item.served_buf, shard))
        if batch:  # else `_optimize_many` makes the call itself
            task.batch = fused.batch_entry(task.call)

    def _optimize(self, task: ShardTask) -> None:
        self._optimize_many([task])

    def _optimize_many(self, tasks: list[ShardTask]) -> None:
        """The optimizer step of several shards: the compiled kernel's calls of each kind in one
        call (`fused.run_batch`: one GIL release for all), any other call on its own."""
        batches: tuple[list, list] = ([], [])  # bf16 copies, fp32 copies
        for task in tasks:
            item, shard, e = task.item, task.shard, task.entry
            if e is None or e.buf is None:  # _read pinned the shard in memory
                raise AssertionError(f"shard {shard.name()} reached the optimizer while not in memory")
            if item.skip:
                continue
            if task.call is None:  # through the read step: readied here, keeping that thread's time for I/O
                self._ready(task)
            if task.batch is not None:
                batches[task.batch[0]].append(task.batch)
            elif task.call is not None:  # _ready made it
                fn, args = task.call
                fn(*args)
            else:
                raise AssertionError(f"layer {item.plan.layer_id} step {item.step} reached the optimizer unprepared")
        for entries in batches:
            if entries:
                fused.run_batch(entries)
        for task in tasks:
            e, task.call, task.batch = task.entry, None, None
            if e is None or e.buf is None:  # checked above
                raise AssertionError(f"shard {task.shard.name()} lost its state during its step")
            e.step = task.item.step + 1  # a skipped step too: a shard's header counts versions (checkpoints check it)
            task.shard.write_header(e.buf, e.step)

    def _write(self, task: ShardTask) -> LayerStep | None:
        """The checkpoint capture, then the state goes back to the store (written back there if
        the store needs the room)."""
        item, e = task.item, task.entry
        version = item.step + 1
        ckpt = self.node.ckpt
        if ckpt is not None and ckpt.wants(item.job_id, item.plan.layer_id, version):
            ckpt.capture_shard(task.shard, version)
        self.node.store.release(e, dirty=True)
        task.entry = None
        self.node.store.trim()
        with self.lock:
            item.remaining -= 1
            return item if item.remaining == 0 else None

    def _publish(self, item: LayerStep) -> None:
        self.node.on_published(item)

    # -- step-centric threads --------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while True:
            got = self._take(("recv",))
            if got is None:
                return
            item = got[1]
            try:
                t0 = time.perf_counter()
                # when the summed gradient reached the pipeline: the critical path's hand-over from the workers
                with trace.span("receive", "optimizer", layer=item.plan.layer_id, step=item.step):
                    ready = self._receive(item)
                self._account("receive", t0)
                for it in ready:
                    for task in self._prepare(it):
                        self._put("optimize" if self._fast_read(task) else "read", task)
            except BaseException as e:
                self.node.fail(e, "receive")

    def _stage_loop(self, stage: str, fn, nxt: str | None) -> None:
        q = self.queues[stage]
        while True:
            task = q.get()
            if task is _STOP:
                return
            if self.node.failed():
                continue  # drain so that producers never block
            try:
                t0 = time.perf_counter()
                item = getattr(task, "item", task)
                with trace.span(stage, "optimizer", layer=item.plan.layer_id, step=item.step):
                    out = fn(task)
                self._account(stage, t0)
                if stage == "read":
                    self._put("optimize", task)
                    t0 = time.perf_counter()
                    self.node.store.prefetch_after(task.shard.key)
                    self._account(stage, t0)
                elif nxt is not None:
                    self._put(nxt, task)
                elif stage == "write" and out is not None:
                    self._put("publish", [out])
            except BaseException as e:
                self.node.fail(e, stage)

    def _optimize_loop(self) -> None:
        """The optimizer's thread. It takes every shard queued for it and steps those of the fast
        lane in one kernel call (one GIL release and re-take for all: re-taking it waits for
        whichever pipeline thread holds it). Layers it finished in the fast lane are published
        when its queue runs dry (it would wait anyway): here, when the publish thread has nothing
        queued (a hand-off to it cost a wake-up and a GIL hand-over per layer, most of that
        thread's CPU for small layers), else by the publish thread, after those queued before;
        and after `queue_depth` layers, by the publish thread in one batch."""
        q = self.queues["optimize"]
        pq = self.queues["publish"]
        done: list[LayerStep] = []
        while True:
            if done and len(done) < self.queue_depth and q.empty() and pq.empty():
                self._publish_items(done)
                done = []
            elif done and (len(done) >= self.queue_depth or q.empty()):
                self._put("publish", done)
                done = []
            tasks = [q.get()]
            while tasks[-1] is not _STOP:  # everything queued, stepped in one kernel call
                try:
                    tasks.append(q.get_nowait())
                except queue.Empty:
                    break
            stop = tasks[-1] is _STOP
            if stop:
                tasks.pop()
            # shards that came through the read step (out of core) go one by one, so that each
            # one's write-back starts as soon as it is stepped; those of the fast lane together
            groups = [[t] for t in tasks if not t.fast] + [[t for t in tasks if t.fast]]
            for group in groups:
                if not group or self.node.failed():  # a failed node drains, so that producers never block
                    continue
                try:
                    t0 = time.perf_counter()
                    first = group[0].item
                    # every (layer, step) the call stepped: the critical path follows each of them
                    with trace.span("optimize", "optimizer", layer=first.plan.layer_id, step=first.step,
                                    shards=len(group), layers=[[t.item.plan.layer_id, t.item.step] for t in group]):
                        self._optimize_many(group)
                    self._account("optimize", t0)
                    for task in group:
                        if not self._fast_write(task, done):
                            self._put("write", task)
                except BaseException as e:
                    self.node.fail(e, "optimize")
            if stop:
                return

    def _publish_loop(self) -> None:
        q = self.queues["publish"]
        while True:
            items = q.get()
            if items is _STOP:
                return
            self._publish_items(items)

    def _publish_items(self, items: list[LayerStep]) -> None:
        for item in items:
            if self.node.failed():
                break  # drain so that producers never block
            try:
                t0 = time.perf_counter()
                with trace.span("publish", "optimizer", layer=item.plan.layer_id, step=item.step):
                    self._publish(item)
                self._account("publish", t0)
            except BaseException as e:
                self.node.fail(e, "publish")

    # The fast lane: a shard whose state is in RAM skips the read and write threads (the common
    # case: the whole state fits, and those steps would only pin and unpin it). Each thread
    # hand-off costs a wake-up and a GIL hand-over; a step's first kernel call waited for four of
    # them, its publication for three.
    def _fast_read(self, task: ShardTask) -> bool:
        """The read step on the receive thread, when it can neither wait nor read (the shard and
        the ones predicted after it are resident). False: nothing done, the read step does it."""
        t0 = time.perf_counter()
        entry = self.node.store.try_acquire(task.shard.key)
        if entry is None:
            return False
        task.entry, task.fast = entry, True
        if self.node.ckpt is not None:
            self.node.ckpt.before_modify(entry)
        self._ready(task)
        self._account("read", t0, "fast_reads")
        return True

    def _fast_write(self, task: ShardTask, done: list[LayerStep], account: bool = True) -> bool:
        """The write step on the optimizer's thread, for a shard of the fast lane when it is only
        an unpin: no checkpoint capture of this version and no write-back or eviction to make
        room. A layer whose last shard this was is appended to `done` (published in a batch).
        False: nothing done, the write step does it."""
        item, e = task.item, task.entry
        if e is None:  # pinned since the read step
            raise AssertionError(f"shard {task.shard.name()} left the optimizer without its state")
        if not task.fast:  # out of core the write thread keeps the unpin (measured: 5-10% faster)
            return False
        t0 = time.perf_counter()
        ckpt = self.node.ckpt
        if ckpt is not None and ckpt.wants(item.job_id, item.plan.layer_id, item.step + 1):
            return False
        if not self.node.store.release_if_room(e, dirty=True):
            return False
        task.entry = None
        with self.lock:
            item.remaining -= 1
            last = item.remaining == 0
        if last:
            done.append(item)
        if account:
            self._account("write", t0, "fast_writes")
        return True

    def _scale(self, contributors: int) -> tuple[torch.Tensor, float]:
        """The kernel's gradient divisor, one per value: as a tensor (read only; making one per
        layer step was a tenth of the inline lane's Python) and as the float `fused.split_step`
        makes of it. One dict entry holds both: the inline lane's submitters race here, and a
        thread that found one half published without the other failed the node (KeyError)."""
        got = self._scales.get(contributors)
        if got is None:
            t = torch.tensor(float(contributors))
            got = self._scales[contributors] = (t, float(t))
        return got

    def _put(self, stage: str, task) -> None:
        q = self.queues[stage]
        while True:
            try:
                q.put(task, timeout=1.0)
                return
            except queue.Full:
                if self.node.failed() or self.stopping:
                    return

    def _account(self, stage: str, t0: float, fast: str | None = None) -> None:
        dt = time.perf_counter() - t0
        with self.lock:
            self.busy[stage] += dt
            if fast is not None:
                self.fast[fast] += 1

    # -- layer-centric threads -------------------------------------------------------------------
    def _layer_loop(self) -> None:
        while True:
            got = self._take(("run", "recv"))
            if got is None:
                return
            kind, item = got
            try:
                if kind == "recv":
                    t0 = time.perf_counter()
                    ready = self._receive(item)
                    self._account("receive", t0)
                    with self.work_cv:
                        self.work.extendleft(("run", it) for it in reversed(ready))
                        self.work_cv.notify_all()
                    continue
                for task in self._prepare(item):
                    for stage, fn in (("read", self._read), ("optimize", self._optimize), ("write", self._write)):
                        t0 = time.perf_counter()
                        fn(task)
                        if stage == "read":
                            self.node.store.prefetch_after(task.shard.key)
                        self._account(stage, t0)
                t0 = time.perf_counter()
                self._publish(item)
                self._account("publish", t0)
            except BaseException as e:
                self.node.fail(e, "layer")

    # -- teardown --------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        with self.work_cv:
            self.stopping = True
            self.work_cv.notify_all()
        for q in self.queues.values():
            for _ in range(self.threads_per_step):
                try:
                    q.put(_STOP, timeout=timeout)
                except queue.Full:
                    pass
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict:
        with self.lock:
            out = {"mode": self.mode, "busy_seconds": dict(self.busy), "gates_open": len(self.gates), **self.fast}
        out["queued"] = {s: q.qsize() for s, q in self.queues.items()}
        return out
