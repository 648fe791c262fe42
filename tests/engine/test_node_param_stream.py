"""The optimizer node's PARAM stream on a shared-memory port: written straight into the up ring
(no send-ring copy, node_server.py), and under loss every pulled bit is the node's, with resends
filled again from the served copy the pull holds."""

from __future__ import annotations

import numpy as np
import pytest
from node_star import node_star

from luwu.dataplane.loopback import StarPlan
from luwu.dataplane.net.shm_ring import supported
from luwu.dataplane.protocol import DropReason
from luwu.mininet.paramstore import SgdParamStore

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")


def _layers(seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    # several packets per pull (the plan's 64 lanes: 64 fp32 a packet), a short last one, a lone element
    return {4: rng.standard_normal(3000).astype(np.float32), 5: rng.standard_normal(70).astype(np.float32),
            6: rng.standard_normal(1).astype(np.float32)}


def _pull_all(plan: StarPlan, layers: dict[int, np.ndarray], drop=None, rounds: int = 3):
    server = SgdParamStore(layers, lr=0.5)
    sid = plan.node_session(0)
    with node_star(plan, server, drop=drop, seed=11) as star:
        node, engines = star.node, star.engines
        direct = node.sessions[sid].params.direct, node.sessions[sid].params.ring
        got = [{t: [e.pull(sid, t, 0).wait(60).copy() for e in engines] for t in layers} for _ in range(rounds)]
        stats = node.session_stats()
    return direct, got, stats, star.counters


def test_the_node_writes_param_rows_straight_into_the_up_ring():
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64, transport="shm")
    (direct, ring), got, _, _ = _pull_all(plan, _layers(1), rounds=1)
    assert direct and ring is None, "the node's parameter stream on a shm port keeps no send ring"
    for t, p in _layers(1).items():
        for arr in got[0][t]:
            np.testing.assert_array_equal(arr.view(np.uint32), p.view(np.uint32))


def test_pulls_under_loss_are_the_nodes_bits():
    """Through the switch's drop simulator: every worker's every pull equals the node's array bit
    for bit, and the node did resend PARAM rows (filled again from the pull's served copy)."""
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=32, param_window=64, transport="shm")
    drop = {"ingress": 0.05, "egress": 0.05, "duplicate": 0.02, "reorder": 0.02}
    layers = _layers(2)
    (direct, _), got, stats, counters = _pull_all(plan, layers, drop=drop, rounds=4)
    assert direct
    for rnd in got:
        for t, p in layers.items():
            for arr in rnd[t]:
                np.testing.assert_array_equal(arr.view(np.uint32), p.view(np.uint32))
    assert counters["drops"].get(int(DropReason.SIMULATED_LOSS), (0, 0))[0] > 0, "the drop simulator dropped nothing"
    assert stats[f"session {plan.node_session(0)}"]["params_stream"]["retransmitted"] > 0, "no PARAM row was resent"
