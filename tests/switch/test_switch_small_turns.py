"""Turns of a few packets take the switch's small-turn path (dataplane/switch/fast/classify_few.py,
picked by `pipeline.SMALL_TURN`): on random small batches of every packet type, malformed ones
included, it must give exactly what the vectorised path gives -- the classifier's every field
(values and dtypes), drop reasons and session counters, and a whole switch's outputs (bytes and
order), registers and counters turn after turn; turns that aggregate nothing (heartbeats,
PULLs, PARAMs, drops) also go through fast/route_few.py after the classifier, checked the same way."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switch_setup import LANES, SESSIONS, SLOTS, agg_packet, heartbeat, param, pull, runtime, worker_port
from test_switch_vectorised_equivalence import WRAP, packets

from luwu.dataplane.integrity import sealed
from luwu.dataplane.protocol import NODE, VERSION, DropReason, Flag, MsgType, aggregation_packet_len
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig, pipeline
from luwu.dataplane.switch.batch import Batch
from luwu.dataplane.switch.controls import parser
from luwu.dataplane.switch.controls.classifier import Classified, classify
from luwu.dataplane.switch.controls.parser import parse
from luwu.dataplane.switch.counters import Counters
from luwu.dataplane.switch.fast import route_few
from luwu.dataplane.switch.fast.classify_few import classify_small

REGISTERS = ("slot_owner", "bitmap", "contributors", "exponents", "slot_flags", "lanes", "hb_owner", "hb_bitmap",
             "hb_ack", "hb_credit")


BAD_VERSION_PACKET = sealed(bytes([(VERSION + 1) << 4]) + bytes(31))  # its header check holds


def rt() -> dict:
    """The switch tests' runtime plus a child switch on port 4 of session 3 (FALLBACK GRADs pass from there)."""
    r = runtime()
    r["table_entries"].append({"table": "child_ports", "match": {"session": 3, "port": 4},
                               "action_name": "child_port", "action_params": {}})
    return r


def make_switch(clock=None) -> SoftwareSwitch:
    """The test switch; with `clock`, keeping straggler records on it (their lags compared too)."""
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=1, stragglers=clock is not None))
    sw.load_runtime(rt())
    if clock is not None:
        sw.pipeline.stragglers.clock = clock
    return sw


# up to pipeline.SMALL_TURN packets (the small path's limit): packets() gives runs of one to a few
small_batches = st.lists(packets(), min_size=1, max_size=6).map(lambda runs: [p for r in runs for p in r][:12]) \
    .filter(bool)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_batches, st.lists(st.booleans(), min_size=12, max_size=12),
       st.lists(st.booleans(), min_size=12, max_size=12))
def test_small_classifier_equals_the_vectorised_one(items, predropped, lost):
    tables = make_switch().tables.compiled()
    got = {}
    for name, fn in (("vectorised", classify), ("small", classify_small)):
        b = Batch.from_bytes(items, False, aggregation_packet_len(LANES))
        b.drop[np.array(predropped[:len(items)])] = 7  # dropped before the parser (an attachment)
        parse(b, 0)
        # and after it, as the ingress drop simulator drops (luwu packets it leaves marked luwu)
        b.drop[np.array(lost[:len(items)]) & (b.drop == 0)] = DropReason.SIMULATED_LOSS
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
    assert pipeline.SMALL_TURN >= 12  # the batches above stay within the small path
    _small_equals_vectorised(turns, tick=0.003)


@contextmanager
def _counted(module, name: str) -> Iterator[list]:
    """`module.name` wrapped for the block: the list yielded gets an entry per call."""
    calls: list = []
    real = getattr(module, name)

    def spy(*a):
        calls.append(1)
        return real(*a)

    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def test_the_small_path_is_taken_and_counts():
    """A one-packet turn goes through the small classifier (its drop reasons reach the counters)."""
    with _counted(pipeline, "classify_rows") as calls:
        sw = make_switch()
        sw.process_datagrams([(1, BAD_VERSION_PACKET)])  # another version: BAD_VERSION
    assert calls == [1]
    assert sw.counters()["drops"][int(DropReason.BAD_VERSION)] == (1, 32)


@st.composite
def routed(draw):
    """One packet that aggregates nothing: a rank's heartbeat or PULL from its port, the node's (or
    the parent's) heartbeat or PARAM from the session's up port (group 4 has no replicas; session 3
    is UPSTREAM), now and then from the wrong port, or a malformed packet (dropped)."""
    session = draw(st.sampled_from([1, 2, 3, 4, 5]))
    _, _, ranks, _, _, up_port, _ = SESSIONS[session]
    rank = draw(st.sampled_from(ranks))
    kind = draw(st.sampled_from(["hb"] * 5 + ["node_hb", "param", "param", "pull", "pull", "drop"]))
    ack, credit = WRAP + draw(st.integers(0, 40)), WRAP + draw(st.integers(0, 60))
    if kind == "hb":
        item = (worker_port(rank), heartbeat(session, rank, ack, credit))
    elif kind == "node_hb":
        item = (up_port, heartbeat(session, NODE, ack, credit))
    elif kind == "param":
        item = (up_port, param(session, count=draw(st.integers(0, 5)), worker=NODE))
    elif kind == "pull":
        item = (worker_port(rank), pull(session, rank))
    else:
        item = (worker_port(rank), draw(st.sampled_from([BAD_VERSION_PACKET, b"\x20" + bytes(31), bytes(12), pull(session, rank)[:-1]])))
    if draw(st.integers(0, 12)) == 0:
        item = (draw(st.integers(0, 5)), item[1])  # a spoofed or misrouted one
    return item


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(routed(), min_size=1, max_size=12), min_size=1, max_size=12))
def test_small_routes_equal_vectorised_turns(turns):
    """Turns of heartbeats, PULLs, PARAMs and drops: fast/route_few.py's stages equal the vectorised
    select + expand + counters (outputs, heartbeat registers, counters), and every such turn takes them."""
    with _counted(route_few, "route") as calls:
        _small_equals_vectorised(turns, tick=0.002)
    assert len(calls) == len(turns)


@st.composite
def contribution(draw):
    """A rank's GRAD or ALLREDUCE from its own port: inside its session's pool or not (slot 30),
    marked FALLBACK or not, ZERO (header-only) now and then; or a heartbeat or PULL between them."""
    session = draw(st.sampled_from([1, 2, 3, 5, 6]))
    ranks = SESSIONS[session][2]
    rank = draw(st.sampled_from(ranks))
    if draw(st.integers(0, 4)) == 0:
        return (worker_port(rank), draw(st.sampled_from([heartbeat(session, rank, 5, 9), pull(session, rank)])))
    mtype = draw(st.sampled_from([MsgType.GRAD, MsgType.ALLREDUCE]))
    flags = draw(st.sampled_from([0, 0, Flag.FALLBACK, Flag.MAX, Flag.ZERO]))
    data = agg_packet(session, rank, draw(st.integers(0, 7)), [draw(st.integers(-5, 5))] * LANES, mtype=mtype,
                      flags=flags, slot=draw(st.sampled_from([None, None, None, 30])), dtype=0)
    return (worker_port(rank), data[:32] if flags == Flag.ZERO else data)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(contribution(), min_size=1, max_size=16), min_size=1, max_size=10))
def test_small_contributions_equal_vectorised_turns(turns):
    """Contributions of valid ranks (in and out of the pool, FALLBACK, ZERO): the small classifier's
    paths and the small route's emissions equal the vectorised path's, turn by turn."""
    _small_equals_vectorised(turns, tick=0.002)


def _small_equals_vectorised(turns, tick: float) -> None:
    """Two switches on one clock (a tick per turn: the straggler lags compare exactly), one taking
    every turn down the small path and one down the vectorised path: the same outputs turn by
    turn, then the same counters and registers."""
    now = [0.0]
    small, general = make_switch(lambda: now[0]), make_switch(lambda: now[0])
    saved = pipeline.SMALL_TURN
    try:
        for items in turns:
            now[0] += tick
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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_batches, st.lists(st.booleans(), min_size=12, max_size=12))
def test_the_parsers_small_length_check_equals_the_array_one(items, predropped):
    """parser.parse looks at a few packets' lengths on Python ints (parser.SMALL): the same drops,
    luwu and ipv4 marks as its array check (short packets and earlier drops included)."""
    got = []
    saved = parser.SMALL
    try:
        for small in (saved, 0):
            parser.SMALL = small
            b = Batch.from_bytes(items, False, aggregation_packet_len(LANES))
            b.length[:] = [len(d) for _, d in items]
            b.drop[np.array(predropped[:len(items)])] = 7
            parse(b, 0)
            got.append((b.drop.tolist(), b.luwu.tolist(), b.ipv4.tolist(), b.luwu_len.tolist()))
    finally:
        parser.SMALL = saved
    assert got[0] == got[1]
