"""How a model is cut into units: the modules whose parameters travel as one layer buffer.

A unit is a module whose parameters are used only inside its own forward (a transformer block,
an embedding, a norm, a head). Its trainable parameters are flattened, in `named_parameters()`
order, into one buffer: layer `index` on the optimizer node (its `LayerSpec`). The default cut
descends into the model's containers (`nn.ModuleList`, `nn.Sequential`, `nn.ModuleDict`, from
the top), and into modules without parameters of their own that hold a `ModuleList` or
`ModuleDict` of parameter-holding modules somewhere below (a Hugging Face `LlamaModel`, `OPTDecoder`,
`GPT2Model`: their stack of blocks), and makes every other parameter-holding module a unit: for a
GPT that is one unit per block plus the embeddings, the final norm and the head.

Tied parameters (a tensor that two modules hold: a causal LM's input embedding and output head)
belong to the first unit that holds them (its owner, in cut order): they are one layer on the
node, stepped once with the sum of both uses' gradients. Every later module of the cut that holds
them is one of the owner's `sites`: its forward and backward pull the owner too (a module whose
only parameters are borrowed, such as a tied `lm_head`, is a site and no unit of its own).

Parameters may be float32, bfloat16 or float16 (one dtype per unit: its flat storage is one
tensor), on any one device for the whole model. What crosses the network does not depend on it:
gradients travel as float32 and the node keeps fp32 masters (README.md, "Dtypes and devices").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from luwu.dataplane.optimizer.spec import LayerSpec
from luwu.dataplane.protocol import DTYPE_ITEMSIZE, Dtype

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a unit's flat storage may hold
WIRE_ITEMSIZE = DTYPE_ITEMSIZE[Dtype.FP32]  # a pushed gradient's element: float32 whatever the parameters' dtype


class UnitError(ValueError):
    """The model cannot be cut into units as asked; the message says what to change."""


@dataclass(eq=False)
class Unit:
    index: int  # the layer id on the optimizer node; units are numbered in forward order
    name: str  # the module's path in the model ("" for the model itself)
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]  # trainable parameters, names relative to `module`
    offsets: list[tuple[int, int]] = field(default_factory=list)  # (lo, hi) of each parameter in the flat buffer
    sites: list[tuple[str, nn.Module]] = field(default_factory=list)  # other modules using its (tied) parameters

    def __post_init__(self):
        lo = 0
        self.offsets = []
        for _, p in self.params:
            self.offsets.append((lo, lo + p.numel()))
            lo += p.numel()

    @property
    def numel(self) -> int:
        return self.offsets[-1][1] if self.offsets else 0

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0][1].dtype if self.params else torch.float32

    @property
    def device(self) -> torch.device:
        return self.params[0][1].device if self.params else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's parameters where they are resident (in their dtype)."""
        return self.dtype.itemsize * self.numel

    @property
    def wire_nbytes(self) -> int:
        """Bytes of the unit's gradient as pushed (float32)."""
        return WIRE_ITEMSIZE * self.numel

    def layer_spec(self) -> LayerSpec:
        return LayerSpec.from_named_parameters(self.index, self.params, no_decay="auto")

    def label(self) -> str:
        return self.name or type(self.module).__name__


def _default_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    direct = [n for n, p in model.named_parameters(recurse=False) if p.requires_grad]
    if direct and not isinstance(model, CONTAINERS):
        raise UnitError(f"the model holds parameters directly ({', '.join(direct)}), outside any submodule: they "
                        "cannot be fetched per layer. Move them into a submodule, or pass units=[...] including "
                        "the model itself")
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, CONTAINERS):
                own = [n for n, p in child.named_parameters(recurse=False) if p.requires_grad]
                if own:
                    raise UnitError(f"container {path!r} holds parameters directly ({', '.join(own)}); "
                                    "pass units=[...]")
                visit(path, child)
            elif _wraps_a_stack(child):  # e.g. a Hugging Face model body: its blocks become units
                visit(path, child)
            elif any(p.requires_grad for p in child.parameters()):
                out.append((path, child))

    visit("", model)
    return out


def _trainable_here(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _wraps_a_stack(module: nn.Module) -> bool:
    """No trainable parameters of its own, and a ModuleList or ModuleDict of parameter-holding
    modules somewhere below (through modules without parameters of their own): a model body whose
    blocks should be units, not one unit. nn.Sequential does not count (a block's MLP often is one)."""
    if _trainable_here(module):
        return False
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            if sum(any(p.requires_grad for p in m.parameters()) for m in child.children()) >= 1:
                return True
        elif not isinstance(child, nn.Sequential) and _wraps_a_stack(child):
            return True
    return False


def _explicit_modules(model: nn.Module, units: list) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for u in units:
        if isinstance(u, str):
            try:
                u = model.get_submodule(u)
            except AttributeError as e:
                raise UnitError(f"units: the model has no submodule {u!r} ({e})") from None
        if not isinstance(u, nn.Module):
            raise UnitError(f"units: expected modules or module paths, got {type(u).__name__}")
        if id(u) not in names:
            raise UnitError(f"units: a {type(u).__name__} that is not part of the model")
        out.append((names[id(u)], u))
    return out


def _names(names: list[str]) -> str:
    return f"{', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}"


def _check_dtypes_and_device(units: list[Unit]) -> None:
    """One device for the whole model; each unit's parameters of one supported dtype."""
    def full(u: Unit, name: str) -> str:
        return f"{u.name}.{name}" if u.name else name

    bad = [f"{full(u, n)} ({p.dtype})" for u in units for n, p in u.params if p.dtype not in DTYPES]
    if bad:
        raise UnitError(f"parameters {_names(bad)}: ModelInNetwork trains float32, bfloat16 or float16 parameters; "
                        "cast the model (e.g. model.to(torch.bfloat16)) or freeze those parameters")
    by_device: dict[str, list[str]] = {}
    for u in units:
        for n, p in u.params:
            by_device.setdefault(str(p.device), []).append(full(u, n))
    if len(by_device) > 1 and "meta" in by_device:
        raise UnitError(f"parameters {_names(by_device['meta'])} are on the meta device and others are not: build the "
                        "whole model under `with torch.device('meta')` (ModelInNetwork then initialises it unit by "
                        "unit, materialize.py) or build it normally")
    if len(by_device) > 1:
        where = "; ".join(f"{dev}: {_names(names)}" for dev, names in by_device.items())
        raise UnitError(f"the model's parameters are on {len(by_device)} devices ({where}): ModelInNetwork needs "
                        "all of them on one device; move the model there with model.to(device)")
    for u in units:
        dtypes = {p.dtype for _, p in u.params}
        if len(dtypes) > 1:
            mixed = _names([f"{full(u, n)} ({p.dtype})" for n, p in u.params])
            raise UnitError(f"unit {u.label()!r} mixes dtypes ({mixed}): a unit's parameters travel as one flat "
                            f"buffer of one dtype; cast the module (model.get_submodule({u.name!r}).to(dtype)) or "
                            "cut the model so that each unit has one dtype (units=[...])")


def _check_nesting(modules: list[tuple[str, nn.Module]]) -> None:
    cut = {id(m): path for path, m in modules}
    for path, module in modules:
        for sub in module.modules():
            if sub is not module and id(sub) in cut:
                raise UnitError(f"units {path!r} and {cut[id(sub)]!r} nest (one is inside the other): the inner one's "
                                "parameters would be in two units; units must not nest or overlap, pass units=[...] "
                                "without the outer one")


def split_units(model: nn.Module, units: list | None = None) -> list[Unit]:
    """The model's units in registration order (taken as forward order), checked: every trainable
    parameter in exactly one unit (a tied parameter in the first unit holding it, the later modules
    holding it its `sites`), units not nested, all on one device, each unit of one dtype among
    float32, bfloat16 and float16."""
    modules = _default_modules(model) if units is None else _explicit_modules(model, units)
    _check_nesting(modules)
    owner: dict[int, Unit | None] = {}  # parameter -> its unit (None while its module's own unit is being made)
    out: list[Unit] = []
    for path, module in modules:
        params, borrowed = [], []
        for pname, p in module.named_parameters():
            if not p.requires_grad:
                continue  # frozen parameters stay on the worker, as ordinary tensors
            if id(p) in owner:  # tied: the first unit holding it owns it, this module is one of its sites
                first = owner[id(p)]
                if first is not None and first.module is not module and all(m is not module for _, m in first.sites):
                    borrowed.append(first)
                continue
            owner[id(p)] = None
            params.append((pname, p))
        for first in dict.fromkeys(borrowed):
            first.sites.append((path, module))
        if params:
            unit = Unit(len(out), path, module, params)
            out.append(unit)
            for _, p in params:
                owner[id(p)] = unit
    if not out:
        raise UnitError("the model has no trainable parameters")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        raise UnitError(f"trainable parameters outside every unit: {', '.join(missing[:8])}"
                        f"{' ...' if len(missing) > 8 else ''}; add their modules to units=[...]")
    _check_dtypes_and_device(out)
    return out
