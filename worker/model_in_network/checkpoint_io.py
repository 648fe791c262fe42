"""Model values in and out of the network one unit at a time: a `save_pretrained` safetensors
directory streamed to the nodes (`CheckpointReader`, `init_from=`), the trained model written back
as one (`save_pretrained`), and the pull of one unit's current values (`pull_unit`, what
`ModelInNetwork.gather()` does for every unit).

Reading: `model.safetensors`, or the shards `model.safetensors.index.json` maps; each tensor is
read on its own (`safetensors.safe_open`, memory-mapped), when its unit is handed to the nodes. A
parameter is looked up by every name the model holds it by (a tied weight: `model.embed_tokens.weight`
and `lm_head.weight`, whichever the checkpoint stored; HF stores it once), then by those names with
the model's `base_model_prefix` added or removed (a bare `LlamaModel` checkpoint for a
`LlamaForCausalLM`). A parameter the checkpoint lacks is a `CheckpointError` naming the keys tried
(never a default), as is a shape that differs. Buffers and frozen parameters are read where the
checkpoint has them (HF saves no non-persistent buffers: the module's init sets those).

Writing (`save_pretrained`, a collective: every rank calls it at the same point, as `gather()`,
since pulls are matched across workers; one rank, `rank=0` by default, writes): one safetensors file
per unit (`model-00001-of-000NN.safetensors`, HF's shard names) holding that unit's parameters at the
current version (the node's served copy rounded to the parameters' dtype, as a pull is), under their
first name (a tied weight once, as HF saves it), one more file for what stays on the worker (frozen
parameters, persistent buffers), `model.safetensors.index.json`, and the model's `config.json`
(and `generation_config.json`) when it has a `config`. The writer holds one unit at a time.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from .flat import check_range
from .units import Unit

if TYPE_CHECKING:
    from luwu.dataplane.engine.handles import Handle
    from luwu.worker.engine_link import Staging

    from .hierarchy import ServerSteps
    from .staging import StagingPool

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Pulling(Protocol):
    """What `pull_unit` and `save_pretrained` use of a `ModelInNetwork` (model.py). Declared here, not
    imported: model.py imports this module, and no module imports one that imports it back
    (tests/test_layering.py)."""

    @property
    def rank(self) -> int: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def units(self) -> list[Unit]: ...
    @property
    def version(self) -> int: ...
    @property
    def pool(self) -> StagingPool: ...
    @property
    def stats(self) -> Counter[str]: ...
    @property
    def server(self) -> ServerSteps | None: ...
    def _pull_pieces(self, st: Staging, unit: int, version: int) -> Handle: ...
    def _pulled(self, st: Staging, unit: int) -> np.ndarray: ...
    def _wait(self, handle: Handle, what: str | Callable[[], str], kind: str) -> Any: ...
    def _server_step(self, step: str, *args: Any) -> None: ...


class CheckpointError(ValueError):
    """A checkpoint directory that cannot start this model; the message says what is missing."""


class CheckpointReader:
    """A `save_pretrained` safetensors directory, read one tensor at a time.

    Args:
        path: the directory (holding model.safetensors or model.safetensors.index.json).

    Raises:
        CheckpointError: neither file is there.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._safe_open = safe_open
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            self.files = {k: self.path / f for k, f in weight_map.items()}
        elif (self.path / SINGLE).is_file():
            with safe_open(str(self.path / SINGLE), framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), self.path / SINGLE)  # noqa: SIM118 - safe_open has no __iter__
        else:
            raise CheckpointError(f"{self.path}: no {SINGLE} or {INDEX}; pass a directory written by "
                                  "save_pretrained(..., safe_serialization=True) or ModelInNetwork.save_pretrained")
        self._open: dict[Path, Any] = {}

    def get(self, key: str) -> torch.Tensor:
        """One tensor, as stored."""
        file = self.files[key]
        if file not in self._open:
            self._open[file] = self._safe_open(str(file), framework="pt")
        return self._open[file].get_tensor(key)

    def find(self, names: list[str], prefix: str = "") -> str | None:
        """The first of `names` (or of them with `prefix.` added or removed) the checkpoint holds."""
        tries = list(names)
        if prefix:
            tries += [n[len(prefix) + 1:] for n in names if n.startswith(prefix + ".")]
            tries += [f"{prefix}.{n}" for n in names]
        return next((k for k in tries if k in self.files), None)

    def _tensor(self, names: list[str], shape: torch.Size, prefix: str) -> torch.Tensor:
        key = self.find(names, prefix)
        if key is None:
            raise CheckpointError(f"{self.path}: no tensor for {' / '.join(names)} (keys tried with and without "
                                  f"the prefix {prefix!r}); it holds {len(self.files)} tensors, e.g. "
                                  f"{', '.join(list(self.files)[:4])}: is it this model's checkpoint?")
        t = self.get(key)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: {key} has shape {tuple(t.shape)}, the model's {names[0]} "
                                  f"{tuple(shape)}: is it this model's config?")
        return t

    def unit_values(self, unit: Unit, names: dict[int, list[str]], prefix: str = "") -> np.ndarray:
        """The unit's parameters, flat float32 in its order (`names`: parameter id -> every name the
        model holds it by)."""
        out = np.empty(unit.numel, dtype=np.float32)
        for (pname, p), (lo, hi) in zip(unit.params, unit.offsets):
            full = f"{unit.name}.{pname}" if unit.name else pname
            t = self._tensor(names.get(id(p)) or [full], p.shape, prefix)
            out[lo:hi] = t.to(torch.float32).reshape(-1).numpy()
        return out

    def load_resident(self, model: nn.Module) -> None:
        """Buffers and frozen parameters from the checkpoint, where it has them."""
        prefix = getattr(model, "base_model_prefix", "") or ""
        with torch.no_grad():
            for name, t in [*model.named_buffers(), *((n, p) for n, p in model.named_parameters()
                                                      if not p.requires_grad)]:
                key = self.find([name], prefix)
                if key is not None and not t.is_meta:
                    t.copy_(self._tensor([name], t.shape, prefix))


def pull_unit(mnn: Pulling, u: Unit) -> dict[str, torch.Tensor]:
    """Unit `u`'s parameters at mnn's current version by full name, in their dtype on their device
    (the node's served copy rounded as a pull is). A collective, as `gather()`."""
    st = mnn.pool.acquire()
    try:
        h = mnn._pull_pieces(st, u.index, mnn.version)
        mnn.stats["pulls"] += 1
        mnn._wait(h, f"gather of unit {u.label()}", "pull")
        if mnn.server is not None:
            mnn._server_step("all_gather", u.index, mnn.version, mnn._pulled(st, u.index), f"gather of unit {u.label()}",
                             "gather")
        pulled = mnn._pulled(st, u.index)
        flat = torch.from_numpy(pulled.copy())
    finally:
        mnn.pool.release(st)
    if pulled.dtype == np.uint16:  # a bf16 unit served bf16: its bits, as they are
        flat = flat.view(torch.bfloat16)
    elif u.dtype != torch.float32:
        wide, flat = flat, flat.to(u.dtype)
        check_range(wide, flat, f"gather of unit {u.label()}")
    flat = flat.to(u.device)
    return {f"{u.name}.{name}" if u.name else name: flat[lo:hi].view(p.shape).clone()
            for (name, p), (lo, hi) in zip(u.params, u.offsets)}


def save_pretrained(mnn: Pulling, path: str | os.PathLike, rank: int = 0) -> Path | None:
    """Write mnn's model at its current version as a `save_pretrained` directory, unit by unit
    (module docstring). A collective: every rank calls it; `rank` writes. Returns the directory on
    the writing rank, None elsewhere."""
    from safetensors.torch import save_file

    write = mnn.rank == rank
    out = Path(path)
    if write:
        out.mkdir(parents=True, exist_ok=True)
    model = mnn.module
    in_units = {f"{u.name}.{n}" if u.name else n for u in mnn.units for n, _ in u.params}
    aliases = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad} - in_units
    resident = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
                if k not in in_units and k not in aliases}
    n_files = len(mnn.units) + (1 if resident else 0)
    weight_map: dict[str, str] = {}
    total = 0
    for i, u in enumerate(mnn.units):
        tensors = pull_unit(mnn, u)
        name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        if write:
            save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        del tensors
    if resident:
        name = f"model-{n_files:05d}-of-{n_files:05d}.safetensors"
        if write:
            save_file({k: v.cpu().contiguous() for k, v in resident.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(resident, name))
        total += sum(v.numel() * v.element_size() for v in resident.values())
    if not write:
        return None
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                                        indent=2) + "\n")
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(out)
    return out


def meta_model_from_pretrained(path: str | os.PathLike) -> nn.Module:
    """The `transformers` model a save_pretrained directory's config.json names (its first
    `architectures` entry, else a causal LM), built on the meta device (no memory for parameters)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        if cls is not None:
            return cls._from_config(config)
        return transformers.AutoModelForCausalLM.from_config(config)
