"""Send side of a stream: sequence numbers, window and credit, retransmission on timeout.

Packets live in a ring of `window` rows: the row of `seq` is `seq mod ring`, written just before
its first transmission by the operation that owns it, and kept for retransmission until it is
acknowledged (the window guarantees `seq - ring` was acknowledged before `seq` is written).
Each operation owns a `Segment`: a contiguous range of sequence numbers reserved when it is
submitted, so every worker numbers the same chunk the same way (docs/protocol.md 1).

The retransmission timeout adapts like TCP's (RFC 6298): every acknowledgement that moves
samples the round trip of the newest packet it covers, from that row's send time, unless the
row was ever retransmitted (Karn's rule; the RETX flag in the row says so); SRTT/RTTVAR give
RTO = SRTT + max(G, 4 RTTVAR) within [minimum, maximum], doubled per timeout (backoff) until an
acknowledgement moves again. The timer runs from the last progress, or from the first send
after the stream was idle (RFC 6298 5.1), so a new operation on an idle stream does not inherit
an old clock. The minimum is above this host's scheduling gaps: on a loaded machine a peer that
is merely descheduled must not look like a loss (docs/protocol.md 7.1; docs/architecture.md "Engine timing").

Loss recovery goes back to the acknowledgement when it has stalled for a retransmission
timeout (go-back-N), but paced: it resends a burst from `ack`, then one more burst each time a
partial acknowledgement arrives, until it has covered what was outstanding (NewReno-style).
Senders that know which packets already got through (collectives see their RESULTs) skip them.
A peer that is merely slow therefore costs a burst per timeout, not the whole window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..net.mmsg import BatchSocket
from ..protocol import Flag

MASK32 = 0xFFFFFFFF

Fill = Callable[[int, int, np.ndarray, np.ndarray], None]  # (i0, i1, rows, lengths) for seqs start+i0..start+i1
Received = Callable[[int, int], np.ndarray]  # (first seq, count) -> bool mask of seqs known delivered


def sdiff(a: int, b: int) -> int:
    """a - b as a signed 32-bit distance."""
    d = (a - b) & MASK32
    return d - 0x100000000 if d >= 0x80000000 else d


@dataclass
class RtoPolicy:
    """Retransmission timeout bounds (s). `minimum` sits above the scheduling gaps of a loaded
    2-core host (tens of ms with a dozen runnable processes), `granularity` is RFC 6298's G (the
    engine's timer tick), `max_backoff` caps the doubling per consecutive timeout."""

    initial: float = 0.1
    minimum: float = 0.04
    maximum: float = 1.0
    granularity: float = 0.001
    max_backoff: float = 64.0
    burst_fraction: float = 1 / 16  # of the window, resent per recovery step


class RtoEstimator:
    """RFC 6298 RTT smoothing (SRTT, RTTVAR; alpha 1/8, beta 1/4) and exponential backoff. Callers
    apply Karn's rule: no samples from retransmitted packets."""

    def __init__(self, policy: RtoPolicy):
        self.policy = policy
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.base = policy.initial
        self.backoff = 1.0
        self.samples = 0

    def sample(self, rtt: float) -> None:
        if rtt < 0:
            return
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.samples += 1
        p = self.policy
        self.base = min(max(self.srtt + max(p.granularity, 4 * self.rttvar), p.minimum), p.maximum)

    def back_off(self) -> None:
        """A timeout: double the RTO (RFC 6298 5.5) until an acknowledgement moves again."""
        self.backoff = min(self.backoff * 2, self.policy.max_backoff)

    @property
    def rto(self) -> float:
        return min(self.base * self.backoff, self.policy.maximum)


class Segment:
    """One operation's packets: seqs [start, start + count)."""

    __slots__ = ("count", "fill", "on_acked", "start")

    def __init__(self, start: int, count: int, on_acked: Callable[[], None] | None):
        self.start = start
        self.count = count
        self.fill: Fill | None = None
        self.on_acked = on_acked

    def ready(self, fill: Fill) -> None:
        """The operation can now produce its packets (e.g. its exponents were agreed)."""
        self.fill = fill


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class SendStream:
    def __init__(self, sock: BatchSocket, window: int, rto: RtoEstimator, row_bytes: int, now: float = 0.0,
                 credit: int | None = None, received: Received | None = None):
        self.sock = sock
        self.window = window
        self.rto = rto
        self.ring = np.zeros((_pow2_at_least(window), row_bytes), dtype=np.uint8)
        self.ring_len = np.zeros(len(self.ring), dtype=np.int64)
        self.sent_at = np.zeros(len(self.ring), dtype=np.float64)  # first transmission of each row (RTT samples)
        self._mask = len(self.ring) - 1
        self.received = received
        self.burst = max(1, int(window * rto.policy.burst_fraction))
        self.next_seq = 0  # next sequence number to reserve
        self.send_next = 0  # next to transmit (moves back on timeout)
        self.high = 0  # one past the highest ever transmitted (rows before it are in the ring)
        self.ack = 0
        self.credit = (window - 1) if credit is None else credit
        self.recover_to: int | None = None  # in recovery: resend up to here
        self.burst_end = 0
        self._segs: list[Segment] = []
        self._head = 0  # index of the oldest unacknowledged segment
        self.last_progress = now  # the retransmission timer runs from here
        self._last_fast = -1e9
        # rtt_seconds: summed send-to-acknowledgement times of the rtt samples (rtt_seconds / rtt_samples: the
        # mean wait, which includes the slowest worker's lag where the ack waits for every worker)
        self.stats = {"packets": 0, "retransmitted": 0, "timeouts": 0, "fast_retransmits": 0, "rtt_samples": 0,
                      "rtt_seconds": 0.0}

    # -- reservation ---------------------------------------------------------------------------
    def reserve(self, count: int, on_acked: Callable[[], None] | None = None) -> Segment:
        seg = Segment(self.next_seq, count, on_acked)
        self.next_seq = (self.next_seq + count) & MASK32
        self._segs.append(seg)
        return seg

    def outstanding(self) -> int:
        return sdiff(self.high, self.ack)

    def idle(self) -> bool:
        return self.ack == self.next_seq

    def deadline(self) -> float:
        """When `check_timeout` would fire (inf with nothing in flight): the engine sleeps until then."""
        return self.last_progress + self.rto.rto if self.outstanding() > 0 else float("inf")

    # -- transmission --------------------------------------------------------------------------
    def _limit(self) -> int:
        """One past the last sequence number we may send now."""
        lim = self.next_seq
        cands = [(self.ack + self.window) & MASK32, (self.credit + 1) & MASK32]
        if self.recover_to is not None:
            cands.append(self.burst_end)
        for cand in cands:
            if sdiff(cand, lim) < 0:
                lim = cand
        return lim

    def pump(self, now: float) -> int:
        limit = self._limit()
        if sdiff(limit, self.send_next) > 0 and self.outstanding() <= 0:
            self.last_progress = now  # nothing was in flight: the timer starts with this send (RFC 6298 5.1)
        sent = 0
        i = self._head
        while sdiff(limit, self.send_next) > 0 and i < len(self._segs):
            seg = self._segs[i]
            rel = sdiff(self.send_next, seg.start)
            if rel >= seg.count:
                i += 1
                continue
            if seg.fill is None:
                break
            stop = min(seg.count, sdiff(limit, seg.start))
            fresh_from = max(rel, sdiff(self.high, seg.start))  # rows from here on were never written
            if fresh_from < stop:
                self._fill(seg, fresh_from, stop)
            idx = (seg.start + np.arange(rel, stop, dtype=np.int64)) & self._mask
            resend = min(fresh_from, stop) - rel
            if resend < len(idx):
                self.sent_at[idx[max(resend, 0):]] = now
            if resend > 0:
                self.ring[idx[:resend], 1] |= np.uint8(Flag.RETX)
                if self.received is not None:
                    keep = ~self.received((seg.start + rel) & MASK32, resend)
                    idx = np.concatenate((idx[:resend][keep], idx[resend:]))
                    resend = int(keep.sum())
                self.stats["retransmitted"] += resend
            if len(idx):
                self.sock.send_rows(self.ring, idx, self.ring_len[idx])
            n = stop - rel
            self.send_next = (self.send_next + n) & MASK32
            sent += len(idx)
            if sdiff(self.send_next, self.high) > 0:
                self.high = self.send_next
            if rel + n >= seg.count:
                i += 1
        self.stats["packets"] += sent
        return sent

    def _fill(self, seg: Segment, i0: int, i1: int) -> None:
        """Write rows for seg's packets [i0, i1) into the ring (in two pieces if it wraps)."""
        pos = (seg.start + i0) & self._mask
        first = min(i1 - i0, len(self.ring) - pos)
        seg.fill(i0, i0 + first, self.ring[pos:pos + first], self.ring_len[pos:pos + first])
        if first < i1 - i0:
            rest = i1 - i0 - first
            seg.fill(i0 + first, i1, self.ring[:rest], self.ring_len[:rest])

    # -- acknowledgements ----------------------------------------------------------------------
    def on_ack(self, ack: int, credit: int, now: float) -> int:
        """Apply a receiver's {ack, credit}; returns how many packets it newly acknowledged."""
        moved = sdiff(ack, self.ack)
        if sdiff(credit, self.credit) > 0:
            self.credit = credit
        if moved <= 0 or sdiff(self.high, ack) < 0:
            return 0  # old news, or an acknowledgement of something never sent
        self.ack = ack & MASK32
        self.last_progress = now
        self.rto.backoff = 1.0
        newest = (ack - 1) & self._mask  # its row is intact: nothing is refilled before pump runs again
        if not self.ring[newest, 1] & int(Flag.RETX):  # Karn: a retransmitted row's ack is ambiguous
            rtt = now - float(self.sent_at[newest])
            self.rto.sample(rtt)
            self.stats["rtt_samples"] += 1
            self.stats["rtt_seconds"] += rtt
        if self.recover_to is not None:
            if sdiff(ack, self.recover_to) >= 0:
                self.recover_to = None  # everything outstanding at the timeout got through
            else:
                self.burst_end = (ack + self.burst) & MASK32  # partial ack: resend the next burst
        if sdiff(self.send_next, ack) < 0:
            self.send_next = self.ack
        while self._head < len(self._segs):
            seg = self._segs[self._head]
            if sdiff(ack, seg.start + seg.count) < 0:
                break
            self._head += 1
            if seg.on_acked:
                seg.on_acked()
        if self._head > 64 and self._head * 2 > len(self._segs):
            del self._segs[: self._head]
            self._head = 0
        return moved

    def fast_retransmit(self, now: float) -> bool:
        """The receiver reports a hole before packets it already has: a loss, not a slow peer (in a
        collective, a later chunk completing means every worker sent the earlier one). Go back to
        `ack` at once, paced like a timeout but without backing off, at most once per RTT."""
        if self.outstanding() <= 0 or now - self._last_fast < (self.rto.srtt or self.rto.policy.minimum):
            return False
        self._last_fast = now
        self.recover_to = self.high
        self.send_next = self.ack
        self.burst_end = (self.ack + self.burst) & MASK32
        self.last_progress = now
        self.stats["fast_retransmits"] += 1
        return True

    def check_timeout(self, now: float) -> bool:
        """Go back to the acknowledgement when it has stalled for a retransmission timeout."""
        if self.outstanding() <= 0 or now - self.last_progress < self.rto.rto:
            return False
        self.recover_to = self.high
        self.send_next = self.ack
        self.burst_end = (self.ack + self.burst) & MASK32
        self.last_progress = now
        self.rto.back_off()
        self.stats["timeouts"] += 1
        return True
