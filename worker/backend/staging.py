"""Tensors on other devices (CUDA and any non-CPU device) cross the luwu backend through host
buffers: the engine and the switch work on host memory, as a SmartNIC's DMA would.

A collective called with device tensors runs on host copies: each device tensor is copied into
a host buffer (pinned for CUDA, on the tensor's current stream, and that stream is synchronised
before the engine reads the buffer), the collective runs on the host buffers, and when it is
done the output buffers are copied back on the same streams; the returned Work completes only
after those copies, so `work.wait()` and the Work's future see the device tensors final.
Inputs that are not outputs are never written back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .work import LuwuWork


def _needs_staging(t: torch.Tensor) -> bool:
    # dense only: a host buffer is a dense copy; sparse tensors reach the collective, which says what it takes
    return t.device.type != "cpu" and t.layout == torch.strided


def _walk(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """obj with every tensor t replaced by fn(t) (lists and tuples, nested)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(x, fn) for x in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t

    _walk(obj, keep)
    return out


class _Stage:
    def __init__(self, needs: Callable[[torch.Tensor], bool]):
        self.needs = needs
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # (device, host, CUDA stream or None)

    def to_host(self, t: torch.Tensor, is_output: bool) -> torch.Tensor:
        if not self.needs(t):
            return t
        cuda = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
        stream = torch.cuda.current_stream(t.device) if cuda else None
        host.copy_(t, non_blocking=cuda)
        if stream is not None:
            stream.synchronize()  # the engine reads the buffer from another thread
        if is_output:
            self.pairs.append((t, host, stream))
        return host

    def copy_back(self) -> None:
        streams: set[Any] = set()
        for dev, host, stream in self.pairs:
            if stream is not None:
                with torch.cuda.stream(stream):
                    dev.copy_(host, non_blocking=True)
                streams.add(stream)
            else:
                dev.copy_(host)
        for s in streams:
            s.synchronize()


def staged(outputs: tuple[int, ...], needs: Callable[[torch.Tensor], bool] = _needs_staging) -> Callable[[Any], Any]:
    """Decorate a process-group method: positional arguments at `outputs` are written back.

    Args:
        outputs: indices of the positional arguments the collective writes.
        needs: which tensors go through host buffers (non-CPU ones).

    Returns:
        The decorator; methods called without such tensors run unchanged.
    """
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not any(needs(t) for t in _tensors(args)):
                return fn(self, *args, **kwargs)
            stage = _Stage(needs)
            host_args = [_walk(a, functools.partial(stage.to_host, is_output=i in outputs))
                         for i, a in enumerate(args)]
            inner = fn(self, *host_args, **kwargs)
            device_outputs = [t for i in outputs if i < len(args) for t in _tensors(args[i])]
            outer = LuwuWork(f"{getattr(inner, 'name', fn.__name__)} (device tensors via host buffers)",
                             device_outputs)

            def done(fut: Any) -> None:
                try:
                    fut.wait()
                    stage.copy_back()
                except Exception as e:  # noqa: BLE001 - the Work carries it to wait()
                    outer._fail(e)
                    return
                outer.source = getattr(inner, "source", -1)
                outer._complete()

            inner._done_future.add_done_callback(done)
            return outer

        return call

    return wrap
