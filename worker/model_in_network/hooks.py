"""The hooks of `ModelInNetwork` (a mixin of it, model.py): what happens around each unit's
forward and backward -- pull its parameters before, free them after, stage its gradients as autograd
accumulates them and push each unit's gradient once it is complete.

    forward pre-hook    take the unit's pull (issued ahead by schedule.py), prefetch the next
    forward hook        free the unit unless kept; hook its outputs for backward
    output grad hook    before the unit's backward: pull it again unless resident
    pre-hook of its submodules, in backward: a checkpointed forward recomputed (pull again)
    post-accumulate-grad hook per parameter: copy into the unit's staging buffer; the last one pushes

On a rail-only plan the server's ranks all-gather each pulled unit and reduce-scatter each
gradient over NVLink (`_server_step`, hierarchy.py). model.py holds the wrapper's public API
(construction, `step()`, the nn.Module surface, `close()`).
"""

from __future__ import annotations

import collections
import functools
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from luwu.dataplane.engine.handles import EngineError, Handle
from luwu.dataplane.engine.liveness import LuwuPeerDead
from luwu.dataplane.observe import trace
from luwu.worker.engine_link import Staging

from .inflight import ArrivingGrads, issued, joined
from .schedule import BACKWARD, Ticket, use_phase
from .watch import ASSUMED, WATCHED, in_backward, output_tensors

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from luwu.worker.engine_link import EngineLink

    from .devices import HostStage
    from .flat import FlatParams
    from .hierarchy import ServerSteps
    from .memory import MemoryTracker
    from .network import JobNetwork
    from .routes import Route
    from .schedule import PullSchedule
    from .staging import StagingPool
    from .units import Unit
    from .watch import SavedWatch


class UnitHooks:
    """The pull/free/push hooks `ModelInNetwork` installs on each unit (see the module docstring)."""

    if TYPE_CHECKING:  # what the mixin uses of ModelInNetwork (model.py), declared for the type checker
        units: list[Unit]
        flats: list[FlatParams]
        routes: dict[int, Route]
        network: JobNetwork
        engine: EngineLink
        pool: StagingPool
        schedule: PullSchedule
        server: ServerSteps | None
        memory: MemoryTracker
        keep: set[int]
        rank: int
        version: int
        timeout: float
        max_inflight_pushes: int
        stats: collections.Counter[str]
        wait_seconds: collections.defaultdict[str, float]
        _pull_dtype: dict[int, Any]
        _wire_bytes: dict[int, int]
        _push_stage: HostStage
        _pushes: collections.deque[tuple[int, Handle, Staging]]
        _grad: dict[int, ArrivingGrads | None]
        _pushed: dict[int, int]
        _saving: dict[int, str]
        _watch: SavedWatch
        _spans: dict[tuple[str, int], trace.OpenSpan]
        _observed: list[int]
        _hooks: list[RemovableHandle]
        _failed: bool

    def _install_hooks(self) -> None:
        """Pull/free around each unit's module and its sites' forward (tied parameters), pull again in a
        forward their submodules recompute in backward (checkpointing); stage gradients, push."""
        for u in self.units:
            for module, primary in [(u.module, True)] + [(m, False) for _, m in u.sites]:
                self._hooks.append(module.register_forward_pre_hook(self._make_pre_forward(u.index, primary)))
                self._hooks.append(module.register_forward_hook(self._make_post_forward(u.index), always_call=True))
                again = functools.partial(self._recompute, u.index)
                self._hooks.extend(sub.register_forward_pre_hook(again) for sub in module.modules() if sub is not module)
            for i, (_, p) in enumerate(u.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(u.index, i)))

    # -- pulls ----------------------------------------------------------------------------------
    def _issue_pull(self, unit: int, phase: str, version: int) -> Ticket:
        st = self.pool.acquire()
        handle = self._pull_pieces(st, unit, version)
        self.stats["pulls"] += 1
        return Ticket(unit, phase, version, handle, st)

    def _pull_pieces(self, st: Staging, unit: int, version: int) -> Handle:
        """Pull this rank's pieces of `unit` into their places in `st` (all of it on a flat plan)."""
        pieces, dtype = self.routes[unit].pieces, self._pull_dtype[unit]  # uint16: bf16 bits, never widened
        self.stats["pulled_bytes"] += self._wire_bytes[unit]
        if len(pieces) == 1:  # a whole unit: its one handle (no name to build)
            p = pieces[0]
            return self.engine.pull(st, p.numel, p.session, unit, version, p.offset, dtype)
        return joined([self.engine.pull(st, p.numel, p.session, unit, version, p.offset, dtype) for p in pieces],
                       f"pull of unit {self.units[unit].label()} at version {version}")

    def _pulled(self, st: Staging, unit: int) -> np.ndarray:
        """Unit `unit`'s values as `_pull_pieces` left them in `st`: float32, or its bf16 bits (uint16)."""
        return st.view(self.units[unit].numel, 0, self._pull_dtype[unit])

    def _wait(self, handle: Handle, what: str | Callable[[], str], kind: str) -> Any:
        """handle.wait() within the timeout; `what` (or what it returns: built only for an error)
        names the operation in the error."""
        t0 = time.perf_counter()
        try:
            return handle.wait(self.timeout)
        except TimeoutError:
            self._failed = True
            what = what() if callable(what) else what
            raise TimeoutError(f"rank {self.rank}: {what} did not complete within {self.timeout} s; check that the "
                               "switch and optimizer node(s) run and that every worker runs the same steps") from None
        except EngineError as e:  # LuwuPeerDead in process, its message from an engine daemon
            self._failed = True
            found = re.search(r"optimizer node of session (\d+)", str(e))
            if found is not None:  # the engine knows the node by its session only: add index, control channel, job
                what = what() if callable(what) else what
                named = f"optimizer node {self.network.describe_node(int(found.group(1)))}"
                e.args = (f"rank {self.rank}: {what}: {str(e).replace(found.group(0), named)}",)
                if isinstance(e, LuwuPeerDead):
                    e.address = e.address.replace(found.group(0)[len("optimizer node "):], named[len("optimizer node "):])
            raise
        finally:
            self.wait_seconds[kind] += time.perf_counter() - t0

    def _take(self, ticket: Ticket | None, unit: int) -> None:
        if ticket is None:
            return
        handle, staging = issued(ticket)
        try:
            def what() -> str:  # built only for an error message (a dozen pulls per step)
                return f"pull of unit {self.units[unit].label()} at version {ticket.version}"
            with trace.span("pull wait", "worker", unit=unit, version=ticket.version):
                self._wait(handle, what, "pull")
            if self.server is not None:
                self._server_step("all_gather", unit, ticket.version, self._pulled(staging, unit), what())
            self.flats[unit].materialise(self._pulled(staging, unit), ticket.version)
        finally:
            self.pool.release(staging)

    # -- forward ----------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: int, primary: bool) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if in_backward():  # a forward recomputed for backward (activation checkpointing)
                self._recompute(unit)
                return
            grad = torch.is_grad_enabled()
            if primary and unit == self.schedule.order[0]:
                self.schedule.begin_pass(grad)
                self._observed = []
            phase = use_phase(self._observed.count(unit))  # a unit's second use in a pass (tied, or called twice)
            self._observed.append(unit)
            flat = self.flats[unit]
            self._take(self.schedule.take(unit, phase, self.version, flat.resident and flat.version == self.version),
                       unit)
            self.schedule.prefetch_after(unit, phase, self.version)
            if grad:
                self._saving[unit] = self._watch.begin(unit, self.flats[unit].storage)  # watch.py
            self._spans[("forward", unit)] = trace.begin("forward", "worker", unit=unit, version=self.version)
        return pre

    def _recompute(self, unit: int, *hook_args: Any) -> None:  # also a pre-forward hook of the unit's submodules
        """A forward recomputed in backward (activation checkpointing) uses `unit`: pulled now unless
        resident (the paper's second pull), resident until its gradient is pushed."""
        if not in_backward():
            return
        flat = self.flats[unit]
        if not self.schedule.saves_params[unit]:  # learned: its backward needs its parameters
            self.schedule.saves_params[unit] = True
            self._watch.learn(unit)
        if flat.resident and flat.version == self.version:
            return
        if self._pushed.get(unit) == self.version:
            raise RuntimeError(f"unit {self.units[unit].label()}: a forward recomputed for backward uses it after its "
                               "gradient was pushed (a checkpointed region using it after its backward); checkpoint "
                               "whole units, or keep the unit outside the region")
        self.stats["recomputed_pulls"] += 1  # the pulls a recomputation had to issue
        self._take(self.schedule.take(unit, BACKWARD, self.version, False), unit)
        self.schedule.prefetch_after(unit, BACKWARD, self.version)

    def _make_post_forward(self, unit: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if in_backward():  # recomputed: resident until the unit's gradient is pushed
                return
            trace.end(self._spans.pop(("forward", unit), None))
            how = self._saving.pop(unit, None)
            if how is not None:  # a forward with autograd on
                if how == WATCHED:
                    self.schedule.saves_params[unit] = self._watch.end(unit, self.flats[unit].storage)
                elif how == ASSUMED:
                    self.schedule.saves_params[unit] = True
                self._hook_outputs(unit, output)
            if unit not in self.keep:
                self.flats[unit].free()
            return None
        return post

    def _hook_outputs(self, unit: int, output: object) -> None:
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._make_pre_backward(unit))

    # -- backward ---------------------------------------------------------------------------------
    def _make_pre_backward(self, unit: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            flat = self.flats[unit]
            if self._pushed.get(unit) == self.version or not self.schedule.saves_params[unit]:
                return None
            resident = flat.resident and flat.version == self.version
            if not resident:
                self._take(self.schedule.take(unit, BACKWARD, self.version, False), unit)
                self.schedule.prefetch_after(unit, BACKWARD, self.version)
            if ("backward", unit) not in self._spans:
                self._spans[("backward", unit)] = trace.begin("backward", "worker", unit=unit, version=self.version)
            return None
        return hook

    def _make_grad_hook(self, unit: int, index: int) -> Callable[[torch.Tensor], None]:
        u = self.units[unit]
        lo, hi = u.offsets[index]
        nbytes = u.params[index][1].numel() * u.params[index][1].element_size()  # the gradient's: torch keeps p's dtype
        on_cpu = u.device.type == "cpu"  # used in place; another device's gradient comes through a pinned buffer
        grads, pushed, memory, to_host = self._grad, self._pushed, self.memory, self._push_stage.to_host

        def hook(p: torch.Tensor) -> None:  # ~50 calls per step: what can be known here is known above
            if pushed.get(unit) == self.version:
                raise RuntimeError(f"unit {u.label()} got a second gradient before step(): "
                                   "ModelInNetwork pushes each unit's gradient once per step (call mnn.step() after "
                                   "every backward; gradient accumulation over micro-batches is not supported)")
            state = grads[unit]
            if state is None:
                state = grads[unit] = ArrivingGrads(self._push_staging(), u)
            g = p.grad
            if g is None:  # torch calls this hook after accumulating into .grad: None would be torch's bug
                raise RuntimeError(f"unit {u.label()}: a gradient hook ran with no gradient")
            memory.transient("grads", nbytes)  # resident from autograd's write until here
            # widened to float32 on the host (exact from bf16/fp16): what the switch sums. On the CPU
            # straight into the slot shaped as p (made once per staging buffer: no slicing, no reshape)
            if state.done[index]:  # a second part before the unit's push (a reentrant checkpoint's own backward)
                state.slots[index].add_(g.cpu())
            elif on_cpu:
                state.slots[index].copy_(g)
            else:
                state.tensor[lo:hi].copy_(to_host(g))
            p.grad = None
            if not state.done[index]:
                state.done[index] = True
                state.left -= 1
                if state.left == 0:
                    self._push(unit)
        return hook

    def _push_staging(self) -> Staging:
        while len(self._pushes) >= self.max_inflight_pushes:
            self._finish_oldest_push()
        return self.pool.acquire()

    def _finish_oldest_push(self) -> None:
        unit, handle, st = self._pushes.popleft()
        try:
            with trace.span("push wait", "worker", unit=unit, version=self.version):
                self._wait(handle, lambda: f"push of unit {self.units[unit].label()} for step {self.version}", "push")
        finally:
            self.pool.release(st)

    def _push(self, unit: int) -> None:
        state = self._grad[unit]
        u = self.units[unit]
        if state is None:  # the gradient hook and step() stage a buffer before pushing
            raise RuntimeError(f"unit {u.label()}: pushed with no gradient staged")
        st, done = state.staging, state.done
        for ok, (lo, hi) in zip(done, u.offsets):
            if not ok:  # a parameter this step did not use: like torch's zero gradient, but the step still runs
                st.array[lo:hi] = 0.0
        self._grad[unit] = None
        trace.end(self._spans.pop(("backward", unit), None))
        if self.server is not None:  # rail-only: this rank pushes the server's sum of its shard
            self._server_step("reduce_scatter", unit, self.version, st.view(u.numel),
                              f"unit {u.label()}'s gradient for step {self.version}")
        pieces = self.routes[unit].pieces
        with trace.span("push", "worker", unit=unit, version=self.version, bytes=u.wire_nbytes):
            if len(pieces) == 1:  # a whole unit: its one handle (no name to build)
                p = pieces[0]
                handle = self.engine.push(st, p.numel, p.session, unit, p.offset)
            else:
                handle = joined([self.engine.push(st, p.numel, p.session, unit, p.offset) for p in pieces],
                                 f"push of unit {u.label()}")
        self._pushes.append((unit, handle, st))
        self._pushed[unit] = self.version
        self.stats["pushes"] += 1
        self.stats["pushed_bytes"] += self._wire_bytes[unit]
        self.flats[unit].free()

    def _server_step(self, step: str, *args: Any) -> None:
        """`ServerSteps.<step>(*args)`: a reduce-scatter or all-gather inside the server; a failure
        stops this rank's training (close() then does not wait for the others)."""
        if self.server is None:
            raise RuntimeError("a step inside the server on a plan without rails")
        t0 = time.perf_counter()
        try:
            with trace.span("nvlink", "worker", step=step, unit=args[0], version=args[1]):
                getattr(self.server, step)(*args)
        except Exception:
            self._failed = True
            raise
        finally:
            self.wait_seconds["nvlink"] += time.perf_counter() - t0
