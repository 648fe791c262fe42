"""An engine's settings (`EngineConfig`): batching, retransmission and heartbeat policies, the
loop's timer ticks, how long a silent switch or node may starve pending operations, and the wire
format of float sums (`grad_format`, default from `LUWU_GRAD_FORMAT`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..process.usage import UserError
from .heartbeats import HeartbeatPolicy
from .liveness import DEFAULT_PEER_TIMEOUT
from .send_stream import RtoPolicy

GRAD_FORMATS = ("fixed32", "fixed16")
GRAD_FORMAT_ENV = "LUWU_GRAD_FORMAT"
DEFAULT_GRAD_FORMAT = "fixed32"


def check_grad_format(fmt: str) -> str:
    """`fmt` if it is a known gradient format, else UserError naming the choices."""
    if fmt not in GRAD_FORMATS:
        raise UserError(f"gradient format {fmt!r}: choose one of {', '.join(GRAD_FORMATS)}")
    return fmt


def grad_format_from_env() -> str:
    """The gradient format `LUWU_GRAD_FORMAT` asks for (default fixed32; docs/backend.md)."""
    raw = os.environ.get(GRAD_FORMAT_ENV, "").strip().lower() or DEFAULT_GRAD_FORMAT
    if raw not in GRAD_FORMATS:
        raise UserError(f"{GRAD_FORMAT_ENV}={raw!r}: choose one of {', '.join(GRAD_FORMATS)}")
    return raw


@dataclass
class EngineConfig:
    batch: int = 64  # datagrams per recvmmsg / sendmmsg
    rx_batches_per_turn: int = 16  # drained before the loop lets sessions send again
    rto: RtoPolicy = field(default_factory=RtoPolicy)
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    pull_retry: float = 0.05  # s before a PULL with no answer is sent again (doubles, up to 1 s)
    timer_tick: float = 0.001  # s between timer checks while anything is outstanding
    idle_tick: float = 0.05  # s the loop sleeps when nothing is outstanding
    # s a deadline made on a caller's thread (Engine._run_here: a retransmission timer, a pull
    # retry, both >= 40 ms out) may run late rather than wake the sleeping loop early for it
    caller_slack: float = 0.01
    socket_buffer: int = 8 << 20  # bytes asked for SO_RCVBUF/SO_SNDBUF
    peer_timeout: float = DEFAULT_PEER_TIMEOUT  # s a dead switch/node may starve pending ops (liveness.py; 0: off)
    # float sums on the wire: "fixed32" (one exponent per packet) or "fixed16" (int16 values two per
    # lane, an exponent per FIXED16_BLOCK elements: docs/protocol.md 5.2); every worker of a job must agree
    grad_format: str = field(default_factory=grad_format_from_env)
