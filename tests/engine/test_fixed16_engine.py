"""FIXED16 end to end through the software switch (docs/protocol.md 5.2): allreduce and push with
grad_format="fixed16" give sums within `error_bound16` of the exact ones, identical on every
worker; saturation takes the exact path (NaN chunks + saturated) as FIXED32 does; a push's sum
reaches the optimizer node, which learns the exponents from the exponent lanes; loss, duplication
and reordering are recovered; packets too small for a block fall back to FIXED32. They need the
software switch's FIXED16 aggregation (skipped, named, in a tree without it)."""

from __future__ import annotations

import numpy as np
import pytest
from node_star import node_star

from luwu.dataplane import fixed16, integrity
from luwu.dataplane import quantize as Q
from luwu.dataplane.integrity import FIXED16_BLOCK as B
from luwu.dataplane.loopback import StarPlan
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.protocol import LANE_CHUNK, Dtype
from luwu.dataplane.switch.controls import classifier
from luwu.mininet.paramstore import SgdParamStore

# the software switch's reference path sums FIXED16 lanes from the packet format v2 work (PACKET_V2.md,
# hp4's part); a tree without it cannot run these end-to-end tests (tests/engine/test_fixed16.py
# checks the codec against an emulated switch there)
pytestmark = pytest.mark.skipif(not hasattr(classifier, "FIXED16"),
                                reason="the software switch does not aggregate FIXED16 lanes in this tree")

LANES = 300  # 4 blocks of up to 64 per packet: a buffer of a few thousand elements spans many packets


def _inputs(n, numel, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(numel) * 10.0 ** rng.uniform(-3, 3, numel)).astype(np.float32) for _ in range(n)]


def _check(results, xs):
    n = len(xs)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    exps = np.max([Q.block_exponents(x, B) for x in xs], axis=0)
    for r in results:
        np.testing.assert_array_equal(r.view(np.uint32), results[0].view(np.uint32))
        bound = Q.error_bound16(r, exps, B, n)
        err = np.abs(r.astype(np.float64) - exact)
        assert (err <= bound).all(), f"worst error {err.max()} vs bound {bound[err.argmax()]}"


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("numel", [1, B - 1, B + 1, 5 * fixed16.layout(LANES)[1] + 17])
def test_allreduce_fixed16_within_bound(n, numel):
    xs = _inputs(n, numel, seed=n + numel)
    with star(n, mode=LANES) as (_, _, engines):
        hs = [e.allreduce(x, grad_format="fixed16") for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in hs]
        assert not any(h.saturated for h in hs)
    _check(results, xs)


def test_allreduce_fixed16_in_place_avg_and_lossy_ports():
    xs = _inputs(3, 4000, seed=9)
    drop = {"ingress": 0.05, "egress": 0.05, "duplicate": 0.02, "reorder": 0.02}
    with star(3, mode=LANES, drop=drop, seed=3) as (_, _, engines):
        bufs = [x.copy() for x in xs]
        sums = [h.wait(60) for h in [e.allreduce(b, "sum", out=b, grad_format="fixed16")
                                     for e, b in zip(engines, bufs)]]
        avgs = [h.wait(60) for h in [e.allreduce(x, "avg", grad_format="fixed16") for e, x in zip(engines, xs)]]
    _check(sums, xs)
    assert all(s is b for s, b in zip(sums, bufs))
    for a in avgs:
        np.testing.assert_array_equal(a, sums[0] / np.float32(3))


def test_saturated_blocks_come_back_nan_and_flagged():
    per = fixed16.layout(LANES)[1]
    xs = _inputs(2, 3 * per, seed=4)
    xs[1][per + 5] = np.inf  # the second packet saturates: its elements NaN, the rest exact
    with star(2, mode=LANES) as (_, _, engines):
        hs = [e.allreduce(x, grad_format="fixed16") for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in hs]
    for h, r in zip(hs, results):
        assert h.saturated
        assert np.isnan(r[per:2 * per]).all()
        assert not np.isnan(r[:per]).any() and not np.isnan(r[2 * per:]).any()


def test_tofino_packets_carry_one_block():
    """64 lanes (tofino mode, the BMv2 and Tofino builds) hold one block of 112 values, two per
    lane: the engine sums in FIXED16, within its bound (and, somewhere, outside FIXED32's: not
    a silent fallback)."""
    xs = _inputs(2, 400, seed=1)
    with star(2, mode="tofino") as (_, _, engines):
        hs = [e.allreduce(x, grad_format="fixed16") for e, x in zip(engines, xs)]
        results = [h.wait(60) for h in hs]
    assert fixed16.layout(64) == (1, B)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    exps = np.max([Q.block_exponents(x, B) for x in xs], axis=0)
    err = np.abs(results[0] - exact)
    assert (err <= Q.error_bound16(results[0], exps, B, 2)).all()
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
    per = integrity.data_lanes(64, Dtype.FIXED32)
    exps32 = np.max([Q.chunk_exponents(x, per) for x in xs], axis=0)
    assert (err > Q.error_bound(results[0], exps32, per, 2)).any()


def test_small_packets_use_fixed32():
    """A switch narrower than FIXED16_MIN_LANES (61) holds no block of 112 plus its exponent and
    checks: the engine sums in FIXED32 instead, whatever the job asked (exact as ever, not an error)."""
    lanes = integrity.FIXED16_MIN_LANES - 1
    xs = _inputs(2, 500, seed=1)
    with star(2, mode=lanes) as (_, _, engines):
        results = [h.wait(60) for h in [e.allreduce(x, grad_format="fixed16") for e, x in zip(engines, xs)]]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    per = integrity.data_lanes(lanes, Dtype.FIXED32)  # the lanes less the check words
    exps = np.max([Q.chunk_exponents(x, per) for x in xs], axis=0)
    assert (np.abs(results[0] - exact) <= Q.error_bound(results[0], exps, per, 2)).all()


@pytest.mark.parametrize("fallback", [False, True])
def test_push_fixed16_reaches_the_node(fallback):
    """Workers push FIXED16 gradients; the node decodes the switch's sums (or, when the switch has no
    pool for the session, its own software sum of the packed lanes) with the exponents read from
    the exponent lanes, and steps SGD: the pulled parameters are within the bound."""
    workers = 3
    plan = StarPlan(workers=workers, nodes=1, mode=LANES, node_pool=32, param_window=64)
    runtime = plan.runtime()
    if fallback:
        for e in runtime["table_entries"]:
            if e["table"] == "sessions" and e["match"]["session"] == plan.node_session(0):
                e["action_params"]["pool_base"] = 4000
                e["action_params"]["pool_size"] = 1
    rng = np.random.default_rng(7)
    layers = {7: rng.standard_normal(3000).astype(np.float32), 3: rng.standard_normal(70).astype(np.float32)}
    grads = [{t: (rng.standard_normal(p.size) * 0.01).astype(np.float32) for t, p in layers.items()}
             for _ in range(workers)]
    server = SgdParamStore(layers, lr=0.5)
    sid = plan.node_session(0)
    with node_star(plan, server, runtime=runtime) as st:
        for e in st.engines:
            e.config.grad_format = "fixed16"
        for h in [e.push(sid, t, grads[r][t]) for t in layers for r, e in enumerate(st.engines)]:
            h.wait(60)  # the node acknowledges a gradient once it has applied it
            assert not h.saturated
        stats = st.node.session_stats()[f"session {sid}"]
    assert stats["gradients"] == len(layers) and not stats.get("bad_check") and not server.saturated
    if fallback:
        assert stats["fallback_packets"] > 0
    for t, p in layers.items():
        gsum = np.sum([g[t].astype(np.float64) for g in grads], axis=0)
        exps = np.max([Q.block_exponents(g[t], B) for g in grads], axis=0)
        exact = p.astype(np.float64) - 0.5 * gsum
        bound = 0.5 * Q.error_bound16(gsum.astype(np.float32), exps, B, workers) + np.spacing(
            np.abs(exact).astype(np.float32))
        assert (np.abs(server.params[t] - exact) <= bound).all()


def test_a_corrupt_block_exponent_agreement_with_a_fingerprint_takes_the_exact_path():
    """With a fingerprint (check=...) the block exponents ride in int32 lanes, self-checking
    (integrity.pack_exponents): one flipped before the switch wins the MAX and fails its tag on
    every resend, so the whole op takes the exact path (NaN + saturated on every worker), its
    data is still sent, and the next op completes. Before the fix the lanes were raw exponents,
    trusted as they came."""
    from luwu.dataplane.engine import agreement
    from luwu.dataplane.integrity import headers_ok, seal_headers
    from luwu.dataplane.loopback.plan import META_SESSION
    from luwu.dataplane.protocol import HEADER_LEN, Flag, MsgType

    check = np.array([7], np.int32)
    lane = agreement.lanes(check.size)  # the first exponent lane, after the fingerprint's
    xs = _inputs(2, 3 * fixed16.layout(LANES)[1] + 5, seed=11)
    ys = _inputs(2, 2 * B + 3, seed=12)
    with star(2, mode=LANES, transport="udp") as (_, lsw, engines):
        sw = lsw._sw
        turn = sw.handle_turn
        budget = [1]

        def corrupting_turn(rx, segments):
            rows = rx.turn_rows(rx.filled)
            for i in range(rx.filled):
                h = rows[i:i + 1, :HEADER_LEN]
                if (budget[0] and rows[i, 0] & 0xF == MsgType.ALLREDUCE and rows[i, 1] & Flag.MAX
                        and int.from_bytes(bytes(rows[i, 2:4]), "big") == META_SESSION
                        and rows[i, 25] == Dtype.INT32 and headers_ok(h).all()):
                    rows[i, HEADER_LEN + 4 * lane] ^= 0x20  # up (a small exponent's top byte is 0): it wins
                    seal_headers(h)
                    budget[0] -= 1
            return turn(rx, segments)

        sw.handle_turn = corrupting_turn
        first = [e.allreduce(x, check=check, grad_format="fixed16") for e, x in zip(engines, xs)]
        second = [e.allreduce(y, check=check, grad_format="fixed16") for e, y in zip(engines, ys)]
        r1 = [h.wait(60) for h in first]
        r2 = [h.wait(60) for h in second]
    assert budget == [0], "the test corrupted nothing"
    for h, r in zip(first, r1):
        assert h.saturated and np.isnan(r).all(), "a corrupt agreement gives the exact path for the whole op"
    assert not any(h.saturated for h in second)
    _check(r2, ys)


def test_a_push_sends_the_bytes_push_bytes_counts():
    """A FIXED16 push is its agreement packets and its data packets, each cut to the whole chunks
    its count needs, and nothing else but heartbeats (32 bytes) and resends: luwu/demo/push_bytes.structure, which the
    demo's report.json traffic.push_breakdown uses, counts what an engine really sends."""
    from luwu.demo import push_bytes

    workers = 2
    plan = StarPlan(workers=workers, nodes=1, mode=LANES, node_pool=32, param_window=64)
    rng = np.random.default_rng(11)
    layers = {1: rng.standard_normal(5000).astype(np.float32), 2: rng.standard_normal(70).astype(np.float32)}
    server = SgdParamStore(layers, lr=0.1)
    sid = plan.node_session(0)
    with node_star(plan, server) as st:
        for e in st.engines:
            e.config.grad_format = "fixed16"
        for t, p in layers.items():
            for h in [e.push(sid, t, (rng.standard_normal(p.size) * 0.01).astype(np.float32)) for e in st.engines]:
                h.wait(60)
        stats = [e.session_stats() for e in st.engines]
    s = push_bytes.structure([p.size for p in layers.values()], LANES, "fixed16")
    packets = s["data"]["packets"] + s["agreement"]["packets"]
    assert s["data"]["packets"] == sum(fixed16.packets(p.size, LANES) for p in layers.values())
    row = fixed16.row_len(LANES)  # the longest packet
    luwu_bytes = s["bytes"] - push_bytes.WIRE * packets
    assert luwu_bytes < packets * row  # the last data packets and the agreement packets are cut short
    for st_ in stats:
        sock = st_["socket"]
        streams = [v[k] for v in st_.values() if isinstance(v, dict) for k in ("send_stream", "grad_stream") if k in v]
        resent = sum(x["retransmitted"] for x in streams)
        resent_bytes = sum(x["retransmitted_bytes"] for x in streams)
        heartbeats = sock["tx_packets"] - packets - resent
        assert heartbeats >= 0, (sock, packets, resent)
        assert resent * (32 + 2 * LANE_CHUNK) <= resent_bytes <= resent * row
        assert sock["tx_bytes"] == luwu_bytes + resent_bytes + 32 * heartbeats, (sock, packets, resent)
