"""The SmartNIC endpoint engine: push, pull and allreduce on whole-layer buffers, fixed point,
packets, credits, go-back-N, heartbeats (docs/protocol.md 7). Embedded in-process (`Engine`) or
as a daemon beside a worker (`EngineClient.spawn`)."""

from .engine import Engine, EngineConfig
from .handles import EngineError, Handle

__all__ = ["Engine", "EngineConfig", "EngineError", "Handle"]
