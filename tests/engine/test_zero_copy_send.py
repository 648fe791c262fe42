"""Zero-copy send on shared-memory ports (send_stream.py `refill`, ShmRing.fill_rows).

A collective stream writes each packet straight into the switch port's up ring and keeps no copy:
a retransmission runs the fill again from the operation's source. These tests make the new path
fail loudly if it writes a packet wrong: a real ring pair driven with an explicit clock (ring full,
wrap, timeout, resend, skipped resends), and end-to-end sums through the software switch's drop
simulator (loss, duplication, reordering) in place, compared bit for bit with a loss-free run.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from luwu.dataplane.engine.packets import QuantizedLanes, aggregation_fill
from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy, SendStream
from luwu.dataplane.integrity import HCHECK_OFFSET, header_ok
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.net.shm_endpoint import ShmEndpoint
from luwu.dataplane.net.shm_ring import ShmRing, supported
from luwu.dataplane.protocol import DropReason, Dtype, Flag, MsgType, header_view

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")

ROW = 64


@pytest.fixture
def port():
    """A switch port's ring pair made here (the switch's side) and an endpoint on it: 8 slots up."""
    prefix = f"/dev/shm/luwu-test-{os.getpid()}-{time.monotonic_ns()}"
    down = ShmRing(prefix + ".down", "producer", slots=8, row_bytes=ROW, create=True)
    up = ShmRing(prefix + ".up", "consumer", slots=8, row_bytes=ROW, create=True)
    ep = ShmEndpoint(prefix, batch=8)
    yield ep, up
    ep.close()
    up.close()
    down.close()


def _fill(i0, i1, rows, lens):
    rows[:, :8] = 0
    rows[:, 4] = np.arange(i0, i1)  # the packet's index, to recognise it in the ring
    rows[:, 8:ROW] = (np.arange(i0, i1)[:, None] * 7 + np.arange(ROW - 8)) % 251  # a body to check byte by byte
    lens[:] = ROW - (np.arange(i0, i1) % 3)


def _want(i):
    row = np.zeros(ROW, dtype=np.uint8)
    row[4] = i
    row[8:] = (i * 7 + np.arange(ROW - 8)) % 251
    return row, ROW - i % 3


def _drain(up, n=64):
    rows = np.zeros((n, ROW), dtype=np.uint8)
    lens = np.zeros(n, dtype=np.int64)
    k = up.pop_into(rows, lens, 0, n)
    return rows[:k], lens[:k]


def _same_but_hcheck(resent: np.ndarray, first: np.ndarray) -> bool:
    """A resend is the first transmission from byte 8 on but for its header check, which covers
    the RETX flag and is sealed again (docs/protocol.md 3.5)."""
    return (header_ok(resent.tobytes()) and np.array_equal(resent[8:HCHECK_OFFSET], first[8:HCHECK_OFFSET])
            and np.array_equal(resent[HCHECK_OFFSET + 2:], first[HCHECK_OFFSET + 2:]))


def test_packets_are_written_in_place_and_wait_for_room_in_a_full_ring(port):
    ep, up = port
    s = SendStream(ep, window=32, rto=RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01)), row_bytes=ROW,
                   received=lambda first, count: np.zeros(count, dtype=bool), refill=True)
    assert s.direct and s.ring is None, "a refillable stream on a shm port keeps no send ring"
    seg = s.reserve(20)
    seg.ready(_fill)
    got = []
    for turn in range(10):  # 8 slots: the ring fills, the stream waits (nothing lost), then goes on
        s.pump(now=1.0 + turn)
        rows, lens = _drain(up)
        got += [(r.copy(), int(n)) for r, n in zip(rows, lens)]
        if len(got) >= 20:
            break
    assert len(got) == 20 and s.stats["packets"] == 20 and ep.stats["tx_errors"] == 0
    for i, (row, n) in enumerate(got):  # every packet once, in order, every byte of it right (across the wrap)
        want, wn = _want(i)
        assert n == wn and np.array_equal(row[:n], want[:n]), i
        assert not row[1] & int(Flag.RETX)
    assert ep.stats["tx_packets"] == 20 and ep.stats["tx_bytes"] == sum(n for _, n in got)


def test_a_resend_is_filled_again_flagged_and_skips_what_got_through(port):
    ep, up = port
    through = set()  # seqs the receiver says it has (a collective's RESULTs)

    def received(first, count):
        return np.array([(first + i) in through for i in range(count)], dtype=bool)

    s = SendStream(ep, window=32, rto=RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01)), row_bytes=ROW,
                   received=received, refill=True)
    seg = s.reserve(6)
    seg.ready(_fill)
    assert s.pump(now=1.0) == 6
    _drain(up)
    s.on_ack(1, 40, now=1.01)  # packet 0 acknowledged; 2 and 4 got through, 1, 3, 5 are lost
    through.update({2, 4})
    s.burst = 8  # resend everything outstanding in one burst
    assert s.check_timeout(now=5.0)
    assert s.pump(now=5.0) == 3
    rows, lens = _drain(up)
    assert [int(r[4]) for r in rows] == [1, 3, 5], "a resend skips the packets known to have got through"
    for r, n in zip(rows, lens):
        want, wn = _want(int(r[4]))
        assert r[1] & int(Flag.RETX) and n == wn
        assert _same_but_hcheck(r[:n], want[:n]), "a resent packet is the packet, filled again"
    assert s.stats["retransmitted"] == 3
    s.on_ack(6, 40, now=5.2)  # ambiguous after a resend (Karn): no RTT sample
    assert s.stats["rtt_samples"] == 1 and s.idle()


def test_a_stream_without_delivery_news_resends_what_is_outstanding_filled_again(port):
    """A worker's gradient push stream (refill, no `received`: the node acknowledges cumulatively
    by heartbeat): no send ring on a shm port, and a timeout resends every unacknowledged packet,
    filled again from the source, flagged RETX, byte for byte the first transmission."""
    ep, up = port
    s = SendStream(ep, window=32, rto=RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01)), row_bytes=ROW, refill=True)
    assert s.direct and s.ring is None
    seg = s.reserve(5)
    seg.ready(_fill)
    assert s.pump(now=1.0) == 5
    first, _ = _drain(up)
    s.on_ack(2, 40, now=1.01)  # 0 and 1 acknowledged, 2-4 lost
    s.burst = 8
    assert s.check_timeout(now=5.0)
    assert s.pump(now=5.0) == 3
    rows, lens = _drain(up)
    assert [int(r[4]) for r in rows] == [2, 3, 4]
    for r, n in zip(rows, lens):
        i = int(r[4])
        assert r[1] & int(Flag.RETX) and n == _want(i)[1]
        assert _same_but_hcheck(r[:n], first[i][:n]), "a resent packet is the first one, filled again"
    s.on_ack(5, 40, now=5.2)
    assert s.idle() and s.stats["retransmitted"] == 3


def test_a_workers_push_stream_writes_straight_into_the_up_ring():
    """The worker engine's gradient stream on a shm port is the zero-copy kind (node_worker.py)."""
    from luwu.dataplane.engine.engine import Engine
    from luwu.dataplane.loopback import LoopbackSwitch, StarPlan

    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64, transport="shm")
    with LoopbackSwitch(plan):
        eng = Engine(plan.worker_plan(0))
        try:
            grad = eng.sessions[plan.node_session(0)].grad
            assert grad.direct and grad.ring is None
        finally:
            eng.close()


def test_a_refill_after_the_callers_handle_failed_sends_no_plausible_number():
    """Once the caller's handle failed, its buffer may be reused: a resend then carries zeros flagged
    SATURATED (the switch's sum of that chunk is SATURATED: an exact recomputation or NaN)."""
    lanes, x = 8, np.arange(24, dtype=np.float32)
    alive = [True]
    lanes_of = QuantizedLanes(x, np.full(3, 5, np.int32), lanes, 2, live=lambda: alive[0])
    fill = aggregation_fill(seg_start=0, msg_type=MsgType.ALLREDUCE, session=2, worker=1, pool_base=0, pool_size=8,
                            lanes=lanes, tensor=0, numel=x.size, dtype=Dtype.FIXED32, lanes_of=lanes_of,
                            exponents=np.full(3, 5, np.int32))
    rows = np.full((3, 32 + 4 * lanes), 0xAB, dtype=np.uint8)
    lens = np.zeros(3, dtype=np.int64)
    fill(0, 3, rows, lens)
    assert not (header_view(rows)["flags"] & int(Flag.SATURATED)).any() and rows[:, 36:].any()
    alive[0] = False
    fill(0, 3, rows, lens)
    assert (header_view(rows)["flags"] & int(Flag.SATURATED)).all() and not rows[:, 32:].any()


@pytest.mark.parametrize("op", ["sum", "max"])
def test_in_place_sums_under_loss_are_the_loss_free_bits(op):
    """Through the switch's drop simulator on shm ports, in place (out=x: a chunk's result overwrites
    its source, so a resend of a chunk whose RESULT arrived would send the sum): every element of
    every worker's result equals the loss-free run's, bit for bit (fixed-point sums are exact adds)."""
    n, numel = 4, 37 * 64 + 5
    rng = np.random.default_rng(3)
    floats = [(rng.standard_normal(numel) * 100).astype(np.float32) for _ in range(n)]
    ints = [rng.integers(-(2**20), 2**20, numel).astype(np.int32) for _ in range(n)]
    with star(n, transport="shm", data_pool=32) as (_, _, engines):
        assert all(e.data.send.direct for e in engines)
        ref_f = [h.wait(120) for h in [e.allreduce(x, op) for e, x in zip(engines, floats)]]
        ref_i = [h.wait(120) for h in [e.allreduce(x, op) for e, x in zip(engines, ints)]]
    drop = {"ingress": 0.05, "egress": 0.05, "duplicate": 0.02, "reorder": 0.02}
    with star(n, transport="shm", drop=drop, seed=9, data_pool=32) as (_, sw, engines):
        got_f = [x.copy() for x in floats]
        got_i = [x.copy() for x in ints]
        for bufs in (got_f, got_i):
            hs = [e.allreduce(b, op, out=b) for e, b in zip(engines, bufs)]
            assert all(h.wait(120) is b for h, b in zip(hs, bufs))
        stats = [e.session_stats() for e in engines]
        counters = sw.counters()
    for ref, got in ((ref_f, got_f), (ref_i, got_i)):
        for a, b in zip(ref, got):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert counters["drops"].get(int(DropReason.SIMULATED_LOSS), (0, 0))[0] > 0, "the drop simulator dropped nothing"
    assert sum(s["session 2"]["send_stream"]["retransmitted"] for s in stats) > 0, "nothing was resent"
