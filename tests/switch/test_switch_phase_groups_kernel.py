"""Property test: the compiled aggregation fast path (dataplane/kernels/switch_lanes.py
`phase_groups`) leaves registers, lanes, packet rows and per-packet outcome bit for bit as its
numpy reference (dataplane/switch/fast/aggregate_groups.py `plan` + `apply`) does, on random register
states and batches: groups that qualify, and groups that must be left to the rounds (mixed sets,
epochs or operations, repeated worker bits, bits already in the bitmap, countdowns too short)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luwu.dataplane.kernels import numba_available
from luwu.dataplane.protocol import HEADER_LEN
from luwu.dataplane.switch.batch import write_results
from luwu.dataplane.switch.controls.next_step_selector import AggregationResult
from luwu.dataplane.switch.fast import aggregate_groups
from luwu.dataplane.switch.registers import Registers

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed (the reference runs alone)")

SLOTS, LANES = 4, 5
ROW = HEADER_LEN + 4 * LANES + 12  # rows wider than the lanes, as a receive buffer's are
I32 = st.sampled_from([0, 1, -1, 7, 2**31 - 1, -(2**31), 123456789, -99])


@st.composite
def batches(draw):
    """Aggregation inputs: a few slots, each hit by a phase-like group (mostly distinct ranks of
    one set, epoch and operation), plus strays; random register state."""
    packets = []
    for _ in range(draw(st.integers(1, 4))):
        slot, set_, epoch, mx = draw(st.integers(0, SLOTS - 1)), draw(st.integers(0, 1)), draw(st.integers(1, 2)), \
            draw(st.booleans())
        ranks = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))
        for r in ranks:
            odd = draw(st.integers(0, 12)) == 0  # now and then a packet that breaks the group
            packets.append((slot, draw(st.integers(0, 1)) if odd else set_, draw(st.integers(1, 2)) if odd else epoch,
                            draw(st.booleans()) if odd else mx, 1 << r, draw(st.integers(0, 8)),
                            draw(st.integers(-128, 127)), draw(st.integers(0, 5)) == 0))  # SATURATED: rare
    order = draw(st.permutations(range(len(packets))))
    packets = [packets[i] for i in order]
    n = len(packets)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    regs = Registers(SLOTS, LANES)
    regs.slot_owner[:] = rng.integers(0, 3, 2 * SLOTS)
    regs.bitmap[:] = rng.integers(0, 128, 2 * SLOTS) * rng.integers(0, 2, 2 * SLOTS)
    regs.contributors[:] = rng.integers(0, 9, 2 * SLOTS)
    regs.exponents[:] = rng.integers(-128, 128, 2 * SLOTS)
    regs.slot_flags[:] = rng.integers(0, 2, 2 * SLOTS)
    regs.lanes[:] = np.array(draw(st.lists(I32, min_size=2 * SLOTS * LANES, max_size=2 * SLOTS * LANES)),
                             dtype=np.int64).astype(np.int32).reshape(2 * SLOTS, LANES)
    rows = rng.integers(0, 256, (n + 2, ROW), dtype=np.uint8)
    rows[:, HEADER_LEN:HEADER_LEN + 4 * LANES] = np.array(
        draw(st.lists(I32, min_size=(n + 2) * LANES, max_size=(n + 2) * LANES)),
        dtype=np.int64).astype(">i4").view(np.uint8).reshape(n + 2, 4 * LANES)
    slot = np.array([p[0] for p in packets], dtype=np.int64)
    set_ = np.array([p[1] for p in packets], dtype=np.int64)
    a = types.SimpleNamespace(
        ai=np.array(draw(st.permutations(range(n + 2)))[:n], dtype=np.int64),  # positions in the classified list
        s=set_ * SLOTS + slot, other=(1 - set_) * SLOTS + slot,
        epoch=np.array([p[2] for p in packets], dtype=np.uint32), is_max=np.array([p[3] for p in packets]),
        bit=np.array([p[4] for p in packets], dtype=np.uint32), nw=np.array([p[5] for p in packets], dtype=np.uint32),
        exponent=np.array([p[6] for p in packets], dtype=np.int8),
        saturated=np.array([p[7] for p in packets]),
        rows=np.array(draw(st.permutations(range(n + 2)))[:n], dtype=np.int64))
    return slot, a, regs, rows


def _run(monkeypatch, mode: str, slot, a, regs: Registers, rows: np.ndarray, write_out: bool = True):
    monkeypatch.setenv("LUWU_KERNELS", mode)
    regs = _copy(regs)
    rows = rows.copy()
    agg = AggregationResult(len(a.ai) + 2)
    payload = rows[:, HEADER_LEN:HEADER_LEN + 4 * LANES].view(">i4")
    fast = aggregate_groups.fold(slot, a, regs, payload, agg, write_out=write_out)
    return fast, regs, rows, agg


def _copy(regs: Registers) -> Registers:
    out = Registers(regs.slots, regs.lanes_count)
    for k in ("slot_owner", "bitmap", "contributors", "exponents", "slot_flags", "lanes"):
        getattr(out, k)[:] = getattr(regs, k)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches())
def test_compiled_fast_path_equals_numpy_reference(monkeypatch, batch):
    slot, a, regs, rows = batch
    ref_fast, ref_regs, ref_rows, ref_agg = _run(monkeypatch, "reference", slot, a, regs, rows)
    fast, got_regs, got_rows, got_agg = _run(monkeypatch, "numba", slot, a, regs, rows)
    assert (fast is None) == (ref_fast is None)
    if fast is not None:
        assert fast.tolist() == ref_fast.tolist()
    for k in ("slot_owner", "bitmap", "contributors", "exponents", "slot_flags", "lanes"):
        assert getattr(got_regs, k).tobytes() == getattr(ref_regs, k).tobytes(), k
    assert got_rows.tobytes() == ref_rows.tobytes()
    for k in ("dup", "remaining", "exponent", "saturated"):
        assert getattr(got_agg, k).tolist() == getattr(ref_agg, k).tolist(), k


def test_a_qualifying_group_is_folded_and_completes():
    """The kernel alone on one phase: three distinct workers on an empty slot complete it, the
    last packet's row carrying the sum big-endian (the property test's baseline case)."""
    from luwu.dataplane.kernels.switch_lanes import lane_rows
    from luwu.dataplane.kernels.switch_lanes import phase_groups as kernel

    regs = Registers(SLOTS, LANES)
    rows = np.zeros((3, ROW), dtype=np.uint8)
    lanes = np.arange(3 * LANES, dtype=np.int32).reshape(3, LANES)
    rows[:, HEADER_LEN:HEADER_LEN + 4 * LANES] = lanes.astype(">i4").view(np.uint8)
    n = 3
    fast, last = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    rem, exp, sat = np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.int8), np.zeros(n, dtype=bool)
    z = np.zeros(n, dtype=np.int64)
    handled = kernel(np.arange(n), z, z + 1, z + 1 + SLOTS, np.ones(n, np.uint32), np.zeros(n, bool),
                     np.array([1, 2, 4], np.uint32), np.full(n, 3, np.uint32), np.array([3, -5, 9], np.int8),
                     np.array([False, True, False]), np.arange(n), regs.slot_owner, regs.bitmap, regs.contributors,
                     regs.exponents, regs.slot_flags, regs.lanes.view(np.uint32),
                     *lane_rows(rows[:, HEADER_LEN:HEADER_LEN + 4 * LANES].view(np.uint32)), fast, rem, exp, sat, last,
                     True)
    assert handled == 3 and fast.all() and rem.tolist() == [2, 1, 0] and last.tolist() == [False, False, True]
    assert (exp[2], bool(sat[2])) == (9, True)
    assert regs.lanes[1].tolist() == lanes.sum(axis=0).tolist()
    assert rows[2, HEADER_LEN:HEADER_LEN + 4 * LANES].view(">i4").tolist() == lanes.sum(axis=0).tolist()
    assert (regs.bitmap[1], regs.contributors[1], regs.slot_owner[1]) == (7, 0, 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches(), st.sampled_from(["numba", "reference"]))
def test_deferred_results_are_written_once_where_they_leave(monkeypatch, batch, mode):
    """write_out=False (shared-memory turns, Batch.results): registers and outcome as with
    write_out, no packet row touched, and the completed sums written afterwards from the
    registers (batch.write_results, as emission does into a multicast pool row) give the rows
    write_out gives."""
    slot, a, regs, rows = batch
    want_fast, want_regs, want_rows, want_agg = _run(monkeypatch, mode, slot, a, regs, rows)
    fast, got_regs, got_rows, got_agg = _run(monkeypatch, mode, slot, a, regs, rows, write_out=False)
    assert (fast is None) == (want_fast is None)
    for k in ("slot_owner", "bitmap", "contributors", "exponents", "slot_flags", "lanes"):
        assert getattr(got_regs, k).tobytes() == getattr(want_regs, k).tobytes(), k
    for k in ("dup", "remaining", "exponent", "saturated"):
        assert getattr(got_agg, k).tolist() == getattr(want_agg, k).tolist(), k
    assert got_rows.tobytes() == rows.tobytes()
    if fast is not None:
        done = np.flatnonzero(fast & (got_agg.remaining[a.ai] == 0))
        write_results(got_regs.lanes, a.s[done], got_rows[:, HEADER_LEN:HEADER_LEN + 4 * LANES].view(">i4"),
                      a.rows[done])
    assert got_rows.tobytes() == want_rows.tobytes()


@pytest.mark.parametrize("is_max", [False, True])
@pytest.mark.parametrize("workers", [4, 5, 6, 9])
def test_groups_wider_than_one_pass_fold_exactly(monkeypatch, workers, is_max):
    """The kernel adds up to four rows per pass over the register: groups of 4-9 workers on
    an empty slot complete with the wrapping sum (or the signed maximum) of all their lanes,
    as the reference computes it."""
    rng = np.random.default_rng(workers)
    lanes = rng.integers(-(2**31), 2**31, (workers, LANES), dtype=np.int64).astype(np.int32)
    lanes[0, 0], lanes[1, 0] = 2**31 - 1, 2**31 - 1  # a sum that wraps
    rows = np.zeros((workers, ROW), dtype=np.uint8)
    rows[:, HEADER_LEN:HEADER_LEN + 4 * LANES] = lanes.astype(">i4").view(np.uint8)
    z = np.zeros(workers, dtype=np.int64)
    a = types.SimpleNamespace(ai=np.arange(workers), s=z + 2, other=z + 2 + SLOTS, epoch=np.ones(workers, np.uint32),
                              is_max=np.full(workers, is_max), bit=(1 << np.arange(workers)).astype(np.uint32),
                              nw=np.full(workers, workers, np.uint32), exponent=np.zeros(workers, np.int8),
                              saturated=np.zeros(workers, bool), rows=rng.permutation(workers))
    want = lanes.max(axis=0) if is_max else lanes.astype(np.int64).sum(axis=0).astype(np.uint32).astype(np.int32)
    last = int(a.rows[-1])
    for mode in ("numba", "reference"):
        fast, regs, out, agg = _run(monkeypatch, mode, z + 2, a, Registers(SLOTS, LANES), rows)
        assert fast is not None and fast.all() and agg.remaining[:workers].tolist() == list(range(workers))[::-1]
        assert regs.lanes[2].tolist() == want.tolist(), mode
        assert out[last, HEADER_LEN:HEADER_LEN + 4 * LANES].view(">i4").tolist() == want.tolist(), mode


def test_rows_not_a_whole_number_of_words_apart_run_the_reference(monkeypatch):
    """Frames of an odd width (a raw port's `max_frame`) cannot be strided over as words
    (lane_rows None): the fold runs the numpy reference on them and still completes exactly."""
    from luwu.dataplane.kernels.switch_lanes import lane_rows

    odd = np.zeros((3, ROW + 1), dtype=np.uint8)
    assert lane_rows(odd[:, HEADER_LEN:HEADER_LEN + 4 * LANES].view(np.uint32)) is None
    assert lane_rows(np.zeros((3, ROW), dtype=np.uint8)[:, HEADER_LEN:HEADER_LEN + 4 * LANES].view(np.uint32)) is not None
    monkeypatch.setenv("LUWU_KERNELS", "numba")
    lanes = np.arange(3 * LANES, dtype=np.int32).reshape(3, LANES)
    for i in range(3):
        odd[i, HEADER_LEN:HEADER_LEN + 4 * LANES] = lanes[i].astype(">i4").view(np.uint8)
    z = np.zeros(3, dtype=np.int64)
    a = types.SimpleNamespace(ai=np.arange(3), s=z + 1, other=z + 1 + SLOTS, epoch=np.ones(3, np.uint32),
                              is_max=np.zeros(3, bool), bit=np.array([1, 2, 4], np.uint32), nw=np.full(3, 3, np.uint32),
                              exponent=np.zeros(3, np.int8), saturated=np.zeros(3, bool), rows=np.arange(3))
    regs, agg = Registers(SLOTS, LANES), AggregationResult(3)
    payload = odd[:, HEADER_LEN:HEADER_LEN + 4 * LANES].view(">i4")
    assert aggregate_groups.fold(z + 1, a, regs, payload, agg) is not None
    assert payload[2].tolist() == lanes.sum(axis=0).tolist() == regs.lanes[1].tolist()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches())
def test_groups_qualify_says_whether_every_packet_folds(monkeypatch, batch):
    """`groups_qualify` (fast/aggregate_turn.py's check before it writes anything) is True exactly
    when the fold takes every packet, and it changes no register."""
    from luwu.dataplane.kernels.switch_lanes import groups_qualify

    slot, a, regs, rows = batch
    before = _copy(regs)
    ok = groups_qualify(np.argsort(slot, kind="stable"), slot, a.s, a.epoch, a.is_max, a.bit, a.nw, regs.slot_owner,
                        regs.bitmap, regs.contributors)
    for k in ("slot_owner", "bitmap", "contributors", "exponents", "slot_flags", "lanes"):
        assert getattr(regs, k).tobytes() == getattr(before, k).tobytes(), k
    fast = _run(monkeypatch, "numba", slot, a, regs, rows)[0]
    assert ok == (fast is not None and bool(fast.all()))
