"""Straggler bookkeeping (dataplane/switch/stragglers.py): the switch names the worker whose
contribution completed each slot and the time since the slot's first contribution, with one clock
reading per batch; duplicates are counted apart and never complete a slot twice."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from switch_setup import LANES, SLOTS, agg_packet, runtime, worker_port

from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig, stragglers
from luwu.dataplane.switch.counters import named

V = [1] * LANES


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def switch_with_clock() -> tuple[SoftwareSwitch, Clock]:
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=3, stragglers=True))
    sw.load_runtime(runtime())
    clock = Clock()
    sw.pipeline.stragglers.clock = clock
    return sw, clock


def test_last_worker_and_lag_per_slot():
    sw, clock = switch_with_clock()
    # session 1: workers 0, 1, 2. Slots 0..3: workers 0 and 1 first, worker 2 0.25 s later
    sw.process_datagrams([(worker_port(w), agg_packet(1, w, seq, V)) for seq in range(4) for w in (0, 1)])
    clock.now += 0.25
    sw.process_datagrams([(worker_port(2), agg_packet(1, 2, seq, V)) for seq in range(4)])
    # slot of seq 4..5 (next phase of slots 0..1): all three in one batch, worker 0 last: lag 0
    clock.now += 1.0
    sw.process_datagrams([(worker_port(w), agg_packet(1, w, seq, V)) for seq in (4, 5) for w in (2, 1, 0)])
    # a retransmission of a completed contribution
    sw.process_datagrams([(worker_port(1), agg_packet(1, 1, 5, V))])
    st = sw.counters()["stragglers"][1]
    assert st[2]["last"] == 4 and abs(st[2]["lag_seconds"] - 1.0) < 1e-9
    assert st[0]["last"] == 2 and st[0]["lag_seconds"] == 0.0
    assert st[1]["last"] == 0 and st[1]["duplicates"] == 1
    assert [st[w]["contributions"] for w in (0, 1, 2)] == [6, 6, 6]
    # 0.25 s lands in the (0.2, 0.5] bucket, 0 in the first
    from luwu.dataplane.switch.stragglers import LAG_BUCKETS
    assert st[2]["lag_buckets"][LAG_BUCKETS.index(0.5)] == 4
    assert st[0]["lag_buckets"][0] == 2
    assert named(sw.counters())["stragglers"]["1"]["2"]["last"] == 4
    sw.reset_counters()
    assert sw.counters()["stragglers"] == {}


def test_single_worker_session_completes_with_no_lag():
    sw, _ = switch_with_clock()
    sw.process_datagrams([(worker_port(2), agg_packet(4, 2, 0, V))])  # session 4: N = 1
    st = sw.counters()["stragglers"][4][2]
    assert st["last"] == 1 and st["lag_seconds"] == 0.0


def test_off_unless_asked_for():
    # the bookkeeping costs ~20 us per batch: a switch nobody scrapes does not pay it
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=3))
    sw.load_runtime(runtime())
    sw.process_datagrams([(worker_port(w), agg_packet(1, w, 0, V)) for w in (0, 1, 2)])
    assert sw.pipeline.stragglers is None
    assert "stragglers" not in sw.counters()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3), st.integers(0, 5), st.booleans(),
                                   st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=16),
                min_size=1, max_size=6))
def test_small_batches_recorded_one_by_one_equal_the_vectorised_record(batches):
    """Batches of up to stragglers.SMALL packets are recorded on Python ints: the same counts, lag
    sums (bit for bit) and buckets as the vectorised `record` (forced by a larger SMALL)."""
    got = []
    for small in (stragglers.SMALL, 0):
        saved, stragglers.SMALL = stragglers.SMALL, small
        try:
            clock = Clock()
            rec = stragglers.Stragglers(SLOTS, clock=clock)
            for batch in batches:
                clock.now += 0.0013
                cols = list(zip(*batch))
                session, bit_no, index, dup, remaining, nw = (np.array(c) for c in cols)
                rec.record(session, session * 10 + bit_no, (1 << bit_no).astype(np.int64), index, nw, dup,
                           remaining.astype(np.uint32))
        finally:
            stragglers.SMALL = saved
        got.append((rec.counts.copy(), rec.lag.copy(), rec.buckets.copy(), rec.worker_of.copy(), rec.first_seen.copy()))
    for a, b in zip(*got):
        assert a.tobytes() == b.tobytes()
