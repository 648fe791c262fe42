"""Copies between a unit's device and the host, for parameters on CUDA or any other non-CPU device.

The engine and the switch work on host memory (as a SmartNIC's DMA would), so a pulled unit is
converted to the parameters' dtype on the host and then copied to their device, and a gradient is
copied to the host before it is widened to float32 for its push. As in the torch backend's
staging (worker/backend/staging.py), a CUDA copy goes through a pinned host buffer, on the
device's current stream, and that stream is synchronised before the data is used (by the engine
on the host side, or by the next kernel reading a buffer that is about to be reused). Other
devices copy synchronously. CPU tensors are used in place.

One `HostStage` per direction: its pinned buffers are reused from call to call, which is safe
because every call returns only after its copy completed and ModelInNetwork's hooks run one at a
time (forward, then backward on autograd's thread).

`claim_devices`: torch runs the backward of every tensor on a non-CPU device on one autograd
thread per device and process, and ModelInNetwork's gradient hooks wait there for pushes and
pulls that need every rank. Two ranks of one job with a device in common in one process (threads)
would deadlock there, so the second rank to claim it raises `SharedDeviceError` (naming the fix:
one process per rank, as torchrun starts them) instead of hanging in its first backward.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable

import torch

from .memory import MemoryTracker


class HostStage:
    """Pinned host buffers, one per dtype, grown to the largest copy asked for.

    Args:
        memory (MemoryTracker): counts the buffers' bytes as "staging".
    """

    def __init__(self, memory: MemoryTracker):
        self.memory = memory
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def _buffer(self, dtype: torch.dtype, numel: int, pinned: bool) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            if buf is not None:
                self.memory.sub("staging", buf.numel() * buf.element_size())
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=pinned)
            self._buffers[dtype] = buf
            self.memory.add("staging", buf.numel() * buf.element_size())
        return buf[:numel]

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Write host tensor `src` (dst's dtype and numel) into `dst`, on any device; returns when done."""
        if dst.device.type == "cpu":
            dst.copy_(src)
            return
        cuda = dst.device.type == "cuda"
        host = self._buffer(dst.dtype, dst.numel(), pinned=cuda)
        host.copy_(src.reshape(-1))
        if cuda:
            stream = torch.cuda.current_stream(dst.device)
            with torch.cuda.stream(stream):
                dst.copy_(host.view(dst.shape), non_blocking=True)
            stream.synchronize()  # the pinned buffer is rewritten by the next call
        else:
            dst.copy_(host.view(dst.shape))

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        """`src` as a flat host tensor of its dtype, valid until the next call (CPU: `src` itself)."""
        if src.device.type == "cpu":
            return src.reshape(-1)
        cuda = src.device.type == "cuda"
        host = self._buffer(src.dtype, src.numel(), pinned=cuda)
        if cuda:
            stream = torch.cuda.current_stream(src.device)
            with torch.cuda.stream(stream):
                host.copy_(src.reshape(-1), non_blocking=True)
            stream.synchronize()  # the caller reads the host buffer next
        else:
            host.copy_(src.reshape(-1))
        return host


class SharedDeviceError(RuntimeError):
    """Two ranks of one ModelInNetwork job use the same non-CPU device from one process."""


_claims: collections.Counter[tuple[str, str, int]] = collections.Counter()  # (job, device, rank) -> live claims
_claims_lock = threading.Lock()


def claim_devices(job_id: str, rank: int, devices: Iterable[torch.device]) -> Callable[[], None]:
    """Record that `rank` of job `job_id` computes on `devices` in this process; returns the function
    that releases the claim (once; ModelInNetwork.close() calls it).

    Raises:
        SharedDeviceError: another live rank of the same job in this process claimed one of the same
            non-CPU devices: torch would run both ranks' backward on that device's one autograd
            thread, where a gradient hook waiting for the other rank blocks it for good.
    """
    keys = sorted({(job_id, str(d), rank) for d in devices if d.type not in ("cpu", "meta")})
    with _claims_lock:
        for job, device, _ in keys:
            others = sorted(r for (j, d, r), n in _claims.items() if n > 0 and j == job and d == device and r != rank)
            if others:
                raise SharedDeviceError(
                    f"rank {rank} of job {job} computes on {device}, and rank {others[0]} of the same job does too in "
                    f"this process: torch runs the backward of every {device} tensor on one autograd thread per "
                    "process, where one rank's gradient hook would wait for the other rank's gradients for good. Run "
                    "one process per rank (torchrun, torch.multiprocessing.spawn or subprocesses), as real jobs do")
        _claims.update(keys)
    released = [False]

    def release() -> None:
        with _claims_lock:
            if not released[0]:
                released[0] = True
                _claims.subtract(keys)
                for k in keys:
                    if _claims[k] <= 0:
                        del _claims[k]
    return release
