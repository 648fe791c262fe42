"""When a receiver tells its sender where it is: HEARTBEAT {ack, credit} (docs/protocol.md 7.2).

A heartbeat goes out when the acknowledgement has moved by a quarter window, soon after a
duplicate arrives (the sender is probably retransmitting what we already have), soon after a
whole message arrives when the receiver knows one (the node: a layer's gradient, whose push its
sender waits on), every interval while the acknowledgement keeps changing, and as a slow
keepalive otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from .packets import heartbeat_bytes
from .transport import packet_sender
from .window import RecvWindow


@dataclass
class HeartbeatPolicy:
    # 6 ms: a whole message (the node's gradients) is acknowledged at once, so the interval no longer
    # decides when a waiting sender hears; 2 ms sent a third more heartbeats per `luwu demo` step
    # (28.7 -> 21, each a switch turn and a wake-up on both sides) for no speed
    interval: float = 0.006
    keepalive: float = 0.1
    min_gap: float = 0.0005


class HeartbeatSender:
    def __init__(self, sock, session: int, worker: int, window: RecvWindow, policy: HeartbeatPolicy,
                 capacity: int | None = None):
        self.sock = sock
        self._send = packet_sender(sock)
        self.session = session
        self.worker = worker
        self.window = window
        self.policy = policy
        self.capacity = capacity or window.size
        self.seq = 0
        self.last_ack: int | None = None
        self.last_time = -1e9
        self.urgent = False
        self._gap_told = False
        self.sent = 0

    def nudge(self) -> None:
        """Ask for a heartbeat soon (a duplicate or a retransmission arrived)."""
        self.urgent = True

    def maybe_send(self, now: float) -> bool:
        ack = self.window.ack
        since = now - self.last_time
        moved = self.last_ack is None or ((ack - self.last_ack) & 0xFFFFFFFF) >= self.window.size // 4
        # has_gap scans the window: asked last, only when its answer could matter (a loop turn each)
        if not self._gap_told and self.last_ack == ack and self.window.has_gap():
            self.urgent = True  # tell the sender of the hole once per acknowledgement
        due = (self.urgent and since >= self.policy.min_gap) or moved
        due = due or (since >= self.policy.interval and ack != self.last_ack) or since >= self.policy.keepalive
        if not due:
            return False
        self.send(now)
        return True

    def due_at(self) -> float:
        """When `maybe_send` would next send with nothing new arriving (the engine sleeps until then)."""
        if self.last_ack is None:
            return -1.0
        if self.urgent or (not self._gap_told and self.last_ack == self.window.ack and self.window.has_gap()):
            return self.last_time + self.policy.min_gap
        if self.window.ack != self.last_ack:
            return self.last_time + self.policy.interval
        return self.last_time + self.policy.keepalive

    def send(self, now: float) -> None:
        gap = self.window.has_gap()
        self._send(heartbeat_bytes(self.session, self.worker, self.seq, self.window.ack,
                                   self.window.credit(self.capacity), gap=gap))
        self.seq += 1
        self.sent += 1
        self._gap_told = gap
        self.last_ack = self.window.ack
        self.last_time = now
        self.urgent = False
