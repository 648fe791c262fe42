"""A shared-memory turn of two or more contributions (`pipeline.AGGREGATE_TURN`) that all fold in one pass
takes dataplane/switch/fast/aggregate_turn.py's path: on random rounds of several sessions' phases
(ALLREDUCEs completed at a root to every worker, GRADs to the node, an UPSTREAM switch's sums to
its parent; phases spread over turns, MAX, SATURATED, ZERO, exponents, FIXED16, sums that wrap) mixed now
and then with what the path declines (duplicates, another epoch on the same slots, a heartbeat,
a spoofed port, a FALLBACK GRAD, a corrupted header, a packet outside the pool), a switch taking
it gives exactly what a switch without it gives -- every port's ring contents (bytes and order),
ring entries (pool references or inline) and pool rows turn by turn, also when the endpoints fall
behind (the multicast pool full, the down rings full), then every counter (per port too),
register and no errors -- and it is taken, and declines what it must. With wider pools a turn's
completions are more copies than fast/emit_shm.py `emit_small` takes: `emit_pooled` emits them into
one multicast pool, side by side with `SoftwareSwitch.emit` (the general switch runs neither)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import test_switch_shm_arena as arena_tests
from switch_setup import LANES, NODE_PORT, PARENT_PORT, SESSIONS, agg_packet, heartbeat, worker_port
from test_switch_lone_turns import drain, pools, rings
from test_switch_small_turns import REGISTERS

from luwu.dataplane.kernels import use_numba
from luwu.dataplane.net.shm_ring import supported
from luwu.dataplane.protocol import Dtype, Flag, MsgType, NextStep
from luwu.dataplane.switch import switch as switch_module
from luwu.dataplane.switch.attach_shm import MulticastPools, shm_row_bytes
from luwu.dataplane.switch.fast import aggregate_turn, emit_shm

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")

RING_SLOTS = 64  # a round's packets of one port (up to 16) and a turn's results fit the rings
ROUND_SESSIONS = (1, 2, 3)  # disjoint pools (slots 0-3, 4-7, 8-15): up to 40 contributions a round


@pytest.fixture(autouse=True)
def _big_rings(monkeypatch):
    monkeypatch.setattr(arena_tests, "RING_SLOTS", RING_SLOTS)


def rig(pool_slots: int | None):
    r = arena_tests.ShmRig()
    r.sw._pools = MulticastPools(shm_row_bytes(r.sw.config.lanes))
    if pool_slots is not None:  # a small multicast pool: endpoints that fall behind fill it
        r.sw._pools.slots = pool_slots
    return r


def contribution(rnd: random.Random, session: int, rank: int, seq: int, phase: dict) -> tuple[int, bytes]:
    """Rank `rank`'s packet of `seq` in `session`, with the phase's operation and dtype (`phase`:
    what every contributor of that phase shares) and its own lanes, exponent and SATURATED."""
    mtype, flags, dtype = phase["mtype"], phase["flags"], phase["dtype"]
    if rnd.random() < 0.1:
        flags |= Flag.SATURATED
    values = [rnd.choice([rnd.randint(-(1 << 31), (1 << 31) - 1), rnd.randint(-9, 9)]) for _ in range(LANES)]
    if dtype == int(Dtype.INT32) and rnd.random() < 0.2:  # a header-only ZERO contribution (INT32 only)
        return worker_port(rank), agg_packet(session, rank, seq, [0] * LANES, mtype=mtype, flags=flags | Flag.ZERO,
                                             exponent=rnd.randint(-4, 4), dtype=dtype)[:32]
    data = agg_packet(session, rank, seq, values, mtype=mtype, flags=flags, exponent=rnd.randint(-4, 4), dtype=dtype)
    return worker_port(rank), data


def rounds(seed: int, n_rounds: int, groups: tuple = (ROUND_SESSIONS,)) -> list[tuple[list, bool]]:
    """Turns of contributions: each round every session's ranks send a window (the pool's size) of
    sequence numbers, some ranks' packets held back to a later turn of the round; now and then a
    turn gets what the fast path must leave to the general one. `groups`: the sessions a round
    may hold (one set drawn per round)."""
    rnd = random.Random(seed)
    turns: list[tuple[list, bool]] = []
    step = dict.fromkeys(SESSIONS, 0)  # each session's rounds so far: its sequence numbers go on from there
    for _ in range(n_rounds):
        sessions = rnd.choice(groups)
        phases = {}
        for sid in sessions:
            mtype = MsgType.GRAD if sid == 2 and rnd.random() < 0.5 else MsgType.ALLREDUCE
            flags = Flag.MAX if rnd.random() < 0.15 else 0
            dtype = rnd.choice([int(Dtype.FIXED32)] * 3 + [int(Dtype.INT32), int(Dtype.FIXED16)])
            phases[sid] = {"mtype": mtype, "flags": int(flags), "dtype": dtype}
        now, later = [], []
        for sid in sessions:
            _, size, ranks, *_ = SESSIONS[sid]
            k = step[sid]
            step[sid] += 1
            for rank in ranks:
                items = [contribution(rnd, sid, rank, k * size + j, phases[sid]) for j in range(size)]
                (later if rnd.random() < 0.3 else now).extend(items)
        for items in (now, later):
            if not items:
                continue
            by_port: dict[int, list] = {}
            for port, data in items:
                by_port.setdefault(port, []).append((port, data))
            turn = [it for p in rnd.sample(sorted(by_port), len(by_port)) for it in by_port[p]]
            spoil = rnd.random()
            if spoil < 0.06:  # a resent packet: a duplicate
                turn.append(rnd.choice(turn))
            elif spoil < 0.1:  # a heartbeat among the contributions
                turn.append((worker_port(0), heartbeat(1, 0, 5, 9)))
            elif spoil < 0.13:  # a packet off its rank's port (SPOOFED)
                port, data = turn[0]
                turn[0] = (worker_port(2) if port != worker_port(2) else worker_port(0), data)
            elif spoil < 0.16:  # a corrupted header (BAD_CHECKSUM)
                port, data = turn[-1]
                turn[-1] = (port, data[:6] + bytes([data[6] ^ 1]) + data[7:])
            elif spoil < 0.19:  # session 5's ranks on session 1's slots, another epoch
                turn.append(contribution(rnd, 5, 0, k * 4, {"mtype": MsgType.ALLREDUCE, "flags": 0, "dtype": 4}))
            elif spoil < 0.22:  # a GRAD already marked FALLBACK
                turn.append(contribution(rnd, 2, 1, k * 4 + 1, {"mtype": MsgType.GRAD, "flags": int(Flag.FALLBACK),
                                                               "dtype": 4}))
            elif spoil < 0.25:  # an ALLREDUCE outside its session's pool (FOREIGN_SLOT)
                port, _ = turn[0]
                rank = port - 1
                turn.append((port, agg_packet(1, rank, 0, [1] * LANES, slot=20, dtype=4)))
            # the rings' rows hold a port's 16 packets; a turn takes at most 64 rows
            turns.append((turn, rnd.random() < 0.8))
    return turns


def side_by_side(turns: list[tuple[list, bool]], pool_slots: int | None = None) -> list[bool]:
    """Run `turns` ((items, whether the endpoints read after it)) on two switches, one taking the
    fast path and one never, checking that they stay alike (outputs, pools and rings every turn;
    then what is left unread, counters, registers, errors). Returns whether each turn took it."""
    fast, general = rig(pool_slots), rig(pool_slots)
    real, real_pooled = aggregate_turn.run, switch_module.emit_pooled
    taken: list[bool] = []

    def counted(*a):  # (asked for a turn of 2+ packets: pipeline.AGGREGATE_TURN)
        em = real(*a)
        taken[-1] = taken[-1] or em is not None
        return em

    try:
        for items, read in turns:
            taken.append(False)
            aggregate_turn.run, switch_module.emit_pooled = counted, real_pooled
            got = fast.run_turn(items, read=read)
            aggregate_turn.run, switch_module.emit_pooled = (lambda *a: None), (lambda *a: False)
            want = general.run_turn(items, read=read)
            assert got == want, items
            assert pools(fast) == pools(general), items
            assert rings(fast) == rings(general), items
        assert drain(fast) == drain(general)
    finally:
        aggregate_turn.run, switch_module.emit_pooled = real, real_pooled
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


@pytest.mark.parametrize("seed", range(6))
def test_aggregate_turns_equal_the_general_path(seed):
    turns = rounds(seed, 12)
    taken = side_by_side(turns, pool_slots=None if seed % 2 else 2)
    big = [len(items) > 16 for items, _ in turns]
    assert sum(taken) >= sum(big) // 2 or not use_numba()  # most big turns are clean rounds (kernels off: none)
    assert not any(t and len(items) < 2 for t, (items, _) in zip(taken, turns))  # never a lone packet


# wider pools on the same 32 slots: a round's completions are more copies than emit_small takes
# (up to 16 slots x 3 workers), which fast/emit_shm.py `emit_pooled` puts into one multicast pool
WIDE = {1: (0, 16, (0, 1, 2), 11, NextStep.ROOT, 0, 1), 2: (16, 8, (0, 1, 2), 22, NextStep.ROOT, NODE_PORT, 2),
        3: (24, 8, (0, 1), 33, NextStep.UPSTREAM, PARENT_PORT, 3)}


@pytest.mark.parametrize("seed", range(4))
def test_wide_rounds_equal_the_general_path(seed, monkeypatch):
    import switch_setup

    for sid, row in WIDE.items():
        monkeypatch.setitem(switch_setup.SESSIONS, sid, row)
    turns = rounds(100 + seed, 10, groups=((1,), (2, 3), (1,)))
    real = emit_shm.emit_pooled
    pooled = []

    def counted(*a):
        pooled.append(real(*a))
        return pooled[-1]

    taken = side_by_side_pooled(turns, counted, pool_slots=None if seed % 2 else 64)
    assert sum(taken) >= len(turns) // 3 or not use_numba()
    assert any(pooled)  # (the pooled emission needs no kernels)


def side_by_side_pooled(turns, counted, pool_slots):
    """`side_by_side` with the fast switch's emission through `counted` (emit_pooled, counting)."""
    real = switch_module.emit_pooled
    switch_module.emit_pooled = counted
    try:
        return side_by_side(turns, pool_slots)
    finally:
        switch_module.emit_pooled = real


def test_taken_and_declined():
    """A clean round of 40 contributions is taken (absorbed, then completed); the same round with a
    duplicate, a heartbeat or a foreign slot in it is not; a turn of 16 packets is taken as well."""
    def clean(k: int, sessions=ROUND_SESSIONS) -> list:
        rnd = random.Random(k)
        phase = {"mtype": MsgType.ALLREDUCE, "flags": 0, "dtype": 4}
        return [contribution(rnd, sid, rank, k * SESSIONS[sid][1] + j, phase)
                for sid in sessions for rank in SESSIONS[sid][2] for j in range(SESSIONS[sid][1])]

    first = clean(0)
    half = [it for it in first if it[0] != worker_port(2)]  # rank 2's share in a later turn
    rest = [it for it in first if it[0] == worker_port(2)]
    turns = [(half, True), (rest + clean(1, (3,)), True),  # 32 contributions, then 8 + 16 completing
             (clean(1, (1, 2)) + [clean(1, (1,))[0]], True),  # a duplicate
             (clean(2) + [(worker_port(0), heartbeat(1, 0, 5, 9))], True),
             (clean(3) + [(worker_port(1), agg_packet(1, 1, 0, [1] * LANES, slot=20, dtype=4))], True),
             (clean(4, (3,)), True),  # 16 packets: a small turn, taken too
             (clean(4, (1, 2)) + clean(5, (3,)), True)]
    assert side_by_side(turns) == [use_numba() and x for x in (True, True, False, False, False, True, True)]


def test_header_check_kernel_equals_integrity():
    """kernels.switch_lanes.headers_all_ok (the path's header check) says what integrity.headers_ok
    says of every row: sealed rows pass, a row with any one bit flipped fails."""
    pytest.importorskip("numba")
    from luwu.dataplane.integrity import headers_ok, seal_headers
    from luwu.dataplane.kernels.switch_lanes import headers_all_ok
    from luwu.dataplane.protocol import HCHECK_OFFSET

    rng = np.random.default_rng(3)
    rows = rng.integers(0, 256, (40, 64), dtype=np.uint8)
    seal_headers(rows)
    assert headers_ok(rows[:, :32]).all()
    assert headers_all_ok(rows, aggregate_turn._HCHECK, HCHECK_OFFSET)
    for _ in range(200):
        bad = rows.copy()
        r, byte, bit = int(rng.integers(0, 40)), int(rng.integers(0, 32)), int(rng.integers(0, 8))
        bad[r, byte] ^= 1 << bit
        assert not headers_ok(bad[:, :32]).all()
        assert not headers_all_ok(bad, aggregate_turn._HCHECK, HCHECK_OFFSET)
    assert headers_all_ok(rows[:0], aggregate_turn._HCHECK, HCHECK_OFFSET)


def test_short_contributions_in_turns(monkeypatch):
    """Short contributions (docs/protocol.md 3.3, the workers' exponent-agreement rows) on a wider
    switch whose rings' rows hold other packets' lanes first: whole phases of session 1 in one turn
    (every rank's packets of four slots), each dtype and MAX, their lanes past each packet's end
    summed as zeros (zero_lanes._pad_short), as the general path has it -- and taken."""
    from switch_setup import runtime
    from test_switch_short_packets import LANES as WIDE_LANES
    from test_switch_short_packets import contribution as lanes_of
    from test_switch_short_packets import packet

    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

    def wide_switch() -> SoftwareSwitch:
        sw = SoftwareSwitch(SwitchConfig(lanes=WIDE_LANES, slots=arena_tests.SLOTS, seed=1))
        sw.load_runtime(runtime())
        return sw

    monkeypatch.setattr(arena_tests, "make_switch", wide_switch)
    rng = np.random.default_rng(11)
    # every ring's rows first hold full packets (session 3 phases that rank 2 is not part of: dropped)
    dirty = [([(worker_port(r), agg_packet(3, r, 16 * k + j, rng.integers(-99, 99, size=WIDE_LANES),
                                           lanes=WIDE_LANES, dtype=0)) for r in (0, 1, 2) for j in range(16)], True)
             for k in range(RING_SLOTS // 16)]
    turns = []
    for k, (count, dtype, flags) in enumerate([(10, Dtype.FIXED32, 0), (190, Dtype.INT32, 0), (30, Dtype.FIXED16, 0),
                                               (40, Dtype.INT32, int(Flag.MAX)), (7, Dtype.FIXED32, 0)]):
        turn = [(worker_port(r), packet(r, 4 * k + j, count, lanes_of(rng, count, dtype, flags), dtype=dtype,
                                        flags=flags)) for j in range(4) for r in (0, 1, 2)]
        turns.append((turn, k != 2))
    taken = side_by_side([*dirty, *turns])
    assert taken[len(dirty):] == [use_numba()] * len(turns)


def test_a_turn_of_more_keys_than_kept_is_declined(monkeypatch):
    """More distinct header keys than `MAX_KEYS` (kernels.switch_lanes.scan_turn stops): the turn
    goes the general way, with the same outcome; within the bound it is taken."""
    rnd = random.Random(5)
    phase = {"mtype": MsgType.ALLREDUCE, "flags": 0, "dtype": 4}
    rounds_ = [[contribution(rnd, 1, rank, k * 4 + j, phase) for rank in (0, 1, 2) for j in range(4)] for k in range(2)]
    keys = len({(port, data[:8], len(data)) for port, data in rounds_[0]})  # (a key: port, header bytes 0-7, length)
    assert keys >= 3  # three ranks at least
    monkeypatch.setattr(aggregate_turn, "MAX_KEYS", keys - 1)
    assert side_by_side([(rounds_[0], True)]) == [False]
    monkeypatch.setattr(aggregate_turn, "MAX_KEYS", keys)
    assert side_by_side([(rounds_[0], True)]) == [use_numba()]


def test_zero_contributions_in_turns():
    """Header-only ZERO contributions (docs/protocol.md 3.2) stand for zero lanes whatever their ring
    rows held: every ring's rows first hold full packets, then a turn has rank 0's whole window as
    ZERO packets (its rows keep the old lanes) beside ranks 1 and 2's full ones, completing four
    slots of session 1; taken, and equal to the general path (sums, lengths, flags)."""
    rnd = random.Random(9)
    phase = {"mtype": MsgType.GRAD, "flags": 0, "dtype": 4}
    dirty = [([contribution(rnd, 2, r, k * 4 + j, phase) for r in (0, 1, 2) for j in range(4)], True)
             for k in range(RING_SLOTS // 4)]  # (session 2's GRADs: every row of every worker's ring)
    zero = [(worker_port(0), agg_packet(1, 0, j, [0] * LANES, flags=Flag.ZERO, dtype=0, exponent=1)[:32])
            for j in range(4)]
    full = [(worker_port(r), agg_packet(1, r, j, [rnd.randint(-(1 << 31), (1 << 31) - 1) for _ in range(LANES)],
                                        dtype=0, exponent=-r)) for r in (1, 2) for j in range(4)]
    assert side_by_side([*dirty, (zero + full, True)])[-1] == use_numba()
