"""Property tests: the vectorised pipeline processes a batch exactly as a one-packet-at-a-time run
of the same controls does, and both agree with an independent plain-Python model of the spec,
on random sequences of packets (duplicates, retransmissions, several sessions, both sets,
resends, heartbeats across the serial wrap-around, malformed and foreign packets), with the
numba lane kernel and with the numpy reference (LUWU_KERNELS)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switch_reference import ReferenceSwitch
from switch_setup import LANES, SESSIONS, SLOTS, agg_packet, heartbeat, param, pull, runtime

from luwu.dataplane.protocol import NODE, Flag, MsgType, Packet
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

WRAP = 0xFFFFFFF0  # heartbeat acks near the 32-bit wrap-around


@st.composite
def packets(draw):
    """A short run of packets: mostly whole phases (every worker of a session, shuffled, with
    duplicates and losses), plus heartbeats, PARAM/PULL, mutated headers and junk."""
    kind = draw(st.sampled_from(["phase"] * 6 + ["agg"] * 3 + ["hb"] * 3 + ["param", "pull", "mutant", "junk"]))
    session = draw(st.sampled_from([1, 1, 2, 2, 3, 3, 4, 5, 6, 77]))
    worker = draw(st.sampled_from([0, 1, 2, 0, 1, 2, 9, NODE]))
    port = draw(st.integers(1, 4))
    if kind == "phase":
        ranks = list(SESSIONS.get(session, (0, 0, (0, 1)))[2])
        seq = draw(st.integers(0, 11))
        mtype = draw(st.sampled_from([MsgType.ALLREDUCE, MsgType.GRAD]))
        flags = draw(st.sampled_from([0, 0, Flag.MAX, Flag.SATURATED]))
        order = draw(st.permutations(ranks + ranks[:draw(st.integers(0, len(ranks)))]))
        out = []
        for r in order:
            if draw(st.integers(0, 9)) == 0:
                continue  # lost
            values = draw(st.lists(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 99]), min_size=LANES,
                                   max_size=LANES))
            out.append((r + 1, agg_packet(session, r, seq, values, mtype=mtype,
                                           flags=flags | draw(st.sampled_from([0, 0, Flag.RETX, Flag.SATURATED])),
                                           exponent=draw(st.integers(-128, 127)))))
        return out
    if kind == "agg":
        mtype = draw(st.sampled_from([MsgType.ALLREDUCE, MsgType.GRAD, MsgType.RESULT, MsgType.AGG]))
        seq = draw(st.integers(0, 11))
        flags = draw(st.sampled_from([0, 0, Flag.RETX, Flag.SATURATED, Flag.MAX, Flag.FALLBACK]))
        values = draw(st.lists(st.sampled_from([0, 1, -1, 7, 2**31 - 1, -(2**31), 123456789]), min_size=LANES,
                               max_size=LANES))
        slot = draw(st.sampled_from([None] * 8 + [30, 2**32 - 1]))
        data = agg_packet(session, worker, seq, values, mtype=mtype, flags=flags,
                          exponent=draw(st.integers(-128, 127)), slot=slot,
                          count=draw(st.sampled_from([LANES, LANES, 3, LANES + 1])))
        if draw(st.integers(0, 30)) == 0:
            data = data[:-4]
        return [(port, data)]
    if kind == "hb":
        return [(port, heartbeat(session, worker, WRAP + draw(st.integers(0, 40)), WRAP + draw(st.integers(0, 60))))]
    if kind == "param":
        return [(port, param(session, count=draw(st.integers(0, 5)), dtype=draw(st.sampled_from([1, 2, 3, 9])),
                             worker=worker))]
    if kind == "pull":
        return [(port, pull(session, worker))]
    if kind == "mutant":  # a valid packet with a bad version/type nibble or a cut/extended length
        data = bytearray(agg_packet(session, worker, draw(st.integers(0, 11)), [1] * LANES))
        how = draw(st.sampled_from(["version", "type", "cut", "extend"]))
        if how == "version":
            data[0] = (draw(st.sampled_from([0, 2, 15])) << 4) | (data[0] & 0xF)
        elif how == "type":
            data[0] = (data[0] & 0xF0) | draw(st.sampled_from([0, 8, 15]))
        elif how == "cut":
            data = data[:draw(st.integers(0, len(data) - 1))]
        else:
            data += bytes(draw(st.integers(1, 8)))
        return [(port, bytes(data))]
    return [(port, draw(st.binary(min_size=0, max_size=80)))]


def flat(runs):
    return [p for run in runs for p in run]


def make_switch() -> SoftwareSwitch:
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=1))
    sw.load_runtime(runtime())
    return sw


def core(c: dict) -> dict:
    return {k: c[k] for k in ("drops", "events", "rx_types", "session_packets")}


@pytest.fixture(scope="module", params=["numba", "reference"])
def kernels(request):
    """Both lane paths of the fold (fast/aggregate_groups.py): the numba kernel and the numpy reference."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LUWU_KERNELS", request.param)
    yield request.param
    mp.undo()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(packets(), min_size=1, max_size=25).map(flat), st.randoms(use_true_random=False))
def test_batch_equals_one_at_a_time_and_reference(kernels, items, rnd):
    batched, single, chunked = make_switch(), make_switch(), make_switch()
    ref = ReferenceSwitch(LANES, SLOTS)
    ref.load(runtime())
    out_batch = batched.process_datagrams(items)
    out_single = [o for it in items for o in single.process_datagrams([it])]
    out_chunks, i = [], 0
    while i < len(items):
        k = rnd.randint(1, 9)
        out_chunks += chunked.process_datagrams(items[i:i + k])
        i += k
    out_ref = [o for port, data in items for o in ref.process(port, data)]
    assert out_single == out_ref
    assert out_batch == out_ref
    assert out_chunks == out_ref
    assert core(batched.counters()) == core(single.counters()) == core(chunked.counters()) == ref.counters()
    r1, r2 = batched.registers, single.registers
    for name in ("slot_owner", "bitmap", "contributors", "exponents", "slot_flags", "lanes", "hb_owner", "hb_bitmap",
                 "hb_ack", "hb_credit"):
        assert np.array_equal(getattr(r1, name), getattr(r2, name)), name


def _phase(session: int, seq: int, ranks, rng, mtype=MsgType.ALLREDUCE):
    return [(r + 1, agg_packet(session, r, seq, rng.integers(-2**31, 2**31, LANES), mtype=mtype)) for r in ranks]


def test_many_phases_in_one_batch_need_rounds(kernels):
    """Several phases of one slot and both sets in a single batch: rounds keep them exact."""
    rng = np.random.default_rng(3)
    items = []
    for seq in range(12):  # pool of 4: every slot is hit by 3 phases, both sets
        items += _phase(1, seq, (0, 1, 2), rng)
        items += _phase(2, seq, (2, 0, 1), rng, MsgType.GRAD)
    items += [items[5], items[0]]  # duplicates after completion -> resends
    batched, single = make_switch(), make_switch()
    ref = ReferenceSwitch(LANES, SLOTS)
    ref.load(runtime())
    out = batched.process_datagrams(items)
    assert out == [o for it in items for o in single.process_datagrams([it])]
    assert out == [o for port, data in items for o in ref.process(port, data)]
    results = [Packet.unpack(d) for _, d in out]
    assert sum(1 for p in results if p.type == MsgType.RESULT and not p.flags & Flag.RETX) == 12 * 3
    assert sum(1 for p in results if p.type == MsgType.AGG and not p.flags & Flag.RETX) == 12
    assert sum(1 for p in results if p.flags & Flag.RETX) == 2
