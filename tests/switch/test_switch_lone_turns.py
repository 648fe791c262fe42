"""A shared-memory turn of one packet takes dataplane/switch/fast/forward_one.py's path (a packet that
aggregates nothing) or fast/aggregate_one.py's (a contribution): on random one- and two-packet turns of
every kind (ranks' and the node's heartbeats, PULLs, PARAMs, malformed, spoofed and misrouted
packets; ranks' GRADs and ALLREDUCEs in and out of the pool, FALLBACK, MAX, ZERO, SATURATED,
duplicates, at a root and through an UPSTREAM switch), a switch taking it gives exactly what a
switch without it gives -- every port's ring contents (bytes and order), ring entries (pool
references or inline) and pool rows turn by turn, also when the endpoints fall behind (the
multicast pool full, the down rings full), then every counter (per port too), straggler record,
register and no errors -- and it is taken."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switch_setup import LANES, SESSIONS, SLOTS, agg_packet, worker_port
from test_switch_shm_arena import RING_SLOTS, ShmRig
from test_switch_small_turns import REGISTERS, routed

from luwu.dataplane.net.shm_ring import H_HEAD, supported
from luwu.dataplane.protocol import Flag, MsgType
from luwu.dataplane.switch.attach_shm import MulticastPools, shm_row_bytes
from luwu.dataplane.switch.fast import aggregate_one, forward_one
from luwu.dataplane.switch.stragglers import Stragglers

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")

POOL_SLOTS = 2  # a small multicast pool: endpoints that fall behind fill it (the copies go inline)


def small_pool_rig() -> ShmRig:
    """A test rig with a small multicast pool, keeping straggler records on a clock of its own
    that ticks per reading (two rigs that make the same records get the same lags)."""
    rig = ShmRig()
    rig.sw._pools = MulticastPools(shm_row_bytes(LANES))
    rig.sw._pools.slots = POOL_SLOTS
    ticks = iter(range(1 << 30))
    rig.sw.pipeline.stragglers = Stragglers(SLOTS, clock=lambda: 0.001 * next(ticks))
    return rig


@st.composite
def contribution(draw):
    """A rank's GRAD or ALLREDUCE (in its session's pool or not: slot 30), any lanes (sums wrap),
    any exponent, now and then FALLBACK, MAX, SATURATED or ZERO (header-only), sent again at times
    (a duplicate) and now and then from another rank's port (spoofed)."""
    session = draw(st.sampled_from([1, 2, 3, 5, 6]))
    rank = draw(st.sampled_from(SESSIONS[session][2]))
    mtype = draw(st.sampled_from([MsgType.GRAD, MsgType.ALLREDUCE]))
    flags = draw(st.sampled_from([0, 0, 0, Flag.FALLBACK, Flag.MAX, Flag.SATURATED, Flag.ZERO]))
    values = draw(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=LANES, max_size=LANES))
    data = agg_packet(session, rank, draw(st.integers(0, 2)), values, mtype=mtype, flags=flags,
                      exponent=draw(st.integers(-4, 4)), slot=draw(st.sampled_from([None] * 6 + [30])), dtype=0)
    port = worker_port(rank) if draw(st.integers(0, 15)) else draw(st.integers(0, 5))
    return (port, data[:32] if flags == Flag.ZERO else data)


def drain(rig: ShmRig) -> dict[int, list[bytes]]:
    """What every port's endpoint has not read yet."""
    out = {}
    for p, ep in rig.ep.items():
        got = []
        while k := ep.recv():
            got += [ep.rx[i, :ep.rx_len[i]].tobytes() for i in range(k)]
        out[p] = got
    return out


def pools(rig: ShmRig) -> dict[tuple[int, ...], tuple[int, int]]:
    """Each multicast pool's rows ever written and rows freed."""
    return {ports: (pool.head, pool.tail) for ports, pool in rig.sw._pools._pools.items()}


def rings(rig: ShmRig) -> dict[int, tuple[int, list[int]]]:
    """Each down ring's head and its entries' length words (the REF bit says a pool reference)."""
    return {p: (int(att.tx.h[H_HEAD]), att.tx.lengths.tolist()) for p, att in rig.sw.ports.items()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(routed(), min_size=1, max_size=2), st.sampled_from([True] * 3 + [False])),
                min_size=1, max_size=40))
def test_lone_turns_equal_the_general_path(turns):
    taken = side_by_side(turns)
    assert len(taken) == sum(len(items) == 1 for items, _ in turns)  # every one-packet turn asked it


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(st.one_of(contribution(), contribution(), routed()), min_size=1, max_size=2),
                          st.sampled_from([True] * 3 + [False])), min_size=1, max_size=40))
def test_lone_contributions_equal_the_general_path(turns):
    taken = side_by_side(turns)
    assert len(taken) == sum(len(items) == 1 for items, _ in turns)


def test_lone_contributions_are_taken():
    """Every rank's ALLREDUCE to a slot (the last one's sum to every worker through the pool), a
    GRAD (its sum to the node), an UPSTREAM switch's (to the parent) take aggregate_one's path; a
    duplicate and a FALLBACK GRAD do not."""
    from switch_setup import NODE_PORT, PARENT_PORT

    rig = small_pool_rig()
    real = aggregate_one.turn
    taken = []

    def counted(*a):
        taken.append(real(*a))
        return taken[-1]

    aggregate_one.turn = counted
    try:
        for rank in (0, 1):
            out = rig.run_turn([(worker_port(rank), agg_packet(5, rank, 1, [rank + 1] * LANES, dtype=0))])
        assert [len(out[worker_port(r)]) for r in (0, 1, 2)] == [1, 1, 1]
        assert rig.run_turn([(worker_port(0), agg_packet(5, 0, 1, [1] * LANES, dtype=0))])[1]  # resent: general
        for rank in (0, 1, 2):
            out = rig.run_turn([(worker_port(rank), agg_packet(2, rank, 2, [3] * LANES, mtype=MsgType.GRAD, dtype=0))])
        assert len(out[NODE_PORT]) == 1
        rig.run_turn([(worker_port(0), agg_packet(2, 0, 3, [3] * LANES, mtype=MsgType.GRAD, flags=Flag.FALLBACK))])
        for rank in (0, 1):
            out = rig.run_turn([(worker_port(rank), agg_packet(3, rank, 0, [5] * LANES, dtype=0))])
        assert len(out[PARENT_PORT]) == 1
    finally:
        aggregate_one.turn = real
        rig.close()
    assert taken == [True, True, False, True, True, True, False, True, True]


def test_lone_completions_equal_the_general_path():
    """Phases completed on the lone path: exponents and SATURATED merged into the emitted header,
    MAX phases, flags kept or cleared, sums wrapping, to a pool that fills while the workers do not
    read (the sums then go inline), to the node and to a parent switch."""
    big = (1 << 31) - 5

    def ar(session, rank, seq, v, **kw):
        return [(worker_port(rank), agg_packet(session, rank, seq, [v + j for j in range(LANES)], dtype=0, **kw))]

    turns = []
    for seq in range(4):  # session 5: ranks 0 and 1, each phase to every worker (ports 1-3)
        turns += [(ar(5, 0, seq, big, exponent=3, flags=Flag.SATURATED if seq == 1 else 0), False),
                  (ar(5, 1, seq, 7 * seq, exponent=seq - 2), seq == 3)]
    turns += [(ar(5, r, 4, -r * 1000, flags=Flag.MAX, exponent=r), True) for r in (0, 1)]
    turns += [(ar(2, r, 0, big, mtype=MsgType.GRAD, exponent=-r, flags=Flag.SATURATED if r == 2 else 0), True)
              for r in (0, 1, 2)]
    turns += [(ar(3, r, 1, r, exponent=r), True) for r in (0, 1)]
    odd = Flag.RETX | Flag.FALLBACK | Flag.GAP | Flag.SET  # (emitted: SET and what the phase merged)
    turns += [(ar(5, r, 5, r, flags=odd if r else Flag.SET), True) for r in (0, 1)]
    assert side_by_side(turns) == [True] * len(turns)


def test_lone_path_takes_zero_contributions():
    """A header-only ZERO contribution's lanes are zeros (zero_lanes), whatever its ring row held
    before: rank 0's ring is first filled with full packets (GRADs of a phase no one completes);
    the lone path takes it, the completion it then meets and one it completes itself (to every
    worker, then a GRAD's to the node), as the general path does them."""
    dirty = [([(worker_port(0), agg_packet(2, 0, 0, [99] * LANES, mtype=MsgType.GRAD, dtype=0))], True)] * RING_SLOTS
    zero = agg_packet(5, 0, 1, [0] * LANES, flags=Flag.ZERO, dtype=0)[:32]
    full = agg_packet(5, 1, 1, [4] * LANES, dtype=0)
    last = [([(worker_port(1), agg_packet(5, 1, 2, [-7] * LANES, dtype=0))], True),
            ([(worker_port(0), agg_packet(5, 0, 2, [0] * LANES, flags=Flag.ZERO, dtype=0)[:32])], True)]
    grads = [([(worker_port(r), agg_packet(2, r, 1, [r] * LANES, mtype=MsgType.GRAD, dtype=0,
                                           flags=Flag.ZERO if r == 2 else 0)[:32 if r == 2 else None])], True)
             for r in (0, 1, 2)]
    taken = side_by_side([*dirty, ([(worker_port(0), zero)], True), ([(worker_port(1), full)], True), *last, *grads])
    assert taken[RING_SLOTS:] == [True] * 7


def test_lone_multicasts_to_endpoints_that_stop_reading():
    """The node's PARAMs and heartbeats while the workers read nothing: the pool fills (copies go
    inline), then the down rings (copies lost, counted); all as the general path has it."""
    from switch_setup import NODE_PORT, heartbeat, param

    from luwu.dataplane.protocol import NODE

    burst = [([(NODE_PORT, param(2, count=k % 5, worker=NODE))], False) for k in range(12)]
    burst += [([(NODE_PORT, heartbeat(2, NODE, 5, k))], False) for k in range(12)]
    assert side_by_side([*burst, *burst[:3], ([(NODE_PORT, param(2, worker=NODE))], True), *burst[:5]]) == [True] * 33


def side_by_side(turns: list[tuple[list, bool]]) -> list[bool]:
    """Run `turns` ((items, whether the endpoints read after it)) on two switches, one taking lone
    turns and one never, checking that they stay alike (outputs, pools and rings every turn; then
    what is left unread, counters, registers, errors). Returns what each lone turn said."""
    fast, general = small_pool_rig(), small_pool_rig()
    real_eligible, real_turn, real_agg = forward_one.eligible, forward_one.turn, aggregate_one.turn
    taken: list[bool] = []  # per turn that asked: whether forward_one.py or aggregate_one.py took it

    def counted(*a):
        ok = real_turn(*a)
        taken.append(ok)
        return ok

    def counted_agg(*a):  # (asked after forward_one.turn said False)
        taken[-1] = real_agg(*a)
        return taken[-1]

    aggregate_one.turn = counted_agg
    try:
        for items, read in turns:  # (not read: the endpoints fall behind, a later turn reads it all)
            forward_one.eligible, forward_one.turn = real_eligible, counted
            got = fast.run_turn(items, read=read)
            forward_one.eligible = lambda *a: False
            want = general.run_turn(items, read=read)
            assert got == want, items
            assert pools(fast) == pools(general), items  # the same copies by reference, the same freed
            assert rings(fast) == rings(general), items  # the same entries: references or inline, lengths
        assert drain(fast) == drain(general)
    finally:
        forward_one.eligible, forward_one.turn, aggregate_one.turn = real_eligible, real_turn, real_agg
        fast_counters, general_counters = fast.sw.counters(), general.sw.counters()
        regs = [(getattr(fast.sw.pipeline.registers, n), getattr(general.sw.pipeline.registers, n)) for n in REGISTERS]
        errors = (fast.sw.errors, general.sw.errors)
        fast.close()
        general.close()
    assert fast_counters == general_counters
    for (a, b), name in zip(regs, REGISTERS):
        assert np.array_equal(a, b), name
    assert errors == (0, 0)
    return taken


def test_lone_turns_are_taken_for_heartbeats_and_pulls():
    """The path is taken (a rank's PULL and heartbeats, a full round, the node's PARAM and
    heartbeat to every worker, a PULL through an UPSTREAM switch, which speaks as its up_worker),
    and not for a multicast group without replicas (dropped the general way)."""
    from switch_setup import NODE_PORT, PARENT_PORT, UP_WORKER, heartbeat, param, pull, worker_port

    from luwu.dataplane.protocol import NODE, DropReason, Packet

    rig = ShmRig()
    real_turn = forward_one.turn
    taken = []

    def counted(*a):
        taken.append(real_turn(*a))
        return taken[-1]

    forward_one.turn = counted
    try:
        assert len(rig.run_turn([(worker_port(0), pull(2, 0))])[4]) == 1  # session 2's up port: the node's
        for rank in (0, 1):
            rig.run_turn([(worker_port(rank), heartbeat(2, rank, 5, 9))])
        assert len(rig.run_turn([(worker_port(2), heartbeat(2, 2, 5, 9))])[4]) == 1  # the round is full
        for data in (param(2, worker=NODE), heartbeat(2, NODE, 5, 9)):  # to every worker of session 2
            got = rig.run_turn([(NODE_PORT, data)])
            assert [got[worker_port(r)] for r in (0, 1, 2)] == [[data]] * 3
        up = rig.run_turn([(worker_port(1), pull(3, 1))])[PARENT_PORT]  # session 3 is a ToR's
        assert [Packet.unpack(d).worker for d in up] == [UP_WORKER]
        assert not any(rig.run_turn([(NODE_PORT, param(4, worker=NODE))]).values())  # group 4: no replicas
    finally:
        forward_one.turn = real_turn
        counters = rig.sw.counters()
        rig.close()
    assert taken == [True, True, True, True, True, True, True, False]
    assert counters["drops"][int(DropReason.NO_ROUTE)] == (1, len(param(4, worker=NODE)))


def test_lone_short_contributions_equal_the_general_path(monkeypatch):
    """Short contributions (docs/protocol.md 3.3: fewer lanes than the switch's, as the workers'
    exponent-agreement rows are) take the lone path on a 200-lane switch whose rings' rows hold
    other packets' lanes first (the lanes past a short packet's end must sum as zeros): ALLREDUCE
    phases of session 1 (each sum to every worker), MAX, FIXED16, and GRADs of session 2 (to the
    node), each equal to the general path's outcome; a wrong length is left to the general path."""
    import test_switch_shm_arena as arena_tests
    from switch_setup import runtime
    from test_switch_short_packets import LANES as WIDE
    from test_switch_short_packets import contribution, packet

    from luwu.dataplane.integrity import wire_lanes
    from luwu.dataplane.protocol import Dtype, Packet, slot_for
    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

    def wide_switch() -> SoftwareSwitch:
        sw = SoftwareSwitch(SwitchConfig(lanes=WIDE, slots=SLOTS, seed=1))
        sw.load_runtime(runtime())
        return sw

    monkeypatch.setattr(arena_tests, "make_switch", wide_switch)
    rng = np.random.default_rng(7)
    # every ring's rows first hold full packets of session 3 phases no one completes (one rank each)
    dirty = [([(worker_port(r), agg_packet(3, r, 7 - r, rng.integers(-99, 99, size=WIDE), lanes=WIDE, dtype=0))], True)
             for r in (0, 1, 2) for _ in range(RING_SLOTS)]
    turns = []
    for seq, (count, dtype, flags) in enumerate([(10, Dtype.FIXED32, 0), (190, Dtype.INT32, 0),
                                                 (30, Dtype.FIXED16, 0), (40, Dtype.INT32, int(Flag.MAX))]):
        for r in (0, 1, 2):
            turns.append(([(worker_port(r), packet(r, seq, count, contribution(rng, count, dtype, flags),
                                                   dtype=dtype, flags=flags))], seq != 1))
    for r in (0, 1, 2):  # GRADs of session 2: the sum to the node
        slot, set_ = slot_for(1, 4, 4)
        body = contribution(rng, 10).astype(">i4").tobytes()
        turns.append(([(worker_port(r), Packet(MsgType.GRAD, 2, r, Flag.SET if set_ else 0, 10, 1, slot, 9, 0, 0,
                                               int(Dtype.FIXED32), 1000, payload=body).pack())], True))
    bad = packet(0, 5, 10, contribution(rng, 10)[:wire_lanes(10, int(Dtype.FIXED32), 0, WIDE) // 2])
    taken = side_by_side([*dirty, *turns, ([(worker_port(0), bad)], True)])
    assert taken[len(dirty):] == [True] * len(turns) + [False]
