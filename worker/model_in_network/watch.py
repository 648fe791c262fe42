"""What autograd does with a unit's parameters, as ModelInNetwork's hooks need to know it.

`SavedWatch` learns whether a unit's forward saves its parameters for backward (then backward
needs them back: a pull before its backward, unless kept). One saved-tensor hook serves every
unit being watched at once (a module that is one unit's own and another's site of tied
parameters runs both units' hooks: nested hooks would hide the outer one's saves). A unit once
seen saving is taken to save from then on and is no longer watched (no Python call per saved
tensor); a unit seen not saving stays watched. Where someone else's saved-tensor hooks are active
around the unit (an activation checkpoint around it, `save_on_cpu`), it is not watched at all: ours
would be innermost and take the tensors from theirs (a checkpoint would then keep them); the unit
is then assumed to save its parameters (a needless pull at worst).

`output_tensors(output)`: the tensors in a module's output (tuples, lists, dicts, a Hugging Face
`ModelOutput`), whose gradients announce the unit's backward.

`in_backward()`: whether the calling thread runs inside an autograd backward, as a forward
recomputed by activation checkpointing does.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

KNOWN, WATCHED, ASSUMED = "known", "watched", "assumed"  # how a unit's forward learns whether it saves


def in_backward() -> bool:
    """True inside an autograd backward (a recomputed forward of an activation checkpoint)."""
    return bool(torch._C._current_graph_task_id() != -1)


def _others_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


class SavedWatch:
    """Whether autograd saves each unit's parameters (by their storage), learned forward by forward."""

    def __init__(self) -> None:
        self.saw: dict[int, bool] = {}  # unit -> seen saving in its forward (this one, or for good once KNOWN)
        self._ptrs: dict[int, int] = {}  # storage data_ptr -> unit, for the units being watched now
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    def begin(self, unit: int, storage: torch.UntypedStorage) -> str:
        """A forward of `unit` with autograd on starts. Returns KNOWN (seen saving before: not
        watched), WATCHED (watched until `end`) or ASSUMED (others' hooks around it: not watched)."""
        if self.saw.get(unit):
            return KNOWN
        if self._ctx is None and _others_hooks_active():
            return ASSUMED
        self.saw[unit] = False
        ptr = storage.data_ptr()
        if ptr:
            self._ptrs[ptr] = unit
        if self._ctx is None:
            ptrs, saw = self._ptrs, self.saw

            def pack(t: torch.Tensor) -> torch.Tensor:
                u = ptrs.get(t.untyped_storage().data_ptr())
                if u is not None:
                    saw[u] = True
                return t

            self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, _same)
            self._ctx.__enter__()
        return WATCHED

    def end(self, unit: int, storage: torch.UntypedStorage) -> bool:
        """The watched forward of `unit` ended: whether it saved its parameters."""
        self._ptrs.pop(storage.data_ptr(), None)
        if not self._ptrs and self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
        return self.saw.get(unit, False)

    def learn(self, unit: int) -> None:
        """`unit`'s backward was seen needing its parameters (a recomputed forward used them)."""
        self.saw[unit] = True


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def output_tensors(obj: object) -> Iterator[torch.Tensor]:
    """The tensors in `obj`: a tensor, or tuples, lists and dicts (a ModelOutput is one) of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from output_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from output_tensors(x)
