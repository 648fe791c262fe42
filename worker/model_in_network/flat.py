"""A unit's parameters as views into one flat float32 storage that comes and goes.

The parameters stay the model's own `nn.Parameter` objects; their `.data` become views into the
unit's flat storage. Freeing resizes that storage to 0 bytes (every view, and every tensor
autograd saved from them, keeps pointing at the same storage object); materialising resizes it
back and writes the pulled values in, which restores the saved tensors too. Writes go through
a separate tensor on the storage so that autograd's version counters see no in-place change.
"""

from __future__ import annotations

import numpy as np
import torch

from .memory import MemoryTracker
from .units import Unit


class FlatParams:
    def __init__(self, unit: Unit, memory: MemoryTracker):
        self.unit = unit
        self.memory = memory
        self.numel = unit.numel
        self.flat = torch.empty(self.numel, dtype=torch.float32)
        with torch.no_grad():
            for (_, p), (lo, hi) in zip(unit.params, unit.offsets):
                self.flat[lo:hi].copy_(p.data.reshape(-1))
                p.data = self.flat[lo:hi].view(p.shape)
        self.storage = self.flat.untyped_storage()
        self.resident = True
        self.version = 0  # the optimizer version the resident values are
        memory.add("params", unit.nbytes)

    def initial(self) -> dict[str, np.ndarray]:
        """The current values by parameter name (fp32 copies), e.g. to hand to the optimizer node."""
        if not self.resident:
            raise RuntimeError(f"unit {self.unit.label()} is not resident")
        # never .numpy() on the flat tensor itself: that pins its storage (no more resize_)
        return {name: self.flat[lo:hi].clone().numpy().reshape(tuple(p.shape))
                for (name, p), (lo, hi) in zip(self.unit.params, self.unit.offsets)}

    def free(self) -> None:
        if self.resident:
            self.storage.resize_(0)
            self.resident = False
            self.memory.sub("params", self.unit.nbytes)

    def materialise(self, values: np.ndarray, version: int) -> None:
        """Make the parameters hold `values` (flat float32, the unit's numel)."""
        if values.size != self.numel:
            raise ValueError(f"unit {self.unit.label()}: got {values.size} values for {self.numel} parameters")
        if not self.resident:
            self.storage.resize_(self.numel * 4)
            self.resident = True
            self.memory.add("params", self.unit.nbytes)
        writer = torch.empty(0, dtype=torch.float32).set_(self.storage, 0, (self.numel,), (1,))
        writer.copy_(torch.from_numpy(values))
        self.version = version

    def values(self) -> torch.Tensor:
        """A copy of the resident values (flat)."""
        if not self.resident:
            raise RuntimeError(f"unit {self.unit.label()} is not resident")
        return self.flat.detach().clone()
