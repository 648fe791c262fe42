"""Receive windows: each sequence number accepted once, ack over the contiguous prefix, wrap-around."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.dataplane.engine.window import RecvWindow


def test_accepts_once_and_advances_over_prefix():
    w = RecvWindow(8)
    assert w.accept(np.array([0, 2, 2, 3])).tolist() == [True, True, False, True]
    assert w.advance() == 1 and w.ack == 1
    assert w.accept(np.array([1, 0])).tolist() == [True, False]  # 0 is below ack now: a duplicate
    assert w.advance() == 3 and w.ack == 4
    assert w.accept(np.array([12])).tolist() == [False]  # beyond the window


def test_wraps_around_32_bits():
    w = RecvWindow(16, start=0xFFFFFFF8)
    seqs = (0xFFFFFFF8 + np.arange(16, dtype=np.int64)) & 0xFFFFFFFF
    assert w.accept(seqs[::-1]).all()
    assert w.advance() == 16
    assert w.ack == 8
    assert w.received(0xFFFFFFFF) and not w.received(9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 63), min_size=1, max_size=300), st.integers(0, 2**32 - 1))
def test_matches_a_set_model(offsets, start):
    """Whatever arrives in whatever order and batching, every distinct seq is accepted exactly once
    and ack is the length of the received prefix (a set model)."""
    w = RecvWindow(64, start=start)
    seen: set[int] = set()
    accepted = 0
    for chunk in [offsets[i:i + 7] for i in range(0, len(offsets), 7)]:
        accepted += int(w.accept((start + np.array(chunk, dtype=np.int64)) & 0xFFFFFFFF).sum())
        w.advance()
        seen |= set(chunk)
        prefix = 0
        while prefix in seen:
            prefix += 1
        assert (w.ack - start) & 0xFFFFFFFF == prefix
    assert accepted == len(seen)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1),
       st.lists(st.tuples(st.integers(-8, 40), st.integers(1, 12), st.sampled_from(["up", "gaps", "down", "twice"])),
                min_size=1, max_size=30))
def test_accept_mask_matches_a_model(start, batches):
    """Batches as the engine meets them: ascending runs (in-order RESULTs, accept's fast path), runs
    with gaps, reversed, repeated, reaching below ack or past the window, across 2^32: the mask is
    True exactly at each seq's first arrival within [ack, ack + size), and ack follows the prefix."""
    size = 32
    w = RecvWindow(size, start=start)
    ack, got = 0, set()  # the model, in offsets from start
    for first, count, shape in batches:
        run = list(range(ack + first, ack + first + count * (2 if shape == "gaps" else 1), 2 if shape == "gaps" else 1))
        offs = {"up": run, "gaps": run, "down": run[::-1], "twice": run + run}[shape]
        want = []
        for o in offs:
            new = ack <= o < ack + size and o not in got
            want.append(new)
            if new:
                got.add(o)
        assert w.accept((start + np.array(offs, dtype=np.int64)) & 0xFFFFFFFF).tolist() == want
        w.advance()
        while ack in got:
            got.discard(ack)
            ack += 1
        assert (w.ack - start) & 0xFFFFFFFF == ack
