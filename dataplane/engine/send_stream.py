"""Send side of a stream: sequence numbers, window and credit, retransmission on timeout.

Packets live in a ring of `window` rows: the row of `seq` is `seq mod ring`, written just before
its first transmission by the operation that owns it, and kept for retransmission until it is
acknowledged (the window guarantees `seq - ring` was acknowledged before `seq` is written).
Each operation owns a `Segment`: a contiguous range of sequence numbers reserved when it is
submitted, so every worker numbers the same chunk the same way (docs/protocol.md 1).
A stream whose fills can be run again (`refill`: collectives, and a worker's gradient pushes,
whose source stays unchanged until the push completes) on a shared-memory port has no ring: the fill writes each packet straight into the switch port's up ring, and a resend runs the
fill again (docs/shared_memory.md "Zero-copy send").

The retransmission timeout adapts like TCP's (RFC 6298): SRTT/RTTVAR give RTO = SRTT + max(G,
4 RTTVAR) within [minimum, maximum], doubled per timeout (backoff) until the next RTT sample.
Samples obey Karn's rule in its full form: never from a packet that was retransmitted (the
`retx` array), and never from one acknowledged only because a hole before it closed -- its
acknowledgement waited for the repair, so its "round trip" is the recovery time (sampling those
drove the RTO to its maximum under loss). A cumulative acknowledgement (`on_ack`) therefore
samples only when no retransmitted row lies in what it covers; a stream told of every delivery
(`on_delivered`: a collective's RESULTs, SACK-like) samples only packets delivered in order.
The timer runs from the last progress, or from the first send after the stream was idle (RFC
6298 5.1), so a new operation on an idle stream does not inherit an old clock. The minimum is
above this host's scheduling gaps: on a loaded machine a peer that is merely descheduled must
not look like a loss (docs/protocol.md 7.1; docs/architecture.md "Engine timing").

Loss recovery marks rows `lost`; the next pump walks back over them and resends exactly those
(less what `received` says already got through). With per-packet delivery news every hole is
marked as soon as a packet sent after it is delivered (RACK's rule, by transmission order: the
path is FIFO, so that is a loss), and a hole already resent is marked again only after a
smoothed RTT without news. A probe timeout (RFC 8985's 2 SRTT, at least the RTO's minimum,
doubled per probe without news) resends what is still missing that long after its last send:
resent holes (a window full of packets waiting on a hole sends nothing whose delivery could prove
the resend lost), and once the operation has seen a loss any packet (its tail: nothing after it
will reveal it). Neither can happen on a loss-free path. A retransmission timeout (or a
heartbeat's GAP, `fast_retransmit`)
marks all that is outstanding and goes back to `ack` paced: a burst from `ack`, then one more
burst each time a partial acknowledgement arrives (NewReno-style), so a peer that is merely
slow costs a burst per timeout, not the whole window.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..integrity import seal_rows
from ..net.transport import RowFill, Transport
from ..protocol import Flag

MASK32 = 0xFFFFFFFF

Fill = Callable[[int, int, np.ndarray, np.ndarray], None]  # (i0, i1, rows, lengths) for seqs start+i0..start+i1
Received = Callable[[int, int], np.ndarray]  # (first seq, count) -> bool mask of seqs known delivered


def sdiff(a: int, b: int) -> int:
    """a - b as a signed 32-bit distance."""
    return ((a - b + 0x80000000) & MASK32) - 0x80000000


_ANY, _ALL = np.logical_or.reduce, np.logical_and.reduce  # without ndarray.any's Python wrapper (per batch)


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
    """RFC 6298 RTT smoothing (SRTT, RTTVAR; alpha 1/8, beta 1/4) and exponential backoff, kept
    until the next valid sample (Karn). Callers apply Karn's rule: no samples from retransmitted
    packets, nor from packets whose acknowledgement waited for a hole to close."""

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
        self.backoff = 1.0  # a fresh sample: the path answers again (Karn's algorithm)
        p = self.policy
        self.base = min(max(self.srtt + max(p.granularity, 4 * self.rttvar), p.minimum), p.maximum)

    def back_off(self) -> None:
        """A timeout: double the RTO (RFC 6298 5.5) until the next valid sample."""
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
    """The send side of one stream (module docstring).

    Args:
        sock: the endpoint's `Transport` (a `BatchSocket` or a `ShmEndpoint`: dataplane/net/transport.py).
        window: packets in flight at most.
        rto: the stream's retransmission timeout.
        row_bytes: the largest packet a fill writes.
        credit: the receiver's initial credit (default: the window).
        received: which packets already got through; resends skip them.
        refill: the fills may be run again for a packet until it is acknowledged or `received`
            says it got through (their sources stay unchanged until then; a stream whose
            source is overwritten in place as results arrive must pass `received`). On a shared-memory
            port the stream then writes each packet straight into the up ring and keeps no
            copy: a retransmission runs the fill again (docs/shared_memory.md "Zero-copy send").
    """

    def __init__(self, sock: Transport, window: int, rto: RtoEstimator, row_bytes: int, now: float = 0.0,
                 credit: int | None = None, received: Received | None = None, refill: bool = False):
        self.sock = sock
        self.window = window
        self.rto = rto
        rows = _pow2_at_least(window)
        # direct: fill into the shm up ring (needs resends to be refillable; an in-place collective
        # also passes `received`, so that no chunk whose result overwrote its source is read again)
        self.direct = refill and isinstance(sock, RowFill) and row_bytes <= sock.tx_row_bytes
        self.ring = None if self.direct else np.zeros((rows, row_bytes), dtype=np.uint8)
        self.ring_len = None if self.direct else np.zeros(rows, dtype=np.int64)
        self.sent_at = np.zeros(rows, dtype=np.float64)  # latest transmission of each row (RTT samples, hole waits)
        self.retx = np.zeros(rows, dtype=bool)  # the row's packet was ever resent (Karn's rule)
        self.lost = np.zeros(rows, dtype=bool)  # deemed lost: the next pump over it resends it
        self.xmit_no = np.zeros(rows, dtype=np.int64)  # order of the row's latest transmission (RACK)
        self._xmit = 0  # transmissions so far
        self.rack_xmit = -1  # the latest transmission known delivered
        self.sack_high = 0  # one past the highest seq known delivered (on_delivered streams)
        self.probe_at = float("inf")  # when a resent hole still missing is resent again regardless
        self.loss_seen = False  # a hole was found since the stream was last idle: probe its tail too
        self.probe_backoff = 1.0  # doubles per probe that finds no news since the last (a slow peer)
        self._mask = rows - 1
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
        # fast_retransmits: times delivery news (holes) or a GAP started a resend; holes: packets it
        # marked; probes: resent holes resent again after a probe timeout with no news
        # retransmitted_bytes: what the resends took (aggregation packets differ in length: protocol.md 3.3)
        self.stats = {"packets": 0, "retransmitted": 0, "retransmitted_bytes": 0, "timeouts": 0,
                      "fast_retransmits": 0, "holes": 0, "probes": 0, "rtt_samples": 0, "rtt_seconds": 0.0}

    # -- reservation ---------------------------------------------------------------------------
    def reserve(self, count: int, on_acked: Callable[[], None] | None = None) -> Segment:
        seg = Segment(self.next_seq, count, on_acked)
        self.next_seq = (self.next_seq + count) & MASK32
        self._segs.append(seg)
        return seg

    def outstanding(self) -> int:
        return ((self.high - self.ack + 0x80000000) & MASK32) - 0x80000000  # sdiff, inline: called per loop turn

    def idle(self) -> bool:
        return self.ack == self.next_seq

    def deadline(self) -> float:
        """When `check_timeout` would fire (inf with nothing in flight): the engine sleeps until then."""
        if self.high == self.ack or self.outstanding() <= 0:
            return float("inf")
        return min(self.last_progress + self.rto.rto, self.probe_at)

    # -- transmission --------------------------------------------------------------------------
    def _limit(self) -> int:
        """One past the last sequence number we may send now."""
        lim = self.next_seq
        # each bound in turn replaces lim when it lies before it (sdiff(cand, lim) < 0, inline: per loop turn)
        cand = (self.ack + self.window) & MASK32
        if (cand - lim) & MASK32 >= 0x80000000:
            lim = cand
        cand = (self.credit + 1) & MASK32
        if (cand - lim) & MASK32 >= 0x80000000:
            lim = cand
        if self.recover_to is not None and (self.burst_end - lim) & MASK32 >= 0x80000000:
            lim = self.burst_end
        return lim

    def pump(self, now: float) -> int:
        if self.send_next == self.next_seq:
            return 0  # everything reserved has gone (most loop turns of most streams): no limit to work out
        limit = self._limit()
        if limit == self.send_next or sdiff(limit, self.send_next) <= 0:
            return 0  # nothing may go now (most loop turns): the loop below would send nothing
        if self.outstanding() <= 0:
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
            if self.direct:
                n, out = self._send_direct(seg, rel, fresh_from, stop, now)
                sent += out
                self.send_next = (self.send_next + n) & MASK32
                if sdiff(self.send_next, self.high) > 0:
                    self.high = self.send_next
                if rel + n < stop:
                    break  # the up ring is full: the rest goes on a later turn
                if stop >= seg.count:
                    i += 1
                continue
            if fresh_from < stop:
                self._fill(seg, fresh_from, stop)
            idx = (seg.start + np.arange(rel, stop, dtype=np.int64)) & self._mask
            resend = max(0, min(fresh_from, stop) - rel)
            self.retx[idx[resend:]] = False
            self.lost[idx[resend:]] = False
            if resend > 0:
                head = idx[:resend]
                keep = self.lost[head]  # resend only what was deemed lost ...
                self.lost[head] = False
                if self.received is not None:  # ... and has not got through meanwhile
                    keep &= ~self.received((seg.start + rel) & MASK32, resend)
                head = head[keep]
                self.ring[head, 1] |= np.uint8(Flag.RETX)
                seal_rows(self.ring, head)  # the flags byte changed: the header check again
                self.retx[head] = True
                idx = np.concatenate((head, idx[resend:]))
                self.stats["retransmitted"] += len(head)
                self.stats["retransmitted_bytes"] += int(self.ring_len[head].sum())
                if len(head):
                    self._arm_probe(now)
            if len(idx):
                self._sent(idx, now)
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

    def _sent(self, idx: np.ndarray, now: float) -> None:
        """Rows `idx` went out now, in this order."""
        self.sent_at[idx] = now
        self.xmit_no[idx] = np.arange(self._xmit, self._xmit + len(idx))
        self._xmit += len(idx)
        if self.loss_seen:
            self._arm_probe(now)

    def _fill(self, seg: Segment, i0: int, i1: int) -> None:
        """Write rows for seg's packets [i0, i1) into the ring (in two pieces if it wraps)."""
        pos = (seg.start + i0) & self._mask
        first = min(i1 - i0, len(self.ring) - pos)
        seg.fill(i0, i0 + first, self.ring[pos:pos + first], self.ring_len[pos:pos + first])
        if first < i1 - i0:
            rest = i1 - i0 - first
            seg.fill(i0 + first, i1, self.ring[:rest], self.ring_len[:rest])

    def _send_direct(self, seg: Segment, rel: int, fresh_from: int, stop: int, now: float) -> tuple[int, int]:
        """Write seg's packets [rel, stop) straight into the shm up ring: resends (before
        `fresh_from`, less those `received` says got through) are filled again from the source
        and flagged RETX. Returns (how many of the range were dealt with, packets published);
        the first is short of `stop - rel` only when the ring was full."""
        fill = seg.fill
        resend = max(0, min(fresh_from, stop) - rel)
        if not resend:  # first transmissions only (nearly every call): one run, none flagged RETX
            def write_fresh(j0: int, j1: int, rows: np.ndarray, lens: np.ndarray) -> None:
                fill(rel + j0, rel + j1, rows, lens)

            published = self.sock.send_filled(stop - rel, write_fresh)
            out = (seg.start + np.arange(rel, rel + published, dtype=np.int64)) & self._mask
            self.lost[out] = False
            self.retx[out] = False
            self._sent(out, now)
            return published, published
        chunks = np.arange(rel, stop, dtype=np.int64)
        if resend:
            head = (seg.start + chunks[:resend]) & self._mask
            keep = self.lost[head]
            if self.received is not None:
                keep &= ~self.received((seg.start + rel) & MASK32, resend)
            if not keep.all():
                chunks = np.concatenate((chunks[:resend][keep], chunks[resend:]))
            nres = int(keep.sum())
        else:
            nres = 0
        total = len(chunks)
        cuts = np.flatnonzero(np.diff(chunks) != 1) + 1 if nres and total > 1 else ()
        runs = [0, *[int(c) for c in cuts], total]
        resent_lens = np.zeros(nres, dtype=np.int64)  # the resends' lengths, as `write` fills them

        def write(j0: int, j1: int, rows: np.ndarray, lens: np.ndarray) -> None:
            # one fill per run of consecutive chunks (one run unless some resends were skipped)
            for a, b in itertools.pairwise(runs):
                lo, hi = max(a, j0), min(b, j1)
                if lo < hi:
                    c0 = int(chunks[lo])
                    fill(c0, c0 + hi - lo, rows[lo - j0:hi - j0], lens[lo - j0:hi - j0])
            if j0 < nres:
                rows[:min(nres, j1) - j0, 1] |= np.uint8(Flag.RETX)
                seal_rows(rows, np.arange(min(nres, j1) - j0))
                resent_lens[j0:min(nres, j1)] = lens[:min(nres, j1) - j0]

        published = self.sock.send_filled(total, write) if total else 0
        done = stop - rel if published == total else int(chunks[published]) - rel
        idx = (seg.start + np.arange(rel, rel + done, dtype=np.int64)) & self._mask
        self.lost[idx] = False  # dealt with: resent, or got through meanwhile
        out = (seg.start + chunks[:published]) & self._mask
        self.retx[out] = np.arange(published) < nres
        self._sent(out, now)
        self.stats["retransmitted"] += min(nres, published)
        self.stats["retransmitted_bytes"] += int(resent_lens[:min(nres, published)].sum())
        if nres and published:
            self._arm_probe(now)
        return done, published

    # -- acknowledgements ----------------------------------------------------------------------
    def on_ack(self, ack: int, credit: int, now: float, sample: bool = True) -> int:
        """Apply a receiver's {ack, credit}; returns how many packets it newly acknowledged.

        Args:
            ack: one past the receiver's contiguous prefix.
            credit: the highest sequence number the receiver can take.
            now: the engine clock.
            sample: take an RTT sample from this acknowledgement (off for streams that sample
                per delivery in `on_delivered`).
        """
        moved = sdiff(ack, self.ack)
        if sdiff(credit, self.credit) > 0:
            self.credit = credit
        if moved <= 0 or sdiff(self.high, ack) < 0:
            return 0  # old news, or an acknowledgement of something never sent
        old = self.ack
        self.ack = ack & MASK32
        self.last_progress = now
        if self.ack == self.next_seq:
            self.loss_seen = False  # idle: the next operation starts with no suspicion
        # Karn: no sample when a retransmitted row is covered -- either its own ack is ambiguous,
        # or the newest row's ack waited for that repair (a gap closing is not a round trip)
        if sample:
            covered = (old + np.arange(moved, dtype=np.int64)) & self._mask  # intact until pump runs again
            if not self.retx[covered].any():
                self._sample(now - float(self.sent_at[covered[-1]]))
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

    def _sample(self, rtt: float) -> None:
        self.rto.sample(rtt)
        self.stats["rtt_samples"] += 1
        self.stats["rtt_seconds"] += rtt

    def on_delivered(self, seqs: np.ndarray, now: float) -> int:
        """Per-packet delivery news (SACK-like; a collective's first RESULT for each seq), given
        after `on_ack` for the same batch. Samples the RTT of the newest packet delivered in order
        (none past it delivered before, never retransmitted), then marks every hole that a later
        transmission's delivery proves lost (RACK) for the next `pump` to resend at once.

        Args:
            seqs: the sequence numbers delivered for the first time.
            now: the engine clock.

        Returns:
            How many holes were newly marked lost.
        """
        if len(seqs) == 0:
            return 0
        seqs = np.asarray(seqs, dtype=np.int64)
        rows = seqs & self._mask
        dist = (seqs - self.sack_high) & MASK32
        ahead = dist < 0x80000000  # past all delivered before
        fresh = ahead & ~self.retx[rows]
        if _ALL(fresh):  # the common batch: all past sack_high, none resent: one newest for both
            return self.delivered_in_order(int(seqs[int(dist.argmax())]), int(self.xmit_no[rows].max()), now)
        else:
            if _ANY(fresh):
                newest = int(rows[fresh][np.argmax(dist[fresh])])
                self._sample(now - float(self.sent_at[newest]))
            if _ANY(ahead):
                self.sack_high = int((seqs[ahead][np.argmax(dist[ahead])] + 1) & MASK32)
        self.rack_xmit = max(self.rack_xmit, int(self.xmit_no[rows].max()))
        self.probe_backoff = 1.0  # news: the path answers
        return self._mark_holes(now)

    def delivered_in_order(self, newest: int, rack: int, now: float) -> int:
        """`on_delivered`'s common batch, summarised by its caller: every seq delivered is past all
        delivered before and was never resent; `newest` is the newest of them, `rack` the latest
        transmission (`xmit_no`) among them. The engine's compiled RESULT pass finds both while
        it reads the batch (dataplane/engine/collective.py)."""
        self._sample(now - float(self.sent_at[newest & self._mask]))
        self.sack_high = (newest + 1) & MASK32
        self.rack_xmit = max(self.rack_xmit, rack)
        self.probe_backoff = 1.0  # news: the path answers
        return self._mark_holes(now)

    def _mark_holes(self, now: float) -> int:
        """Rows in [ack, sack_high) not yet delivered and transmitted before the latest delivered
        transmission are lost (a FIFO path delivers in order); one already resent is marked again
        only after a smoothed RTT, so a hole that waits on another worker costs one resend per RTT."""
        span = sdiff(self.sack_high, self.ack)
        if span <= 0 or self.received is None:
            return 0
        rows = (self.ack + np.arange(span, dtype=np.int64)) & self._mask
        wait = self.rto.srtt if self.rto.srtt is not None else self.rto.policy.minimum
        hole = (~self.received(self.ack, span) & ~self.lost[rows] & (self.xmit_no[rows] < self.rack_xmit)
                & (~self.retx[rows] | (now - self.sent_at[rows] >= wait)))
        n = int(hole.sum())
        if n:
            self.lost[rows[hole]] = True
            self.loss_seen = True
            first = (self.ack + int(np.argmax(hole))) & MASK32
            if sdiff(self.send_next, first) > 0:
                self.send_next = first
            self.last_progress = now  # the resends get a full RTO before a timeout
            self.stats["fast_retransmits"] += 1
            self.stats["holes"] += n
        return n

    def _pto(self) -> float:
        """Probe timeout (RFC 8985's 2 SRTT, at least the RTO's minimum): how long a resent hole may
        wait for news before it is resent again without a timeout. A window that is full of
        packets waiting on the hole sends nothing new whose delivery could prove the resend lost,
        so without this a lost resend would wait for the (backed-off) RTO."""
        srtt = self.rto.srtt if self.rto.srtt is not None else self.rto.policy.initial
        return min(max(2 * srtt, self.rto.policy.minimum) * self.probe_backoff, self.rto.policy.maximum)

    def _arm_probe(self, now: float) -> None:
        if self.received is not None:  # only streams that know which packets got through
            self.probe_at = min(self.probe_at, now + self._pto())

    def _probe(self, now: float) -> int:
        """Mark lost again every resent packet still missing a probe timeout after its resend."""
        self.probe_at = float("inf")
        span = self.outstanding()
        if span <= 0 or self.received is None:
            return 0
        rows = (self.ack + np.arange(span, dtype=np.int64)) & self._mask
        pto = self._pto()
        # resent holes; and once this operation has seen a loss, any packet (a tail loss: nothing
        # sent after it will be delivered to prove it lost -- RFC 8985's tail loss probe)
        waiting = ~self.received(self.ack, span) & ~self.lost[rows]
        if not self.loss_seen:
            waiting &= self.retx[rows]
        due = waiting & (now - self.sent_at[rows] >= pto)
        if waiting.any():
            self.probe_at = float(self.sent_at[rows[waiting & ~due]].min(initial=now)) + pto
        n = int(due.sum())
        if n:
            self.lost[rows[due]] = True
            first = (self.ack + int(np.argmax(due))) & MASK32
            if sdiff(self.send_next, first) > 0:
                self.send_next = first
            self.stats["probes"] += n
            self.last_progress = now  # the RTO is the backstop behind the probe (RFC 8985 7.3)
            self.probe_backoff = min(self.probe_backoff * 2, self.rto.policy.max_backoff)
        return n

    def _mark_outstanding(self) -> None:
        """Everything in [ack, high) is presumed lost (a timeout, a GAP)."""
        self.lost[(self.ack + np.arange(max(0, self.outstanding()), dtype=np.int64)) & self._mask] = True

    def fast_retransmit(self, now: float) -> bool:
        """The receiver reports a hole before packets it already has: a loss, not a slow peer (in a
        collective, a later chunk completing means every worker sent the earlier one). Go back to
        `ack` at once, paced like a timeout but without backing off, at most once per RTT."""
        if self.outstanding() <= 0 or now - self._last_fast < (self.rto.srtt or self.rto.policy.minimum):
            return False
        self._last_fast = now
        self._mark_outstanding()
        self.recover_to = self.high
        self.send_next = self.ack
        self.burst_end = (self.ack + self.burst) & MASK32
        self.last_progress = now
        self.stats["fast_retransmits"] += 1
        return True

    def check_timeout(self, now: float) -> bool:
        """Go back to the acknowledgement when it has stalled for a retransmission timeout; before
        that, resend holes whose resend has waited a probe timeout (`_pto`)."""
        if now >= self.probe_at and self._probe(now):
            return False
        if self.outstanding() <= 0 or now - self.last_progress < self.rto.rto:
            return False
        self._mark_outstanding()
        self.recover_to = self.high
        self.send_next = self.ack
        self.burst_end = (self.ack + self.burst) & MASK32
        self.last_progress = now
        self.rto.back_off()
        self.stats["timeouts"] += 1
        return True
