"""How torch's own tools see a luwu group: the device types it serves and a Backend per device.

c10d keeps a registered backend's devices in the C++ ProcessGroup (`pg._device_types`,
`pg._get_backend(device)`), filled from the per-device `Backend` objects a creator returns. A
Backend written in Python cannot be built on torch 2.11-2.13 (`torch._C._distributed_c10d.Backend`
has no Python constructor), so luwu's creator returns its ProcessGroup, which c10d keeps as is and
whose own device table stays empty. `TorchView` (a mixin of `LuwuProcessGroup`) answers those
queries instead, as a group of a backend registered with `devices=["cpu", "cuda"]` would:
`_device_types` lists the devices of the registration (`Backend.backend_capability["luwu"]`), and
`_get_backend(device)` returns a `LuwuBackend`, this group seen as that device's backend (its
collectives are the group's; it cannot split, coalesce, estimate times or allocate tensors). So
`dcp.async_save` ("a CPU backend must be enabled"), `_get_pg_default_device`,
`_get_object_coll_device`, FSDP2's buffer allocation and DeviceMesh find what they look for.
`group.set_timeout(timedelta)` changes the deadline of the group's later operations.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

BACKEND_NAME = "luwu"
DEFAULT_DEVICES = ("cpu", "cuda")  # what register() declares (CUDA tensors are staged through host buffers)

# what a LuwuBackend hands on to its group: the collectives c10d's Backend offers
_FORWARDED = frozenset({
    "allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced", "broadcast", "allgather", "_allgather_base", "all_gather_single",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter", "alltoall", "alltoall_base",
    "all_to_all_single", "barrier", "send", "recv", "recv_anysource",
})


def registered_devices() -> list[str]:
    """The device types the `luwu` registration declares (c10d's `Backend.backend_capability`)."""
    import torch.distributed as dist

    return list(dist.Backend.backend_capability.get(BACKEND_NAME, DEFAULT_DEVICES))


class LuwuBackend:
    """A luwu group seen as c10d's Backend for one device type: what `pg._get_backend(device)`
    returns. Its collectives are the group's own (same order, same Work).

    Args:
        group: the `LuwuProcessGroup`.
        device (torch.device): the device type it serves.

    Example:
        >>> dist.group.WORLD._get_backend(torch.device("cpu")).name()
        'luwu'
    """

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def __init__(self, group: Any, device: torch.device):
        self._group = group
        self.device = device

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return int(self._group.rank())

    def size(self) -> int:
        return int(self._group.size())

    @property
    def options(self) -> Any:
        from torch._C._distributed_c10d import Backend

        return Backend.Options(BACKEND_NAME, self._group._timeout)

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False

    def set_timeout(self, timeout: timedelta) -> None:
        self._group.set_timeout(timeout)

    _set_default_timeout = set_timeout

    def eager_connect_single_device(self, device: torch.device | None) -> None:
        """Nothing to connect: the group is connected when it is created."""

    def shutdown(self) -> None:
        self._group.shutdown()

    def abort(self) -> None:
        self._group.abort()

    def __getattr__(self, name: str) -> Any:
        if name in _FORWARDED:
            return getattr(self._group, name)
        raise AttributeError(f"the luwu backend has no {name!r} (a pure-Python c10d backend: see "
                             "docs/backend.md 'What torch sees')")

    def __repr__(self) -> str:
        return f"LuwuBackend(device={self.device.type}, rank={self.rank()}, size={self.size()})"


class TorchView:
    """Mixin of `LuwuProcessGroup`: the device table c10d would hold for a registered backend."""

    if TYPE_CHECKING:
        _timeout: timedelta

        def rank(self) -> int: ...

        def size(self) -> int: ...

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in registered_devices()]

    def _get_backend(self, device: torch.device | str) -> LuwuBackend:
        dev = torch.device(device)
        if dev.type not in registered_devices():
            raise RuntimeError(f"No backend type associated with device type {dev.type} "
                               f"(the luwu backend serves {', '.join(registered_devices())})")
        cache = self.__dict__.setdefault("_luwu_backends", {})
        if dev.type not in cache:
            cache[dev.type] = LuwuBackend(self, torch.device(dev.type))
        return cache[dev.type]

    def set_timeout(self, timeout: timedelta) -> None:
        """The deadline of the group's operations submitted from now on (c10d's
        `ProcessGroup.set_timeout`)."""
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"luwu set_timeout: needs a positive datetime.timedelta, got {timeout!r}")
        self._timeout = timeout
