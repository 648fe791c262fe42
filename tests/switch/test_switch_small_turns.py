"""Turns of a few packets take the switch's small-turn path (dataplane/switch/small_classify.py,
picked by `pipeline.SMALL_TURN`): on random small batches of every packet type, malformed ones
included, it must give exactly what the vectorised path gives -- the classifier's every field
(values and dtypes), drop reasons and session counters, and a whole switch's outputs (bytes and
order), registers and counters turn after turn."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switch_setup import LANES, SLOTS, runtime
from test_switch_vectorised_equivalence import packets

from luwu.dataplane.protocol import DropReason, aggregation_packet_len
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig, pipeline
from luwu.dataplane.switch.batch import Batch
from luwu.dataplane.switch.controls.classifier import Classified, classify
from luwu.dataplane.switch.controls.parser import parse
from luwu.dataplane.switch.counters import Counters
from luwu.dataplane.switch.small_classify import classify_small

REGISTERS = ("slot_owner", "bitmap", "contributors", "exponents", "slot_flags", "lanes", "hb_owner", "hb_bitmap",
             "hb_ack", "hb_credit")


def rt() -> dict:
    """The switch tests' runtime plus a child switch on port 4 of session 3 (FALLBACK GRADs pass from there)."""
    r = runtime()
    r["table_entries"].append({"table": "child_ports", "match": {"session": 3, "port": 4},
                               "action_name": "child_port", "action_params": {}})
    return r


def make_switch() -> SoftwareSwitch:
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=1))
    sw.load_runtime(rt())
    return sw


# up to pipeline.SMALL_TURN packets (the small path's limit): packets() gives runs of one to a few
small_batches = st.lists(packets(), min_size=1, max_size=6).map(lambda runs: [p for r in runs for p in r][:12]) \
    .filter(bool)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_batches, st.lists(st.booleans(), min_size=12, max_size=12))
def test_small_classifier_equals_the_vectorised_one(items, predropped):
    tables = make_switch().tables.compiled()
    got = {}
    for name, fn in (("vectorised", classify), ("small", classify_small)):
        b = Batch.from_bytes(items, False, aggregation_packet_len(LANES))
        b.drop[np.array(predropped[:len(items)])] = 7  # dropped before the classifier (an attachment, the simulator)
        parse(b, 0)
        cnt = Counters()
        c = fn(b, tables, LANES, cnt)
        got[name] = (c, b.drop.copy(), cnt.session_packets.copy())
    (cv, dv, sv), (cs, ds, ss) = got["vectorised"], got["small"]
    assert np.array_equal(dv, ds)
    assert np.array_equal(sv, ss)
    for field in Classified.__slots__:
        a, b_ = getattr(cv, field), getattr(cs, field)
        assert a.dtype == b_.dtype, field
        assert a.tobytes() == b_.tobytes(), field  # tobytes: structured headers too


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(small_batches, min_size=1, max_size=10))
def test_small_turns_equal_vectorised_turns(turns):
    small, general = make_switch(), make_switch()
    saved = pipeline.SMALL_TURN
    assert saved >= 12  # the batches above stay within the small path
    try:
        for items in turns:
            pipeline.SMALL_TURN = len(items)
            out_small = small.process_datagrams(items)
            pipeline.SMALL_TURN = 0
            out_general = general.process_datagrams(items)
            assert out_small == out_general
    finally:
        pipeline.SMALL_TURN = saved
    assert small.counters() == general.counters()
    for name in REGISTERS:
        assert np.array_equal(getattr(small.pipeline.registers, name), getattr(general.pipeline.registers, name)), name
    assert small.errors == general.errors == 0


def test_the_small_path_is_taken_and_counts():
    """A one-packet turn goes through classify_small (its drop reasons reach the counters)."""
    calls = []
    real = pipeline.classify_small

    def spy(*a):
        calls.append(1)
        return real(*a)

    pipeline.classify_small = spy
    try:
        sw = make_switch()
        sw.process_datagrams([(1, b"\x20" + bytes(31))])  # version 2: BAD_VERSION
    finally:
        pipeline.classify_small = real
    assert calls == [1]
    assert sw.counters()["drops"][int(DropReason.BAD_VERSION)] == (1, 32)
