"""The header check (hcheck, docs/protocol.md 3.5) end to end: a header corrupted on its way into
the switch is dropped there and counted BAD_CHECKSUM, one corrupted on its way out is dropped by
the engine and counted `dropped.bad_header`; neither touches any state, and the sender's resend
recovers the exact result."""

from __future__ import annotations

import numpy as np
import pytest

from luwu.dataplane.integrity import HCHECK_OFFSET, header_checks, headers_ok
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.protocol import DropReason, MsgType, header_view

NUMEL = 5 * 64 + 3


def _inputs(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(-(2**31), 2**31, NUMEL, dtype=np.int64).astype(np.int32) for _ in range(n)]


def _corrupt_first(rows: np.ndarray, idx: np.ndarray, mtype: int, budget: list[int]) -> None:
    """Flip one bit of the sequence number of the first packets of type `mtype` among rows `idx`
    (a 32-byte header each), `budget[0]` of them in all."""
    for i in idx.tolist():
        if budget[0] and rows[i, 0] & 0xF == mtype and headers_ok(rows[i:i + 1, :32]).all():
            rows[i, 10] ^= 0x01
            budget[0] -= 1


@pytest.mark.parametrize("transport", ["udp", "shm"])
@pytest.mark.parametrize("where", ["into the switch", "out of the switch"])
def test_a_corrupted_header_is_dropped_counted_and_recovered(where, transport):
    if where == "out of the switch" and transport == "shm":
        pytest.skip("shm results may leave by the one-packet fast paths (dataplane/switch/fast/), which emit() does not see: corrupted over UDP")
    xs = _inputs(2)
    expected = xs[0] + xs[1]
    with star(2, transport=transport) as (_, lsw, engines):
        sw = lsw._sw
        assert sw is not None, "the loopback switch runs in this process"
        budget = [3]
        if where == "into the switch":  # before every path of a turn (shm: the one-packet fast paths too)
            turn = sw.handle_turn

            def corrupting_turn(rx, segments):
                rows = rx.turn_rows(rx.filled)
                off = 42 if segments[0][0].framed else 0
                _corrupt_first(rows[:, off:], np.arange(rx.filled), MsgType.ALLREDUCE, budget)
                return turn(rx, segments)

            sw.handle_turn = corrupting_turn
        else:
            emit = sw.emit

            def corrupting_emit(b, em):
                _corrupt_first(b.rows[:, b.off:], np.unique(em.pkt), MsgType.RESULT, budget)
                return emit(b, em)

            sw.emit = corrupting_emit
        results = [h.wait(60) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]
        drops = sw.counters()["drops"]
        bad_headers = sum(e.stats["dropped.bad_header"] for e in engines)
    assert budget == [0], "the test corrupted what it meant to"
    for r in results:
        np.testing.assert_array_equal(r, expected)
    if where == "into the switch":
        assert drops[int(DropReason.BAD_CHECKSUM)][0] == 3 and bad_headers == 0
    else:
        # (a RESULT leaves for both workers from one row: each corrupted row reaches both)
        assert drops.get(int(DropReason.BAD_CHECKSUM), (0, 0))[0] == 0 and bad_headers == 3 * 2


def test_the_fast_check_is_the_reference_crc():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, (300, 40)).astype(np.uint8)
    from luwu.dataplane.integrity import crc16_arc, header_check_fast, header_checks_reference

    assert crc16_arc(b"123456789") == 0xBB3D
    np.testing.assert_array_equal(header_checks(rows), header_checks_reference(rows))
    for r in rows[:40]:
        want = crc16_arc(r[:HCHECK_OFFSET].tobytes() + r[HCHECK_OFFSET + 2:32].tobytes())
        assert header_check_fast(r.tobytes()) == want
    h = header_view(rows)
    assert h["hcheck"].dtype == np.dtype(">u2")


@pytest.mark.parametrize("field", ["float sum", "int32 sum"])
def test_a_sealed_result_whose_offset_is_out_of_bounds_is_dropped_and_resent(field):
    """A corrupted header can pass its CRC-16 (about 2^-16 of wider errors): here a RESULT's offset
    is moved far past its op and the header sealed again. The engine drops it before it touches the
    window or any buffer (`dropped.out_of_bounds`), the resend is the switch's good copy, and the
    sum is exact. Before the bounds check the engine loop indexed past the op: an IndexError."""
    from luwu.dataplane.integrity import seal_headers

    xs = _inputs(2)
    if field == "float sum":
        xs = [(x >> 8).astype(np.float32) for x in xs]  # exact in float32 and in their fixed-point sum
    expected = xs[0] + xs[1]
    with star(2, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        emit = sw.emit
        budget = [2]

        def corrupting_emit(b, em):
            rows = b.rows[:, b.off:]
            for i in np.unique(em.pkt).tolist():
                if budget[0] and rows[i, 0] & 0xF == MsgType.RESULT and headers_ok(rows[i:i + 1, :32]).all():
                    rows[i, 20:24] = np.frombuffer((0x7FFFFF00).to_bytes(4, "big"), np.uint8)  # offset
                    seal_headers(rows[i:i + 1, :32])
                    budget[0] -= 1
            return emit(b, em)

        sw.emit = corrupting_emit
        handles = [e.allreduce(x) for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in handles]
        stats = [e.session_stats() for e in engines]
    assert budget == [0], "the test corrupted what it meant to"
    dropped = sum(s.get("dropped.out_of_bounds", 0) for st in stats for s in st.values() if isinstance(s, dict))
    assert dropped >= 2  # each corrupted row, at one worker or both (one row may leave for both)
    for h, r in zip(handles, results):
        assert not h.saturated
        np.testing.assert_array_equal(r, expected)


@pytest.mark.parametrize("field", ["offset", "dtype"])
def test_a_sealed_agg_whose_offset_is_out_of_bounds_is_dropped_by_the_node(field):
    """The same for the optimizer node: an AGG whose offset is moved past its layer (or whose
    format becomes FIXED16, which a 64-lane switch has no layout for), sealed again, is dropped
    before the node's window or assembly sees it, the resend is the switch's good copy, and the
    pushed sum reaches the store exactly. Before the bounds check the node indexed its assembly
    from the header (an IndexError, or a compiled kernel writing out of bounds); before the
    FIXED16 case was checked, `fixed16.layout` raised in the node's engine loop."""
    from node_star import node_star

    from luwu.dataplane.integrity import header_terms, seal_headers
    from luwu.dataplane.loopback import StarPlan
    from luwu.dataplane.protocol import Dtype
    from luwu.mininet.paramstore import SgdParamStore

    rng = np.random.default_rng(9)
    layer = rng.standard_normal(3 * 62 + 4).astype(np.float32)
    grads = [(rng.integers(-64, 64, layer.size) / 64).astype(np.float32) for _ in range(2)]  # exact sums
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64, transport="udp")
    server = SgdParamStore({5: layer}, lr=0.5)
    sid = plan.node_session(0)
    with node_star(plan, server) as star_:
        sw = star_.switch._sw
        emit = sw.emit
        budget = [2]

        def corrupting_emit(b, em):
            rows = b.rows[:, b.off:]
            for i in np.unique(em.pkt).tolist():
                if budget[0] and rows[i, 0] & 0xF == MsgType.AGG and headers_ok(rows[i:i + 1, :32]).all():
                    # offset moved, then the check words moved by n times the header term's change
                    # and the header sealed: a corruption that passes both checks
                    before = header_terms(header_view(rows[i:i + 1]).copy(), Dtype.FIXED32)
                    if field == "offset":
                        rows[i, 20:24] = np.frombuffer((0x7FFFFF00).to_bytes(4, "big"), np.uint8)
                    else:
                        rows[i, 25] = int(Dtype.FIXED16)
                    after = header_terms(header_view(rows[i:i + 1]).copy(), Dtype.FIXED32)
                    at = 32 + 4 * (64 - 2)  # tofino mode: 64 lanes, the last 2 check words
                    words = rows[i, at:at + 8].view(">u4").astype(np.uint64)
                    words = (words + np.uint64(2) * (after[0] - before[0])) & np.uint64(0xFFFFFFFF)
                    rows[i, at:at + 8] = words.astype(">u4").view(np.uint8)
                    seal_headers(rows[i:i + 1, :32])
                    budget[0] -= 1
            return emit(b, em)

        sw.emit = corrupting_emit
        for h in [e.push(sid, 5, grads[r]) for r, e in enumerate(star_.engines)]:
            h.wait(60)
        pulled = [e.pull(sid, 5, 1).wait(60) for e in star_.engines]
        all_stats = star_.node.session_stats()
        node_stats = all_stats[f"session {sid}"]
    assert budget == [0], "the test corrupted what it meant to"
    # a moved offset fails the bounds check; a FIXED16 claim has the length of any dtype (4-byte
    # lanes, docs/protocol.md 5.2), so it reaches the node, whose FIXED16 check words (16-bit words,
    # its own header term) fail: dropped, and the resend is the switch's good copy
    if field == "offset":
        assert node_stats.get("dropped.out_of_bounds", 0) == 2, node_stats
    else:
        assert node_stats.get("dropped.bad_check", 0) == 2, sorted(node_stats.items())
    exact = layer.astype(np.float64) - 0.5 * (grads[0].astype(np.float64) + grads[1])
    for got in pulled:
        np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-6)
