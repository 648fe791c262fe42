"""A shared-memory turn of one heartbeat or PULL takes dataplane/switch/lone.py's path: on random
one- and two-packet turns of every kind that aggregates nothing (ranks' and the node's heartbeats,
PULLs, PARAMs, malformed, spoofed and misrouted packets), a switch taking it gives exactly what a
switch without it gives -- every port's ring contents (bytes and order) turn by turn, then every
counter (per port too), the heartbeat registers and no errors -- and it is taken."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_switch_shm_arena import ShmRig
from test_switch_small_turns import REGISTERS, routed

from luwu.dataplane.net.shm_ring import supported
from luwu.dataplane.switch import lone

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(routed(), min_size=1, max_size=2), min_size=1, max_size=40))
def test_lone_turns_equal_the_general_path(turns):
    fast, general = ShmRig(), ShmRig()
    real_eligible, real_turn = lone.eligible, lone.turn
    taken = []

    def counted(*a):
        ok = real_turn(*a)
        taken.append(ok)
        return ok

    try:
        for items in turns:
            lone.eligible, lone.turn = real_eligible, counted
            got = fast.run_turn(items)
            lone.eligible = lambda *a: False
            want = general.run_turn(items)
            assert got == want, items
    finally:
        lone.eligible, lone.turn = real_eligible, real_turn
        fast_counters, general_counters = fast.sw.counters(), general.sw.counters()
        regs = [(getattr(fast.sw.pipeline.registers, n), getattr(general.sw.pipeline.registers, n)) for n in REGISTERS]
        errors = (fast.sw.errors, general.sw.errors)
        fast.close()
        general.close()
    assert fast_counters == general_counters
    for (a, b), name in zip(regs, REGISTERS):
        assert np.array_equal(a, b), name
    assert errors == (0, 0)
    assert len(taken) == sum(len(items) == 1 for items in turns)  # every one-packet turn asked it


def test_lone_turns_are_taken_for_heartbeats_and_pulls():
    """The path is taken (a rank's PULL and heartbeats, a full round, a PULL through an UPSTREAM
    switch, which speaks as its up_worker), and not for a node's PARAM."""
    from switch_setup import PARENT_PORT, UP_WORKER, heartbeat, param, pull, worker_port

    from luwu.dataplane.protocol import Packet

    rig = ShmRig()
    real_turn = lone.turn
    taken = []

    def counted(*a):
        taken.append(real_turn(*a))
        return taken[-1]

    lone.turn = counted
    try:
        assert len(rig.run_turn([(worker_port(0), pull(2, 0))])[4]) == 1  # session 2's up port: the node's
        for rank in (0, 1):
            rig.run_turn([(worker_port(rank), heartbeat(2, rank, 5, 9))])
        assert len(rig.run_turn([(worker_port(2), heartbeat(2, 2, 5, 9))])[4]) == 1  # the round is full
        rig.run_turn([(4, param(2))])
        up = rig.run_turn([(worker_port(1), pull(3, 1))])[PARENT_PORT]  # session 3 is a ToR's
        assert [Packet.unpack(d).worker for d in up] == [UP_WORKER]
    finally:
        lone.turn = real_turn
        rig.close()
    assert taken == [True, True, True, True, False, True]
