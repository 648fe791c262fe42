"""Models that are never whole on a worker: a model built on the meta device, initialised by the
network one unit at a time, or started from a checkpoint read one tensor at a time.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)            # no memory for parameters
    mnn = ModelInNetwork(model, optimizer, network, seed=0)     # or init_from="path/to/save_pretrained"

Every rank, before the model is cut (`Materializer.prepare`): the buffers and the frozen parameters
of a meta model (small, and every worker computes with them) are made on `device` and set by their
module's own init (below), then from the checkpoint where it holds them. Each unit's parameters
become views into its flat storage (flat.py) without it ever being resident (`flats`): a worker
holds no unit until it pulls one.

The rank that hands the nodes their layers (job.py) makes each unit's initial values while that
unit is being sent (`values`): from the checkpoint (checkpoint_io.py), or by its module's init:
the unit's storage made resident, filled with NaN, `torch.manual_seed(seed + unit.index)` (under
`torch.random.fork_rng`: the caller's generator is left as it was), then every module of the unit,
children before parents (Hugging Face's own order), initialised: a `transformers` model's modules
by `_init_weights` of the nearest `PreTrainedModel` above them (what `post_init` does, called
module by module: HF's `init_weights()` on a meta-built model makes no draws), any other module by
its `reset_parameters()`. The values are copied out and the storage freed before the next unit.
So a worker holds at most one unit for the initialisation, and the values are a function of
(seed, unit index, module init) alone: every run and every rank gets the same. They follow the
module's own init distribution, but are not bit-equal to an eager build, which draws every
tensor from one generator in construction order.

A parameter, buffer or frozen parameter that its module's init leaves unset (still NaN after the
unit's init; for buffers, different after two inits from different fills) is a `MetaInitError`
naming it, never a garbage value. Tensors of another unit (a tied weight a unit's submodule
borrows) are never written by this unit's init; other tensors the init rewrites (a buffer, a frozen
parameter inside a unit) are put back as `prepare` set them, so every rank computes with the same.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from .devices import HostStage
from .flat import FlatParams
from .memory import MemoryTracker
from .units import Unit

if TYPE_CHECKING:
    from .checkpoint_io import CheckpointReader


class MetaInitError(ValueError):
    """A meta-built model's tensor that its module's own init does not set; the message names it."""


# Seeded inits draw from torch's global generator: two of them at once in one process (ranks run
# as threads in tests and examples, each materialising its buffers while the handing-over rank
# initialises units) would interleave their draws and give values that depend on timing. One at a
# time, process-wide. (Any other thread drawing from the global generator meanwhile would still
# disturb them, as it would any seeded torch init.)
_SEEDED_INIT = threading.Lock()


def on_meta(model: nn.Module) -> bool:
    """Whether any of the model's parameters or buffers is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _is_hf(module: nn.Module) -> bool:
    """A transformers PreTrainedModel (duck-typed: transformers is imported only by its users)."""
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


def post_order(module: nn.Module, seen: set[int] | None = None) -> Iterator[nn.Module]:
    """The module's modules, children before their parent, each once."""
    seen = set() if seen is None else seen
    for child in module.children():
        if id(child) not in seen:
            yield from post_order(child, seen)
    if id(module) not in seen:
        seen.add(id(module))
        yield module


class Materializer:
    """Where a model's initial values come from when they are not the model's own: its modules'
    init (a meta-built model) or a checkpoint (`init_from`).

    Args:
        model (nn.Module): the model, on the meta device or built normally.
        seed (int): the base of the per-unit seeds (`seed + unit.index`).
        device: where a meta model's tensors are made (default: the CPU).
        reader (CheckpointReader, optional): the checkpoint the initial values come from.
    """

    def __init__(self, model: nn.Module, seed: int = 0, device: str | torch.device | None = None,
                 reader: CheckpointReader | None = None) -> None:
        self.model, self.seed, self.reader = model, int(seed), reader
        self.meta = on_meta(model)
        if device is not None and not self.meta:
            raise ValueError("device= is for models built on the meta device; this model's tensors are already on "
                             "a device: move it with model.to(device) instead")
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "meta":
            raise ValueError("device= must be where the model computes (cpu, cuda, ...), not meta")
        self.init_fn: dict[int, Callable[[nn.Module], None] | None] = {}  # module -> its tensors' init
        self._find_init(model, None)
        self.names: dict[int, list[str]] = {}  # parameter -> every name the model holds it by (tied: several)
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for mname, m in model.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                if p is not None:
                    self.names.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
                    self.holders.setdefault(id(p), []).append((m, pname))
        for k in self.names:
            self.names[k] = list(dict.fromkeys(self.names[k]))
        self.meta_units: set[int] = set()  # units built on meta (a unit built normally keeps its own values)

    @classmethod
    def for_model(cls, model: nn.Module, init_from: str | os.PathLike | None, seed: int,
                  device: str | torch.device | None) -> Materializer | None:
        """The model's materializer, prepared (every rank), or None where the model's own values are
        its initial values (built normally, no `init_from`)."""
        from .checkpoint_io import CheckpointReader

        reader = CheckpointReader(init_from) if init_from is not None else None
        if reader is None and not on_meta(model):
            if device is not None:
                raise ValueError("device= is for models built on the meta device; move this model with model.to()")
            return None
        m = cls(model, seed, device, reader)
        m.prepare()
        return m

    def _find_init(self, module: nn.Module, fn: Callable[[nn.Module], None] | None) -> None:
        if _is_hf(module):
            fn = module._init_weights  # type: ignore[assignment]
        if id(module) in self.init_fn:
            return
        self.init_fn[id(module)] = fn
        for child in module.children():
            self._find_init(child, fn)

    def _init_module(self, m: nn.Module) -> None:
        fn = self.init_fn.get(id(m))
        if fn is not None:
            fn(m)
        elif callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()  # type: ignore[operator]

    # -- every rank: buffers and frozen parameters -----------------------------------------------
    def prepare(self) -> None:
        """Make a meta model's buffers and frozen parameters on `device`, set by their module's init
        (checked), then from the checkpoint where it has them."""
        for mname, m in self.model.named_modules():
            made: list[tuple[str, torch.Tensor]] = []
            for bname, b in m._buffers.items():
                if b is not None and b.is_meta:
                    made.append((bname, torch.empty(b.shape, dtype=b.dtype, device=self.device)))
                    m._buffers[bname] = made[-1][1]
            for pname, p in m._parameters.items():
                if p is not None and p.is_meta and not p.requires_grad:
                    new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device), requires_grad=False)
                    self._replace(p, new)
                    made.append((pname, new))
            if made:
                self._init_checked(mname, m, made)
        if self.reader is not None:
            self.reader.load_resident(self.model)

    def _init_checked(self, mname: str, m: nn.Module, made: list[tuple[str, torch.Tensor]]) -> None:
        """Init `m` twice from different fills: what differs was not set by the init."""
        runs = []
        for fill in (0, 1):
            with torch.no_grad():
                for _, t in made:
                    t.fill_(fill)
                with _SEEDED_INIT, torch.random.fork_rng(devices=self._rng_devices()):
                    torch.manual_seed(self.seed)
                    self._init_module(m)
            runs.append([t.detach().clone() for _, t in made])
        unset = [f"{mname}.{n}" if mname else n for (n, _), a, b in zip(made, *runs)
                 if not torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                                    b.view(torch.uint8) if b.dtype != torch.bool else b)]
        if unset:
            raise MetaInitError(f"{', '.join(unset)} ({type(m).__name__}): built on the meta device and not set by its "
                                "module's init (reset_parameters() or the model's _init_weights); build that module "
                                "outside `with torch.device('meta')`, or start from a checkpoint (init_from=)")

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    def _replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """`new` in every module that holds `old` (tied: several)."""
        for m, name in self.holders.pop(id(old), []):
            m._parameters[name] = new
            self.holders.setdefault(id(new), []).append((m, name))
        self.names[id(new)] = self.names.pop(id(old), [])

    # -- every rank: the units' flat storage, never resident ---------------------------------------
    def flats(self, units: list[Unit], memory: MemoryTracker, stage: HostStage) -> list[FlatParams]:
        """Each unit's FlatParams; a meta unit's parameters become views into its storage, which
        is freed at once (a unit at a time: at most one unit and one parameter are ever made here)."""
        out = []
        for u in units:
            meta = any(p.is_meta for _, p in u.params)
            if meta and not all(p.is_meta for _, p in u.params):
                raise MetaInitError(f"unit {u.label()} holds parameters on the meta device and parameters built "
                                    f"normally ({', '.join(n for n, p in u.params if not p.is_meta)[:200]}): build "
                                    "the whole unit on meta (the network initialises it) or none of it")
            if meta:
                self.meta_units.add(u.index)
                for i, (name, p) in enumerate(u.params):
                    # a one-element stand-in: FlatParams copies it (one parameter at a time) and re-points .data
                    stand_in = torch.zeros((), dtype=p.dtype, device=self.device).expand(p.shape)
                    new = nn.Parameter(stand_in, requires_grad=p.requires_grad)
                    self._replace(p, new)
                    u.params[i] = (name, new)
            f = FlatParams(u, memory, stage)
            if meta:
                f.free()
            out.append(f)
        return out

    # -- the rank that hands the nodes their layers ------------------------------------------------
    def values(self, units: list[Unit], flats: list[FlatParams], index: int) -> np.ndarray:
        """Unit `index`'s initial values, flat float32: from the checkpoint, or by its modules' init
        under the seed `seed + index` (the unit materialised here for it, then freed)."""
        u, f = units[index], flats[index]
        if self.reader is not None:
            return self.reader.unit_values(u, self.names, getattr(self.model, "base_model_prefix", "") or "")
        if index not in self.meta_units:  # a unit built normally: its own values
            return f.flat.detach().to("cpu", torch.float32, copy=True).numpy()
        was_resident = f.resident
        f.allocate()
        try:
            mine = {id(p) for _, p in u.params}
            with torch.no_grad():
                f.flat.fill_(float("nan"))
                with _SEEDED_INIT, torch.random.fork_rng(devices=self._rng_devices()):
                    torch.manual_seed(self.seed + index)
                    for m in post_order(u.module):
                        own = list(m.parameters(recurse=False))
                        if any(p.requires_grad and id(p) not in mine for p in own):
                            continue  # a tied weight of another unit: that unit initialises it
                        others = [t for t in itertools.chain(m.buffers(recurse=False), own) if id(t) not in mine]
                        saved = [t.detach().clone() for t in others]
                        self._init_module(m)
                        for t, s in zip(others, saved):
                            t.copy_(s)  # as prepare() set them, on every rank
            bad = torch.isnan(f.flat)
            if bool(bad.any()):
                unset = [n for (n, _), (lo, hi) in zip(u.params, u.offsets) if bool(bad[lo:hi].any())]
                full = [f"{u.name}.{n}" if u.name else n for n in unset]
                raise MetaInitError(f"{', '.join(full[:6])} of unit {u.label()}: built on the meta device and not "
                                    "set by its module's init (reset_parameters() or the model's _init_weights); "
                                    "build the model normally, or start from a checkpoint (init_from=)")
            return f.flat.detach().to("cpu", torch.float32, copy=True).numpy()
        finally:
            if not was_resident:
                f.free()
