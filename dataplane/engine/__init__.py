"""The SmartNIC endpoint engine: push, pull and allreduce on whole-layer buffers, fixed point,
packets, credits, go-back-N, heartbeats (docs/protocol.md 7). Embedded in-process (`Engine`) or
as a daemon beside a worker (`EngineClient.spawn`).

The names below load on first use (PEP 562): a worker whose engine runs in the engine daemon
imports only the client side (`client`, `handles`, `shm`), not the engine and its packet code
(~30 ms of CPU on `init_process_group`'s path, docs/backend.md "Start-up")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .handles import EngineError, Handle

if TYPE_CHECKING:
    from .engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig", "EngineError", "Handle"]


def __getattr__(name: str):
    if name in ("Engine", "EngineConfig"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
