"""Loss recovery and RTT sampling of a send stream (dataplane/engine/send_stream.py).

A real `SendStream` on a loopback UDP socket with a real `RecvWindow` as its receiver's
bookkeeping, driven with an explicit clock (the `now` arguments), so nothing here depends on how
fast the machine is. What is checked is behaviour that made recovery slow before: an
acknowledgement that only moved because a hole closed is no RTT sample (sampling it drove the RTO
to its maximum under loss), the backoff holds until a fresh sample, every hole a collective's
RESULTs reveal is resent at once (not only the first, not after a timeout), a hole already
resent is not resent again before a smoothed RTT, and a resend that nothing later can prove lost
is probed again after 2 SRTT instead of waiting for the RTO.
"""

from __future__ import annotations

import numpy as np
import pytest
from stream_wire import ROW, udp_wire
from stream_wire import fill_indexed as _fill
from stream_wire import on_wire as _on_wire

from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy, SendStream
from luwu.dataplane.engine.window import RecvWindow

POLICY = RtoPolicy(initial=0.1, minimum=0.01, maximum=1.0)


@pytest.fixture
def wire():
    with udp_wire() as pair:
        yield pair


def _deliver(s, w, seqs, now):
    """What a collective does with first RESULTs: the window, the ack, then the delivery news."""
    seqs = np.asarray(seqs, dtype=np.uint32)
    new = w.accept(seqs)
    if w.advance():
        s.on_ack(w.ack, w.credit(), now, sample=False)
    return s.on_delivered(seqs[new].astype(np.int64), now)


def test_an_ack_that_only_moved_because_a_hole_closed_is_no_rtt_sample(wire):
    tx, rx = wire
    s = SendStream(tx, window=32, rto=RtoEstimator(POLICY), row_bytes=ROW)
    seg = s.reserve(8)
    seg.ready(_fill)
    assert s.pump(now=1.0) == 8
    _on_wire(rx, 8)
    s.on_ack(2, 40, now=1.01)  # 0 and 1 back after 10 ms; 2 is lost, 3..7 wait behind it
    assert s.stats["rtt_samples"] == 1 and s.rto.srtt == pytest.approx(0.01)
    loss_free_rto = s.rto.rto
    assert s.check_timeout(now=1.5)  # stalled: go back to the ack (backoff 2)
    assert s.pump(now=1.5) == 2  # a burst (32 / 16): 2 and 3, flagged RETX
    assert _on_wire(rx, 2) == ([2, 3], [True, True])
    s.on_ack(8, 40, now=1.51)  # the hole closed: 7 (sent at 1.0, never resent) is acked 0.51 s later
    assert s.stats["rtt_samples"] == 1, "a gap closing was taken as a 0.51 s round trip"
    assert s.rto.srtt == pytest.approx(0.01) and s.rto.backoff == 2  # held until a fresh sample
    seg = s.reserve(1)
    seg.ready(_fill)
    assert s.pump(now=2.0) == 1
    s.on_ack(9, 41, now=2.01)  # a packet sent once and acked at once: a fresh sample
    assert s.stats["rtt_samples"] == 2 and s.rto.backoff == 1
    assert s.rto.rto <= loss_free_rto  # the RTO after recovery is the loss-free one


def test_every_hole_the_results_reveal_is_resent_at_once_and_once_per_rtt(wire):
    tx, rx = wire
    w = RecvWindow(32)
    s = SendStream(tx, window=32, rto=RtoEstimator(POLICY), row_bytes=ROW, received=w.received_mask)
    seg = s.reserve(12)
    seg.ready(_fill)
    assert s.pump(now=1.0) == 12
    _on_wire(rx, 12)
    assert _deliver(s, w, [0, 1], now=1.01) == 0  # in order: no hole, one sample
    assert s.stats["rtt_samples"] == 1 and s.rto.srtt == pytest.approx(0.01)
    assert _deliver(s, w, [3, 4, 6, 7], now=1.011) == 2  # 2 and 5 are lost: both marked, not just the first
    assert s.pump(now=1.011) == 2
    assert _on_wire(rx, 2) == ([2, 5], [True, True]), "exactly the holes, flagged RETX"
    assert s.stats["timeouts"] == 0 and s.stats["holes"] == 2
    # 8 was sent before the resends of 2 and 5, so their fate is still unknown: nothing marked
    assert _deliver(s, w, [8], now=1.012) == 0 and s.pump(now=1.012) == 0
    assert _deliver(s, w, [9, 10, 11], now=1.013) == 0
    seg = s.reserve(2)
    seg.ready(_fill)
    assert s.pump(now=1.014) == 2  # 12 and 13, sent after the resends
    _on_wire(rx, 2)
    # 12 is back and 2, 5 are not, but they were resent less than a smoothed RTT ago: wait
    assert _deliver(s, w, [12], now=1.016) == 0 and s.pump(now=1.016) == 0
    # 13 is back a smoothed RTT after the resends: lost again, resent again
    assert _deliver(s, w, [13], now=1.03) == 2
    assert s.pump(now=1.03) == 2 and _on_wire(rx, 2) == ([2, 5], [True, True])
    assert _deliver(s, w, [2, 5], now=1.035) == 0
    assert s.idle() and s.stats["timeouts"] == 0 and s.stats["retransmitted"] == 4
    assert s.stats["rtt_samples"] == 6, "2 and 5 (resent, out of order) are no samples"
    assert s.rto.srtt < 0.02 and s.rto.backoff == 1, "recovery inflated the RTO"


def test_loss_free_in_order_results_never_mark_a_hole(wire):
    tx, rx = wire
    w = RecvWindow(32)
    s = SendStream(tx, window=32, rto=RtoEstimator(POLICY), row_bytes=ROW, received=w.received_mask)
    t = 1.0
    for _ in range(20):  # 20 rounds over a 32-row ring (it wraps): send 5, results come back in two batches
        seg = s.reserve(5)
        seg.ready(_fill)
        assert s.pump(now=t) == 5
        first = seg.start
        assert _deliver(s, w, [first, first + 1], now=t + 0.004) == 0
        assert _deliver(s, w, [first + 2, first + 3, first + 4], now=t + 0.005) == 0
        t += 0.01
    _on_wire(rx, 100)
    assert s.idle() and s.stats["retransmitted"] == 0 and s.stats["holes"] == 0
    assert s.stats["rtt_samples"] == 40 and 0.004 <= s.rto.srtt <= 0.005


def test_a_lost_resend_in_a_full_window_is_probed_again_without_a_timeout(wire):
    """Nothing new can be sent while the window waits on the hole, so no later RESULT can prove its
    resend lost: the probe timeout (2 SRTT) resends it, before and instead of the backed-off RTO."""
    tx, rx = wire
    w = RecvWindow(8)
    s = SendStream(tx, window=8, rto=RtoEstimator(POLICY), row_bytes=ROW, received=w.received_mask)
    seg = s.reserve(20)
    seg.ready(_fill)
    assert s.pump(now=1.0) == 8  # the window is full
    _on_wire(rx, 8)
    assert _deliver(s, w, [0], now=1.01) == 0
    assert _deliver(s, w, [2, 3, 4, 5, 6, 7], now=1.011) == 1
    # the resend, which is lost too, and 8 (the ack moved to 1), which waits on another worker
    assert s.pump(now=1.011) == 2 and _on_wire(rx, 2) == ([1, 8], [True, False])
    assert s.deadline() < 1.04  # the engine wakes for the probe
    assert not s.check_timeout(now=1.015) and s.pump(now=1.015) == 0  # under a probe timeout: wait
    assert not s.check_timeout(now=1.04)  # a probe, not a timeout (the RTO had also run out)
    assert s.pump(now=1.04) == 2 and _on_wire(rx, 2) == ([1, 8], [True, True])  # the hole and the tail
    assert s.stats["probes"] == 2 and s.stats["timeouts"] == 0 and s.rto.backoff == 1
    assert _deliver(s, w, [1, 8], now=1.05) == 0 and s.ack == 9
    assert s.pump(now=1.05) == 8  # the window moves on
