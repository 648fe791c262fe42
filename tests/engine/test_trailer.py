"""The PARAM/PULL trailer (docs/protocol.md 3.7) end to end: a PARAM whose values were corrupted
after the node sealed them is dropped by the worker and counted `dropped.bad_trailer`, and the
pull's retry gets the right values; a corrupted PULL is dropped by the node and retried."""

from __future__ import annotations

import numpy as np
import pytest
from node_star import node_star

from luwu.dataplane.loopback import StarPlan
from luwu.dataplane.protocol import HEADER_LEN, MsgType
from luwu.mininet.paramstore import SgdParamStore


def _flip_payload(rows: np.ndarray, idx, mtype: int, budget: list[int]) -> None:
    for i in np.asarray(idx).tolist():
        if budget[0] and rows[i, 0] & 0xF == mtype:
            rows[i, HEADER_LEN + 5] ^= 0x08  # a value's bit: the header (and its check) intact
            budget[0] -= 1


@pytest.mark.parametrize("mtype", [MsgType.PARAM, MsgType.PULL])
def test_a_corrupted_param_or_pull_is_dropped_and_pulled_again(mtype):
    rng = np.random.default_rng(2)
    layer = rng.standard_normal(500).astype(np.float32)
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64, transport="udp")
    server = SgdParamStore({6: layer.copy()}, lr=0.5)
    sid = plan.node_session(0)
    budget = [1]
    with node_star(plan, server) as star:
        sw = star.switch._sw
        if mtype == MsgType.PARAM:  # on its way out of the switch, to every worker
            emit = sw.emit

            def corrupting(b, em):
                _flip_payload(b.rows[:, b.off:], np.unique(em.pkt), mtype, budget)
                return emit(b, em)

            sw.emit = corrupting
        else:  # on its way into the switch
            turn = sw.handle_turn

            def corrupting_turn(rx, segments):
                _flip_payload(rx.turn_rows(rx.filled), np.arange(rx.filled), mtype, budget)
                return turn(rx, segments)

            sw.handle_turn = corrupting_turn
        got = [e.pull(sid, 6, 0).wait(60) for e in star.engines]
        workers = [e.session_stats()[f"session {sid}"] for e in star.engines]
        node = star.node.session_stats()[f"session {sid}"]
    assert budget == [0]
    for g in got:
        np.testing.assert_array_equal(g, layer)
    if mtype == MsgType.PARAM:
        assert sum(w.get("dropped.bad_trailer", 0) for w in workers) == 2  # one row, to both workers
    else:
        assert node.get("dropped.bad_trailer", 0) == 1
