"""An engine's settings (`EngineConfig`): batching, retransmission and heartbeat policies, the
loop's timer ticks and how long a silent switch or node may starve pending operations."""

from __future__ import annotations

from dataclasses import dataclass, field

from .heartbeats import HeartbeatPolicy
from .liveness import DEFAULT_PEER_TIMEOUT
from .send_stream import RtoPolicy


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
