"""A unit's parameters as views into one flat storage that comes and goes.

The parameters stay the model's own `nn.Parameter` objects; their `.data` become views into the
unit's flat storage, in the parameters' dtype (float32, bfloat16 or float16) on their device.
Freeing resizes that storage to 0 bytes (every view, and every tensor autograd saved from them,
keeps pointing at the same storage object); materialising resizes it back and writes the pulled
values in, which restores the saved tensors too. Writes go through a separate tensor on the
storage so that autograd's version counters see no in-place change.

Pulled values arrive as float32 on the host (the engine widens bf16/fp16 served copies exactly);
they are rounded to the parameters' dtype on the host (round to nearest even, torch's cast: exact
when the node serves that dtype) and copied to the device (devices.py). A value beyond the dtype's
range (a fp16 model whose fp32 masters grew past 65504) is an error, never an inf. A bf16 model
served bf16 gets the served bits themselves (uint16: `pull_bits`), copied in once, never widened.
"""

from __future__ import annotations

import numpy as np
import torch

from .devices import HostStage
from .memory import MemoryTracker
from .units import Unit


class FlatParams:
    """One unit's flat parameter storage.

    Args:
        unit (Unit): the unit; its parameters' `.data` become views into the flat storage.
        memory (MemoryTracker): counts the resident bytes as "params".
        stage (HostStage, optional): host buffers for copies to a non-CPU device (one is made if
            None; CPU units never use it).
    """

    def __init__(self, unit: Unit, memory: MemoryTracker, stage: HostStage | None = None):
        self.unit = unit
        self.memory = memory
        self.stage = stage if stage is not None else HostStage(memory)
        self.numel = unit.numel
        self.dtype, self.device = unit.dtype, unit.device
        self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for (_, p), (lo, hi) in zip(unit.params, unit.offsets):
                self.flat[lo:hi].copy_(p.data.reshape(-1))
                p.data = self.flat[lo:hi].view(p.shape)
        self.storage = self.flat.untyped_storage()
        self.nbytes = unit.nbytes
        self._on_cpu = self.device.type == "cpu"
        # the tensor materialise writes through (its own version counter), kept across free/resize:
        # like the parameters' views, it follows the storage wherever resize_ puts its bytes
        self._writer = torch.empty(0, dtype=self.dtype, device=self.device).set_(self.storage, 0, (self.numel,), (1,))
        self.resident = True
        self.version = 0  # the optimizer version the resident values are
        memory.add("params", unit.nbytes)

    def initial(self) -> dict[str, np.ndarray]:
        """The current values by parameter name (fp32 copies), e.g. to hand to the optimizer node."""
        if not self.resident:
            raise RuntimeError(f"unit {self.unit.label()} is not resident")
        # always a copy: .numpy() on the flat tensor itself would pin its storage (no more resize_)
        return {name: self.flat[lo:hi].to(device="cpu", dtype=torch.float32, copy=True).numpy().reshape(tuple(p.shape))
                for (name, p), (lo, hi) in zip(self.unit.params, self.unit.offsets)}

    def free(self) -> None:
        if self.resident:
            self.storage.resize_(0)
            self.resident = False
            self.memory.sub("params", self.nbytes)

    def allocate(self) -> None:
        """Make the storage resident without writing it (the parameters hold whatever the memory
        held), for an initialiser that fills them in place (materialize.py)."""
        if not self.resident:
            self.storage.resize_(self.nbytes)
            self.resident = True
            self.memory.add("params", self.nbytes)

    def materialise(self, values: np.ndarray, version: int) -> None:
        """Make the parameters hold `values` (flat float32 on the host, the unit's numel), rounded
        to the parameters' dtype; or (uint16, for bfloat16 parameters: `pull_bits`) their bf16
        bits, copied in as they are.

        Raises:
            OverflowError: a finite value is beyond the parameters' dtype (float16 above 65504).
        """
        if values.size != self.numel:
            raise ValueError(f"unit {self.unit.label()}: got {values.size} values for {self.numel} parameters")
        if not self.resident:
            self.storage.resize_(self.nbytes)
            self.resident = True
            self.memory.add("params", self.nbytes)
        writer = self._writer
        src = torch.from_numpy(values)
        if values.dtype == np.uint16:  # bf16 bits: one copy, nothing to round or range-check
            if self.dtype != torch.bfloat16:
                raise TypeError(f"unit {self.unit.label()}: bf16 bits for {self.dtype} parameters")
            self.stage.to_device(writer, src.view(torch.bfloat16))
            self.version = version
            return
        if self._on_cpu:
            writer.copy_(src)  # converts in the same pass
            host = writer
        else:
            host = src if self.dtype == torch.float32 else src.to(self.dtype)
        if self.dtype != torch.float32:
            check_range(src, host, f"unit {self.unit.label()}")
        if not self._on_cpu:
            self.stage.to_device(writer, host)
        self.version = version

    def values(self) -> torch.Tensor:
        """A copy of the resident values (flat)."""
        if not self.resident:
            raise RuntimeError(f"unit {self.unit.label()} is not resident")
        return self.flat.detach().clone()


def pull_bits(unit: Unit, served_dtype: str) -> bool:
    """Whether `unit`'s pulls land as raw bf16 bits (uint16) rather than widened to float32: a
    bfloat16 unit served bf16, whose served values are already its parameters' (no widen, no round)."""
    return served_dtype == "bf16" and unit.dtype == torch.bfloat16


def check_range(src: torch.Tensor, cast: torch.Tensor, what: str) -> None:
    """Raise OverflowError if `cast` (`src` rounded to a narrower dtype) turned a finite value into inf."""
    if not bool(torch.isinf(cast).any()):
        return  # the usual case: one read pass
    over = torch.isinf(cast) & torch.isfinite(src)
    if bool(over.any()):
        worst = float(src[over].abs().max())
        raise OverflowError(f"{what}: the optimizer node's parameters reach {worst:.6g}, beyond {cast.dtype}'s largest "
                            f"finite value {torch.finfo(cast.dtype).max:.6g} ({int(over.sum())} of {src.numel()} values): the model "
                            "cannot hold them; train it in bfloat16 or float32, or keep the parameters smaller "
                            "(weight decay, a lower learning rate)")
