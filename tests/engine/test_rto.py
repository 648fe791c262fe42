"""The adaptive retransmission timeout (dataplane/engine/send_stream.py, RFC 6298).

The estimator's arithmetic, then a real `SendStream` on a loopback UDP socket driven with an
explicit clock (the `now` arguments), so nothing here depends on how fast the machine is: RTT
samples come from row send times, Karn's rule drops samples of retransmitted rows, timeouts back
off and the next fresh sample resets the backoff, and a stream that was idle starts its timer when
it sends again instead of timing out at once.
"""

from __future__ import annotations

import pytest
from stream_wire import ROW, udp_wire
from stream_wire import fill_indexed as _fill

from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy, SendStream
from luwu.dataplane.protocol import Flag


def test_rfc6298_smoothing_bounds_and_backoff():
    p = RtoPolicy(initial=0.1, minimum=0.01, maximum=0.5, granularity=0.001, max_backoff=8)
    e = RtoEstimator(p)
    assert e.rto == pytest.approx(0.1)  # no sample yet: the initial RTO
    e.sample(0.02)  # first: SRTT = R, RTTVAR = R/2, RTO = R + 4 R/2
    assert (e.srtt, e.rttvar, e.rto) == pytest.approx((0.02, 0.01, 0.06))
    e.sample(0.04)  # RTTVAR = 3/4 0.01 + 1/4 |0.02 - 0.04|, SRTT = 7/8 0.02 + 1/8 0.04
    assert (e.srtt, e.rttvar) == pytest.approx((0.0225, 0.0125))
    assert e.rto == pytest.approx(0.0225 + 4 * 0.0125)
    for _ in range(200):
        e.sample(0.0001)  # a quiet link: RTO falls to the minimum, never below
    assert e.rto == pytest.approx(0.01)
    for want in (0.02, 0.04, 0.08, 0.08):  # doubles per timeout, capped at max_backoff
        e.back_off()
        assert e.rto == pytest.approx(want)
    e.sample(2.0)
    assert e.rto == pytest.approx(0.5)  # and never above the maximum


@pytest.fixture
def stream():
    with udp_wire() as (tx, rx):
        yield SendStream(tx, window=32, rto=RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01, maximum=1.0)),
                         row_bytes=ROW), rx


def _received(rx, k):
    return [rx.recv(ROW) for _ in range(k)]


def test_samples_rtt_from_send_times_and_applies_karns_rule(stream):
    s, rx = stream
    seg = s.reserve(4)
    seg.ready(_fill)
    assert s.pump(now=1.0) == 4
    assert [p[4] for p in _received(rx, 4)] == [0, 1, 2, 3]
    s.on_ack(2, 9, now=1.03)  # packets 0 and 1: the newest acked was sent at 1.0
    assert s.rto.srtt == pytest.approx(0.03) and s.stats["rtt_samples"] == 1
    assert s.stats["rtt_seconds"] == pytest.approx(0.03)  # the mean wait luwu_engine_stat exports
    assert not s.check_timeout(now=1.03 + 0.05)  # progress at 1.03 and RTO 0.09: not yet
    assert s.check_timeout(now=1.03 + 0.2)  # stalled past the RTO: go back to the ack
    assert s.stats["timeouts"] == 1 and s.rto.backoff == 2
    assert s.pump(now=1.3) == 2  # packets 2 and 3 again (a burst: 32 / 16), flagged RETX
    again = _received(rx, 2)
    assert [p[4] for p in again] == [2, 3] and all(p[1] & int(Flag.RETX) for p in again)
    s.on_ack(4, 11, now=5.0)  # ambiguous (original or resend?): no sample, so the backoff holds
    assert s.stats["rtt_samples"] == 1 and s.rto.srtt == pytest.approx(0.03)
    assert s.rto.backoff == 2 and s.idle()
    seg = s.reserve(1)
    seg.ready(_fill)
    assert s.pump(now=6.0) == 1
    s.on_ack(5, 12, now=6.03)  # sent once, acked: a fresh sample resets the backoff (Karn)
    assert s.stats["rtt_samples"] == 2 and s.rto.backoff == 1


def test_an_idle_stream_starts_its_timer_when_it_sends(stream):
    s, rx = stream
    seg = s.reserve(1)
    seg.ready(_fill)
    s.pump(now=0.0)
    s.on_ack(1, 9, now=0.01)
    _received(rx, 1)
    seg = s.reserve(2)  # much later, a new operation on the idle stream
    seg.ready(_fill)
    assert s.pump(now=100.0) == 2
    assert not s.check_timeout(now=100.001)  # the timer runs from the send, not from 0.01
    assert s.check_timeout(now=100.0 + s.rto.rto)
