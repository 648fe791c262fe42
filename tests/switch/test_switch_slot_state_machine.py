"""Every branch of the slot state machine (docs/protocol.md 6.3), packet by packet, through
`process_datagrams`: first/middle/last contributor, duplicates before and after completion,
resend targets, fallback, foreign slots, epochs, shadow sets, N = 1, MAX, exponents and SATURATED."""

from __future__ import annotations

import numpy as np
import pytest
from switch_setup import LANES, NODE_PORT, PARENT_PORT, SLOTS, UP_WORKER, agg_packet, lanes_of, runtime, worker_port

from luwu.dataplane.protocol import NODE, DropReason, Event, Flag, MsgType, Packet
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig


@pytest.fixture
def sw():
    s = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    s.load_runtime(runtime())
    return s


def send(sw, *items):
    return sw.process_datagrams(list(items))


def ev(sw, e):
    return sw.counters()["events"][int(e)][0]


def dropped(sw, r):
    return sw.counters()["drops"][int(r)][0]


def vals(k):
    return [k * (i + 1) for i in range(LANES)]


def test_first_middle_last_contributor_then_multicast(sw):
    assert send(sw, (1, agg_packet(1, 0, 0, vals(1), exponent=-3))) == []  # first: absorbed
    assert send(sw, (2, agg_packet(1, 1, 0, vals(10), exponent=5))) == []  # middle: absorbed
    out = send(sw, (3, agg_packet(1, 2, 0, vals(100), exponent=2)))  # last: completes
    assert [p for p, _ in out] == [worker_port(0), worker_port(1), worker_port(2)]  # group order
    assert len({d for _, d in out}) == 1  # one packet, three replicas
    res = Packet.unpack(out[0][1])
    assert res.type == MsgType.RESULT and res.worker == NODE and res.exponent == 5
    assert res.seq == 0 and res.slot == 0 and res.tensor == 9 and res.count == LANES and res.numel == 1000
    assert lanes_of(out[0][1]) == vals(111)
    assert ev(sw, Event.ABSORBED) == 2 and ev(sw, Event.COMPLETED) == 1 and ev(sw, Event.MULTICAST) == 1


def test_sums_wrap_like_int32(sw):
    big = [2**31 - 1] * LANES
    send(sw, (1, agg_packet(1, 0, 1, big)), (2, agg_packet(1, 1, 1, big)))
    out = send(sw, (3, agg_packet(1, 2, 1, [5] * LANES)))
    want = (np.array(big, dtype=np.int32) + np.array(big, dtype=np.int32) + np.int32(5)).tolist()
    assert lanes_of(out[0][1]) == want


def test_duplicate_before_completion_is_dropped(sw):
    send(sw, (1, agg_packet(1, 0, 2, vals(1))))
    assert send(sw, (1, agg_packet(1, 0, 2, vals(7), flags=Flag.RETX))) == []
    assert dropped(sw, DropReason.DUPLICATE) == 1
    send(sw, (2, agg_packet(1, 1, 2, vals(2))))
    out = send(sw, (3, agg_packet(1, 2, 2, vals(3))))
    assert lanes_of(out[0][1]) == vals(6)  # the duplicate added nothing


def test_allreduce_duplicate_after_completion_resends_to_sender_only(sw):
    for r in range(3):
        send(sw, (r + 1, agg_packet(1, r, 3, vals(r + 1), flags=Flag.SATURATED if r == 1 else 0, exponent=r)))
    out = send(sw, (2, agg_packet(1, 1, 3, vals(50), flags=Flag.RETX)))
    assert [p for p, _ in out] == [worker_port(1)]  # the workers table's port of the sender
    res = Packet.unpack(out[0][1])
    assert res.type == MsgType.RESULT and res.flags & Flag.RETX and res.flags & Flag.SATURATED
    assert res.exponent == 2 and lanes_of(out[0][1]) == vals(6)
    assert ev(sw, Event.RESENT) == 1 and ev(sw, Event.UNICAST) == 1 and ev(sw, Event.SATURATED) == 2


def test_grad_completes_as_agg_to_node_and_resends_there(sw):
    for r in range(3):
        out = send(sw, (r + 1, agg_packet(2, r, 0, vals(r + 1), mtype=MsgType.GRAD)))
    assert [p for p, _ in out] == [NODE_PORT]
    res = Packet.unpack(out[0][1])
    assert res.type == MsgType.AGG and res.worker == NODE and not res.flags & Flag.RETX
    again = send(sw, (1, agg_packet(2, 0, 0, vals(9), mtype=MsgType.GRAD, flags=Flag.RETX)))
    assert [p for p, _ in again] == [NODE_PORT]
    res = Packet.unpack(again[0][1])
    assert res.type == MsgType.AGG and res.flags & Flag.RETX and lanes_of(again[0][1]) == vals(6)


@pytest.mark.parametrize("mtype", [MsgType.ALLREDUCE, MsgType.GRAD])
def test_upstream_switch_forwards_same_type_to_parent(sw, mtype):
    send(sw, (1, agg_packet(3, 0, 4, vals(1), mtype=mtype, exponent=-9)))
    out = send(sw, (2, agg_packet(3, 1, 4, vals(2), mtype=mtype, exponent=-7)))
    assert [p for p, _ in out] == [PARENT_PORT]
    res = Packet.unpack(out[0][1])
    assert res.type == mtype and res.worker == UP_WORKER and res.exponent == -7
    assert lanes_of(out[0][1]) == vals(3)
    again = send(sw, (1, agg_packet(3, 0, 4, vals(1), mtype=mtype, flags=Flag.RETX)))  # resend -> parent
    assert [p for p, _ in again] == [PARENT_PORT]
    assert Packet.unpack(again[0][1]).flags & Flag.RETX and Packet.unpack(again[0][1]).type == mtype


def test_result_from_parent_is_multicast_at_upstream_switch(sw):
    res = agg_packet(3, NODE, 4, vals(3), mtype=MsgType.RESULT)
    out = send(sw, (PARENT_PORT, res))
    assert [p for p, _ in out] == [worker_port(0), worker_port(1)] and out[0][1] == res


def test_fallback_outside_pool_and_with_flag(sw):
    out = send(sw, (1, agg_packet(2, 0, 0, vals(1), mtype=MsgType.GRAD, slot=20)))
    assert [p for p, _ in out] == [NODE_PORT]
    p = Packet.unpack(out[0][1])
    assert p.type == MsgType.GRAD and p.flags & Flag.FALLBACK and p.worker == 0 and lanes_of(out[0][1]) == vals(1)
    out = send(sw, (1, agg_packet(2, 0, 0, vals(2), mtype=MsgType.GRAD, flags=Flag.FALLBACK)))  # in pool, flagged
    assert [p for p, _ in out] == [NODE_PORT] and lanes_of(out[0][1]) == vals(2)
    assert ev(sw, Event.FALLBACK) == 2
    # the flagged packet did not touch the slot: a normal phase still needs all three
    assert send(sw, (1, agg_packet(2, 0, 0, vals(1), mtype=MsgType.GRAD))) == []
    assert sw.registers.bitmap[4] == 1  # set 0 of slot 4 (pool base 4): only worker 0's bit


def test_allreduce_outside_pool_is_foreign(sw):
    assert send(sw, (1, agg_packet(1, 0, 0, vals(1), slot=4))) == []  # slot 4 belongs to session 2
    assert send(sw, (1, agg_packet(1, 0, 0, vals(1), slot=2**32 - 1))) == []  # unsigned pool check
    assert dropped(sw, DropReason.FOREIGN_SLOT) == 2


def test_epoch_change_makes_reused_slot_fresh(sw):
    send(sw, (1, agg_packet(1, 0, 0, vals(1))), (2, agg_packet(1, 1, 0, vals(2))))  # session 1: 2 of 3
    # session 5 reuses slot 0 with another epoch: its first packet starts a new phase
    send(sw, (1, agg_packet(5, 0, 0, vals(10))))
    out = send(sw, (2, agg_packet(5, 1, 0, vals(20))))
    assert lanes_of(out[0][1]) == vals(30)
    sw.tables.insert("sessions", {"session": 1}, "set_session",
                     {**sw.tables.lookup("sessions", {"session": 1})["params"], "epoch": 12}, modify=True)
    send(sw, (1, agg_packet(1, 0, 0, vals(100))), (2, agg_packet(1, 1, 0, vals(100))))
    out = send(sw, (3, agg_packet(1, 2, 0, vals(100))))
    assert lanes_of(out[0][1]) == vals(300)


def test_shadow_set_reuse_across_phases(sw):
    """seq and seq + pool_size share a slot in opposite sets; seq + 2 * pool_size reuses set 0."""
    for seq, k in ((1, 1), (5, 10), (9, 100)):
        outs = [send(sw, (r + 1, agg_packet(1, r, seq, vals(k)))) for r in range(3)]
        assert outs[0] == [] and outs[1] == []
        res = Packet.unpack(outs[2][0][1])
        assert res.slot == 1 and bool(res.flags & Flag.SET) == (seq == 5)
        assert lanes_of(outs[2][0][1]) == vals(3 * k)
    assert sw.registers.bitmap[1] == 7 and sw.registers.bitmap[SLOTS + 1] == 0  # set 1 cleared by seq 9


def test_late_packet_of_old_phase_is_a_duplicate_after_set_switch(sw):
    """Worker 0 moves on to seq 4 (set 1 of slot 0) while others finish seq 0: its bit leaves set 0,
    so its retransmission of seq 0 after completion is not resent but counted as a new bit (the
    protocol's window prevents this; the switch follows the register semantics exactly)."""
    send(sw, (1, agg_packet(1, 0, 0, vals(1))), (2, agg_packet(1, 1, 0, vals(1))))
    send(sw, (1, agg_packet(1, 0, 4, vals(1))))
    assert sw.registers.bitmap[0] == 2 and sw.registers.bitmap[SLOTS] == 1


def test_n_equals_one_completes_at_once(sw):
    out = send(sw, (3, agg_packet(4, 2, 0, vals(4), mtype=MsgType.GRAD)))
    assert [p for p, _ in out] == [NODE_PORT] and lanes_of(out[0][1]) == vals(4)
    again = send(sw, (3, agg_packet(4, 2, 0, vals(4), mtype=MsgType.GRAD)))
    assert Packet.unpack(again[0][1]).flags & Flag.RETX
    assert send(sw, (3, agg_packet(4, 2, 1, vals(4)))) == []  # ALLREDUCE: group 4 has no replicas
    assert dropped(sw, DropReason.NO_ROUTE) == 1


def test_max_op_is_signed(sw):
    a, b, c = [-5, 7, -(2**31), 0, 1, 2, 3, 4], [3, -9, -1, 2**31 - 1, 1, 2, 3, 4], [-7, 6, 5, 4, 3, 2, 1, 0]
    send(sw, (1, agg_packet(1, 0, 2, a, flags=Flag.MAX)), (2, agg_packet(1, 1, 2, b, flags=Flag.MAX)))
    out = send(sw, (3, agg_packet(1, 2, 2, c, flags=Flag.MAX)))
    assert lanes_of(out[0][1]) == np.maximum(np.maximum(a, b), c).tolist()
    assert Packet.unpack(out[0][1]).flags & Flag.MAX


def test_exponent_is_signed_max_and_saturated_ors(sw):
    send(sw, (1, agg_packet(1, 0, 3, vals(1), exponent=-128)), (2, agg_packet(1, 1, 3, vals(1), exponent=-1,
                                                                               flags=Flag.SATURATED)))
    out = send(sw, (3, agg_packet(1, 2, 3, vals(1), exponent=-2)))
    res = Packet.unpack(out[0][1])
    assert res.exponent == -1 and res.flags & Flag.SATURATED
    assert ev(sw, Event.SATURATED) == 1


def test_split_phases_in_consecutive_slots_use_stored_sums(sw):
    """Phases half done in one call and finished in another (the batched fast path with stored lanes)."""
    first = [(1, agg_packet(1, 0, s, vals(s + 1))) for s in range(4)]
    rest = [(r + 1, agg_packet(1, r, s, vals(10 * (s + 1)))) for r in (1, 2) for s in range(4)]
    assert send(sw, *first) == []
    out = send(sw, *rest)
    results = [Packet.unpack(d) for _, d in out]
    assert [p.seq for p in results] == [s for s in range(4) for _ in range(3)]
    for (_, d), p in zip(out, results):
        assert lanes_of(d) == vals(21 * (p.seq + 1))


def test_pool_size_zero_sends_every_grad_to_the_node(sw):
    """protocol.md 4: a session with no slots on this switch (pool_size 0) is all fallback."""
    params = sw.tables.lookup("sessions", {"session": 2})["params"]
    sw.tables.insert("sessions", {"session": 2}, "set_session", {**params, "pool_size": 0}, modify=True)
    for r in range(3):
        out = send(sw, (r + 1, agg_packet(2, r, 0, vals(r + 1), mtype=MsgType.GRAD, slot=4)))
        assert [p for p, _ in out] == [NODE_PORT]
        p = Packet.unpack(out[0][1])
        assert p.flags & Flag.FALLBACK and p.worker == r and lanes_of(out[0][1]) == vals(r + 1)
    assert send(sw, (1, agg_packet(2, 0, 0, vals(1), slot=4))) == []  # ALLREDUCE: dropped
    assert dropped(sw, DropReason.FOREIGN_SLOT) == 1 and ev(sw, Event.FALLBACK) == 3
    assert not sw.registers.slot_owner.any()
