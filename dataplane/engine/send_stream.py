"""Send side of a stream: sequence numbers, window and credit, go-back-N, retransmission timer.

A stream's packets are grouped in `Segment`s, one per operation, each owning a contiguous range
of sequence numbers reserved when the operation is submitted (so every worker numbers the same
chunk the same way, docs/protocol.md 1). A segment's packets may be built later and lazily, a
block at a time, so quantising a large buffer overlaps sending its first packets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..net.mmsg import BatchSocket
from .packets import PacketBatch

MASK32 = 0xFFFFFFFF


def sdiff(a: int, b: int) -> int:
    """a - b as a signed 32-bit distance."""
    d = (a - b) & MASK32
    return d - 0x100000000 if d >= 0x80000000 else d


@dataclass
class RtoPolicy:
    initial: float = 0.05
    minimum: float = 0.005
    maximum: float = 1.0


class RtoEstimator:
    """Jacobson/Karels RTT smoothing; Karn's rule (no samples from retransmitted packets)."""

    def __init__(self, policy: RtoPolicy):
        self.policy = policy
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.base = policy.initial
        self.backoff = 1.0

    def sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.base = min(max(self.srtt + 4 * self.rttvar, self.policy.minimum), self.policy.maximum)

    @property
    def rto(self) -> float:
        return min(self.base * self.backoff, self.policy.maximum)


class Segment:
    """One operation's packets: seqs [start, start + count)."""

    __slots__ = ("start", "count", "batch", "build", "built", "on_acked")

    def __init__(self, start: int, count: int, on_acked: Callable[[], None] | None):
        self.start = start
        self.count = count
        self.batch: PacketBatch | None = None
        self.build: Callable[[int, int], None] | None = None  # fills batch rows [i0, i1)
        self.built = 0
        self.on_acked = on_acked

    def ready(self, batch: PacketBatch, build: Callable[[int, int], None] | None = None) -> None:
        """Attach the packet rows; with `build`, rows are filled lazily in blocks before sending."""
        self.batch = batch
        self.build = build
        self.built = 0 if build else self.count


class SendStream:
    def __init__(self, sock: BatchSocket, window: int, rto: RtoEstimator, build_block: int = 256,
                 now: float = 0.0, credit: int | None = None):
        self.sock = sock
        self.window = window
        self.rto = rto
        self.build_block = build_block
        self.next_seq = 0  # next sequence number to reserve
        self.send_next = 0  # next to transmit (moves back on timeout)
        self.high = 0  # one past the highest ever transmitted
        self.ack = 0
        self.credit = (window - 1) if credit is None else credit
        self._segs: list[Segment] = []
        self._head = 0  # index of the oldest unacknowledged segment
        self.last_progress = now
        self._probe: tuple[int, float] | None = None
        self.stats = {"packets": 0, "retransmitted": 0, "timeouts": 0}

    # -- reservation ---------------------------------------------------------------------------
    def reserve(self, count: int, on_acked: Callable[[], None] | None = None) -> Segment:
        seg = Segment(self.next_seq, count, on_acked)
        self.next_seq = (self.next_seq + count) & MASK32
        self._segs.append(seg)
        return seg

    def outstanding(self) -> int:
        return sdiff(self.send_next, self.ack)

    def idle(self) -> bool:
        return self.ack == self.next_seq

    # -- transmission --------------------------------------------------------------------------
    def _limit(self) -> int:
        """One past the last sequence number we may send now."""
        lim = self.next_seq
        for cand in ((self.ack + self.window) & MASK32, (self.credit + 1) & MASK32):
            if sdiff(cand, lim) < 0:
                lim = cand
        return lim

    def pump(self, now: float) -> int:
        limit = self._limit()
        sent = 0
        i = self._head
        while sdiff(limit, self.send_next) > 0 and i < len(self._segs):
            seg = self._segs[i]
            rel = sdiff(self.send_next, seg.start)
            if rel >= seg.count:
                i += 1
                continue
            if seg.batch is None:
                break
            stop = min(seg.count, sdiff(limit, seg.start))
            if seg.build is not None and seg.built < stop:
                upto = min(seg.count, max(stop, seg.built + self.build_block))
                seg.build(seg.built, upto)
                seg.built = upto
            n = stop - rel
            b = seg.batch
            self.sock.send_rows(b.rows, np.arange(rel, stop), b.lengths[rel:stop])
            fresh = sdiff(self.send_next, self.high) >= 0
            self.send_next = (self.send_next + n) & MASK32
            sent += n
            if fresh:
                self.high = self.send_next
                if self._probe is None:
                    self._probe = ((self.send_next - 1) & MASK32, now)
            else:
                self.stats["retransmitted"] += n
            if rel + n >= seg.count:
                i += 1
        self.stats["packets"] += sent
        return sent

    # -- acknowledgements ----------------------------------------------------------------------
    def on_ack(self, ack: int, credit: int, now: float) -> int:
        """Apply a receiver's {ack, credit}; returns how many packets it newly acknowledged."""
        moved = sdiff(ack, self.ack)
        if sdiff(credit, self.credit) > 0:
            self.credit = credit
        if moved <= 0 or sdiff(self.next_seq, ack) < 0:
            return 0  # old news, or an acknowledgement of something never sent
        self.ack = ack & MASK32
        self.last_progress = now
        self.rto.backoff = 1.0
        if self._probe is not None and sdiff(ack, self._probe[0]) > 0:
            self.rto.sample(now - self._probe[1])
            self._probe = None
        if sdiff(self.send_next, ack) < 0:
            self.send_next = self.ack
        while self._head < len(self._segs):
            seg = self._segs[self._head]
            if sdiff(ack, seg.start + seg.count) < 0:
                break
            self._head += 1
            seg.batch = None  # release the packet memory
            if seg.on_acked:
                seg.on_acked()
        if self._head > 64 and self._head * 2 > len(self._segs):
            del self._segs[: self._head]
            self._head = 0
        return moved

    def check_timeout(self, now: float) -> bool:
        """Go back N when the acknowledgement has stalled for a retransmission timeout."""
        if self.outstanding() <= 0 or now - self.last_progress < self.rto.rto:
            return False
        self._mark_retx(self.ack, self.send_next)
        self.send_next = self.ack
        self.last_progress = now
        self.rto.backoff = min(self.rto.backoff * 2, 64.0)
        self._probe = None
        self.stats["timeouts"] += 1
        return True

    def _mark_retx(self, start: int, stop: int) -> None:
        for seg in self._segs[self._head:]:
            a = max(0, sdiff(start, seg.start))
            b = min(seg.count, sdiff(stop, seg.start))
            if b > a and seg.batch is not None:
                seg.batch.mark_retransmitted(a, b)
            if sdiff(stop, seg.start + seg.count) <= 0:
                break
