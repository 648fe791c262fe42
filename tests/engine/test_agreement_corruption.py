"""A float sum whose exponent agreement comes back corrupt (a contribution's exponent lane
flipped before the switch: the MAX keeps the corrupted lane, whose tag then fails,
docs/protocol.md 3.8) takes the exact path as a whole -- NaN + saturated on every worker -- and,
above all, leaves the engine usable: the op's data is still sent, so the data session's sequence
range reserved for it is filled and the next allreduce completes. Before the fix the op failed
and its reserved range was never sent, which hung every later op of the engine (found by the
bit-flipping soak, tests/integration/integrity_soak.py)."""

from __future__ import annotations

import numpy as np

from luwu.dataplane.integrity import headers_ok, seal_headers
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.loopback.plan import META_SESSION
from luwu.dataplane.protocol import HEADER_LEN, Dtype, Flag, MsgType

DATA = 64 - 2  # tofino mode: data lanes per packet


def _corrupt_first_exponent(rows: np.ndarray, n: int, budget: list[int]) -> None:
    """Raise lane 0 (an exponent lane) by a flipped high bit in the first `budget[0]` meta-session MAX
    contributions, header check sealed again: the corrupted lane wins the MAX, its tag fails."""
    for i in range(n):
        h = rows[i:i + 1, :HEADER_LEN]
        if (budget[0] and rows[i, 0] & 0xF == MsgType.ALLREDUCE and rows[i, 1] & Flag.MAX
                and int.from_bytes(bytes(rows[i, 2:4]), "big") == META_SESSION and rows[i, 25] == Dtype.INT32
                and headers_ok(h).all()):
            rows[i, HEADER_LEN] ^= 0x80 if rows[i, HEADER_LEN] & 0x80 else 0x20  # up, whatever the sign: it wins
            seal_headers(h)
            budget[0] -= 1


def test_a_corrupt_exponent_agreement_takes_the_exact_path_and_the_next_op_completes():
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(3 * DATA + 7).astype(np.float32) for _ in range(2)]
    ys = [rng.standard_normal(2 * DATA + 1).astype(np.float32) for _ in range(2)]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        turn = sw.handle_turn
        budget = [1]

        def corrupting_turn(rx, segments):
            _corrupt_first_exponent(rx.turn_rows(rx.filled), rx.filled, budget)
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn
        first = [e.allreduce(x) for e, x in zip(engines, xs)]
        second = [e.allreduce(y) for e, y in zip(engines, ys)]  # queued behind the first, as DDP buckets are
        r1 = [h.wait(60) for h in first]
        r2 = [h.wait(60) for h in second]  # before the fix: TimeoutError, the engine hung
    assert budget == [0], "the test corrupted nothing"
    for h, r in zip(first, r1):
        assert h.saturated and np.isnan(r).all(), "a corrupt agreement gives the exact path for the whole op"
    exact = (ys[0].astype(np.float64) + ys[1]).astype(np.float32)
    for h, r in zip(second, r2):
        assert not h.saturated
        np.testing.assert_allclose(r, exact, rtol=1e-5, atol=1e-5)


def test_in_place_keeps_every_input_for_the_exact_path():
    """out=x: the decode overwrites x, so the inputs of every chunk are kept for the backend's
    exact recomputation (handle.info["kept"], worker/backend/fallback.py)."""
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(2 * DATA + 3).astype(np.float32) for _ in range(2)]
    orig = [x.copy() for x in xs]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        turn = sw.handle_turn
        budget = [1]

        def corrupting_turn(rx, segments):
            _corrupt_first_exponent(rx.turn_rows(rx.filled), rx.filled, budget)
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn
        handles = [e.allreduce(x, out=x) for e, x in zip(engines, xs)]
        for h in handles:
            h.wait(60)
    assert budget == [0]
    for h, x, o in zip(handles, xs, orig):
        assert h.saturated and np.isnan(x).all()
        np.testing.assert_array_equal(h.info["kept"], o)


def test_a_push_whose_agreement_is_corrupt_is_rejected_by_the_node_and_the_next_push_completes():
    """The same for a push: its GRADs go out as zeros flagged SATURATED, so the node's sum of the
    layer is non-finite (rejected, the step skipped) and the worker's later pushes and pulls go
    on. Before the fix the push failed and its reserved GRAD range blocked the stream: a hang."""
    from node_star import node_star

    from luwu.dataplane.loopback import StarPlan
    from luwu.mininet.paramstore import SgdParamStore

    rng = np.random.default_rng(7)
    layers = {5: rng.standard_normal(3 * DATA + 4).astype(np.float32), 6: rng.standard_normal(40).astype(np.float32)}
    grads = [{t: (rng.standard_normal(p.size) * 0.01).astype(np.float32) for t, p in layers.items()} for _ in range(2)]
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64, transport="udp")
    server = SgdParamStore(layers, lr=0.5)
    sid = plan.node_session(0)
    with node_star(plan, server) as star:
        sw = star.switch._sw
        turn = sw.handle_turn
        budget = [1]

        def corrupting_turn(rx, segments):
            _corrupt_first_exponent(rx.turn_rows(rx.filled), rx.filled, budget)
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn
        first = [e.push(sid, 5, grads[r][5]) for r, e in enumerate(star.engines)]
        second = [e.push(sid, 6, grads[r][6]) for r, e in enumerate(star.engines)]
        for h in first + second:
            h.wait(60)  # before the fix: CorruptResult, then a TimeoutError
        pulled5 = [e.pull(sid, 5, 1).wait(60) for e in star.engines]
        pulled6 = [e.pull(sid, 6, 1).wait(60) for e in star.engines]
        stats = [e.session_stats()[f"session {sid}"] for e in star.engines]
    assert budget == [0]
    assert all(h.saturated for h in first) and not any(h.saturated for h in second)
    assert all(s["corrupt_agreements"] == 1 for s in stats)
    assert server.saturated  # the node was told the layer's sum is not a sum
    for got in pulled5:
        assert np.isnan(got).all(), "the store applied the non-finite sum (a real node skips the step)"
    exact = layers[6].astype(np.float64) - 0.5 * (grads[0][6].astype(np.float64) + grads[1][6])
    for got in pulled6:
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-6)


def test_an_agreement_result_corrupted_after_the_switch_is_dropped_and_resent():
    """An exponent lane of the agreement's RESULT flipped on the way out of the switch (a MAX
    packet's check words cover its header only): its tag fails per packet, so the RESULT is
    dropped, counted and resent from the switch's stored copy, and the sum is exact. Before the
    fix the tags were checked only once the op was accepted: the whole op took the exact path."""
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal(3 * DATA + 7).astype(np.float32) for _ in range(2)]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        emit = sw.emit
        budget = [1]

        def corrupting_emit(b, em):
            rows = b.rows[:, b.off:]
            for i in np.unique(em.pkt).tolist():
                if (budget[0] and rows[i, 0] & 0xF == MsgType.RESULT and rows[i, 1] & Flag.MAX
                        and int.from_bytes(bytes(rows[i, 2:4]), "big") == META_SESSION):
                    rows[i, HEADER_LEN + 1] ^= 0x04  # an exponent bit: the tag no longer matches
                    seal_headers(rows[i:i + 1, :HEADER_LEN])
                    budget[0] -= 1
            return emit(b, em)

        sw.emit = corrupting_emit
        handles = [e.allreduce(x) for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in handles]
        stats = [e.session_stats()[f"session {META_SESSION}"] for e in engines]
    assert budget == [0], "the test corrupted nothing"
    assert sum(s["dropped.bad_check"] for s in stats) >= 1
    exact = (xs[0].astype(np.float64) + xs[1]).astype(np.float32)
    for h, r in zip(handles, results):
        assert not h.saturated, "a corruption after the switch is cured by a resend"
        np.testing.assert_allclose(r, exact, rtol=1e-5, atol=1e-5)
