"""Planner behaviour on star, multi-rack and rail-only topologies: trees, pools, ids, shards, determinism."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.controller import topology as T
from luwu.controller.config import ControllerConfig
from luwu.controller.job_spec import JobSpec
from luwu.controller.plan import JobPlan
from luwu.controller.planner import PlanError, Planner
from luwu.controller.shards import ShardBalancer
from luwu.controller.usage import SwitchUsage
from luwu.dataplane.protocol import NODE, NextStep
from luwu.dataplane.session import EndpointPlan


def plan_on(topo, spec, usage=None, caps=None, config=None, counter=None, job_id="job-1", **kw):
    usage = usage or SwitchUsage({n: s.slots for n, s in topo.switches.items()})
    counter = counter or itertools.count(1)
    return Planner(config or ControllerConfig()).plan(job_id, spec, topo, usage, lambda: next(counter), caps, **kw)


def entries(plan, switch, table):
    return [e for e in plan.programs[switch].entries if e.table == table]


def covered(plan, layers):
    """Every element of every layer exactly once."""
    for lid, numel in layers:
        pieces = sorted((s.offset, s.numel) for s in plan.shards if s.layer_id == lid)
        pos = 0
        for off, n in pieces:
            assert off == pos, f"layer {lid}: gap or overlap at {pos}"
            pos += n
        assert pos == numel, f"layer {lid}: {pos} of {numel} elements assigned"


def test_star_sessions_entries_and_groups():
    topo = T.star(4, 2)
    layers = [(i, 1000 * (i + 1)) for i in range(6)]
    plan = plan_on(topo, JobSpec("a", 4, layers, num_nodes=2), caps={"n0": 1e6, "n1": 3e6})
    kinds = [(s.spec.kind, s.spec.purpose) for s in plan.sessions]
    assert kinds == [("collective", "meta"), ("collective", "data"), ("node", "data"), ("node", "data")]
    assert len({s.spec.session for s in plan.sessions}) == 4 and len({s.spec.epoch for s in plan.sessions}) == 4
    sessions = entries(plan, "s1", "sessions")
    for e in sessions:
        p = e.action_params
        assert p["num_workers"] == 4 and p["worker_mask"] == 0b1111 and p["next_step"] == NextStep.ROOT
        assert p["mcast_grp"] == e.match["session"]
    node_sessions = [s for s in plan.sessions if s.node]
    for s in node_sessions:  # node sessions go up to the node's port; the node's endpoint is programmed
        up = next(e for e in sessions if e.match["session"] == s.spec.session).action_params["up_port"]
        assert up == {n: p for p, n in topo.node_ports("s1")}[s.node]
        assert any(e.match == {"session": s.spec.session, "dst": NODE} for e in entries(plan, "s1", "endpoints"))
    workers = entries(plan, "s1", "workers")
    assert sorted(e.action_params["worker_bit"] for e in workers if e.match["session"] == 1) == [1, 2, 4, 8]
    groups = {g.multicast_group_id: g.pairs() for g in plan.programs["s1"].groups}
    assert groups[1] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    covered(plan, layers)
    share = {n: sum(s.numel for s in plan.shards if s.node == n) for n in ("n0", "n1")}
    assert share["n1"] > share["n0"]  # three times the capacity gets the larger share


def test_multi_rack_tree_upstream_and_up_workers():
    topo = T.multi_rack(racks=2, workers_per_rack=3, nodes=1)
    plan = plan_on(topo, JobSpec("b", 6, [(0, 5000)], num_nodes=1))
    s = plan.sessions[0]
    assert s.root == "cluster" and s.switches == ["cluster", "tor0", "tor1"]
    assert len({x.spec.session for x in plan.sessions}) == len(plan.sessions)
    for tor, up_worker in (("tor0", 6), ("tor1", 7)):
        for e in entries(plan, tor, "sessions"):
            assert e.action_params["next_step"] == NextStep.UPSTREAM
            assert e.action_params["up_port"] == 4 and e.action_params["up_worker"] == up_worker
            assert e.action_params["num_workers"] == 3
    cluster = entries(plan, "cluster", "sessions")
    assert all(e.action_params["num_workers"] == 2 and e.action_params["worker_mask"] == 0b11 for e in cluster)
    ws = {(e.match["session"], e.match["worker"]): e.action_params for e in entries(plan, "cluster", "workers")}
    assert ws[(1, 6)] == {"worker_bit": 1, "port": 1} and ws[(1, 7)] == {"worker_bit": 2, "port": 2}
    assert {g.multicast_group_id: g.pairs() for g in plan.programs["cluster"].groups}[1] == [(1, 6), (2, 7)]
    # GRADs passing up toward the node enter the root only on its ToRs' ports; the ToRs have no children
    child = {(e.match["session"], e.match["port"]) for e in entries(plan, "cluster", "child_ports")}
    assert child == {(x.spec.session, p) for x in plan.sessions for p in (1, 2)}
    assert not entries(plan, "tor0", "child_ports") and not entries(plan, "tor1", "child_ports")
    # every switch of the tree shares the id and pool of a session
    for sess in plan.sessions:
        bases = {e.action_params["pool_base"] for sw in sess.switches for e in entries(plan, sw, "sessions")
                 if e.match["session"] == sess.spec.session}
        assert bases == {sess.spec.pool_base}


def test_multi_rack_without_nodes_on_one_rack_roots_at_the_tor():
    topo = T.multi_rack(racks=2, workers_per_rack=4, nodes=1)
    plan = plan_on(topo, JobSpec("c", 3, [], num_nodes=0))
    assert {s.root for s in plan.sessions} == {"tor0"} and set(plan.programs) == {"tor0"}


def test_torch_backend_takes_a_per_rail_plan_only_with_its_server_size():
    """A rail-only plan sums each rail on its own switch: the torch backend refuses it at join unless
    it knows the ranks per server (LOCAL_WORLD_SIZE), which makes its allreduce hierarchical; a
    wrong server size is refused too, never a rail's partial sum returned as the group's."""
    from luwu.worker.backend.plan_source import check_covers_group

    rail = plan_on(T.rail_only(servers=3, gpus_per_server=2), JobSpec("r", 6, [(0, 10)], num_nodes=1))
    with pytest.raises(RuntimeError, match="sums 3 of the group's 6 ranks.*LOCAL_WORLD_SIZE"):
        check_covers_group(rail.worker_plan(0), 6, "job r")
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE=3 does not make one rail per server"):
        check_covers_group(rail.worker_plan(0), 6, "job r", local_world_size=3)
    assert check_covers_group(rail.worker_plan(0), 6, "job r", local_world_size=2) == 2
    star = plan_on(T.multi_rack(racks=2, workers_per_rack=3, nodes=1), JobSpec("b", 6, [(0, 10)], num_nodes=1))
    assert check_covers_group(star.worker_plan(0), 6, "job b") == 1  # a tree over every rank is flat


@pytest.mark.parametrize("mode", ["port_per_rail", "node_per_rail"])
def test_rail_only_one_tree_per_rail(mode):
    topo = T.rail_only(servers=3, gpus_per_server=2, node_mode=mode)
    layers = [(0, 101), (1, 64)]
    plan = plan_on(topo, JobSpec("r", 6, layers, num_nodes=1))
    assert plan.groups == [[0, 2, 4], [1, 3, 5]]
    for p in plan.placements:
        assert p.switch == f"rail{p.rank % 2}" and p.port == p.rank // 2 + 1
    for g in (0, 1):
        sess = [s for s in plan.sessions if s.group == g]
        assert {s.root for s in sess} == {f"rail{g}"} and all(s.spec.num_workers == 3 for s in sess)
        rank_plan = plan.worker_plan(g)
        assert {s.session for s in rank_plan.sessions} == {s.spec.session for s in sess}
    assert len({s.spec.session for s in plan.sessions}) == len(plan.sessions)  # unique across the job
    covered(plan, layers)
    for g in (0, 1):  # each rail's slice goes to a node reachable from that rail
        for s in (x for x in plan.shards if x.group == g):
            assert (f"rail{g}", ) == tuple(sw for sw, _ in topo.node_attachments(s.node) if sw == f"rail{g}")
    if mode == "port_per_rail":
        assert len(plan.node_plans("n0")) == 2  # one engine per rail port
    else:
        assert [len(plan.node_plans(n)) for n in ("n0", "n1")] == [1, 1]


def test_rail_only_refuses_uneven_workers():
    with pytest.raises(PlanError, match="multiple of 2"):
        plan_on(T.rail_only(3, 2), JobSpec("r", 5, [(0, 10)], num_nodes=1))


def test_two_jobs_get_disjoint_pools_ports_and_ids():
    topo = T.star(8, 2)
    usage = SwitchUsage({n: s.slots for n, s in topo.switches.items()})
    counter = itertools.count(1)
    a = plan_on(topo, JobSpec("a", 4, [(0, 100)], num_nodes=1), usage, counter=counter, job_id="a")
    b = plan_on(topo, JobSpec("b", 4, [(0, 100)], num_nodes=1), usage, counter=counter, job_id="b",
                node_load={"n0": 1})
    ranges = a.slot_ranges()["s1"] + b.slot_ranges()["s1"]
    for (b1, s1, _), (b2, s2, _) in itertools.combinations(ranges, 2):
        assert b1 + s1 <= b2 or b2 + s2 <= b1
    assert not {s.spec.session for s in a.sessions} & {s.spec.session for s in b.sessions}
    assert not {p.port for p in a.placements} & {p.port for p in b.placements}
    assert not {s.spec.epoch for s in a.sessions} & {s.spec.epoch for s in b.sessions}
    assert a.nodes == ["n0"] and b.nodes == ["n1"]  # the least-loaded node serves the new job


def test_full_switch_shrinks_then_refuses():
    topo = T.star(8, 1, slots=256)
    cfg = ControllerConfig(meta_pool=32, data_pool=128, node_pool=128, min_pool=16)
    usage = SwitchUsage({"s1": 256})
    first = plan_on(topo, JobSpec("a", 2, [(0, 10)], num_nodes=1), usage, config=cfg, job_id="a")
    assert [s.spec.pool_size for s in first.sessions] == [32, 128, 64]  # the node pool shrank to fit
    assert any("shrunk" in line for line in first.explanation)
    with pytest.raises(PlanError, match="no 16\\+ slot pool"):
        plan_on(topo, JobSpec("b", 2, [(0, 10)], num_nodes=1), usage, config=cfg, job_id="b")


def test_fallback_when_allowed_gives_node_sessions_pool_size_zero_on_the_switch():
    topo = T.star(4, 1, slots=64)
    cfg = ControllerConfig(meta_pool=32, data_pool=32, node_pool=32, min_pool=32, allow_fallback=True)
    usage = SwitchUsage({"s1": 64})
    plan = plan_on(topo, JobSpec("a", 2, [(0, 10)], num_nodes=1), usage, config=cfg)
    node = next(s for s in plan.sessions if s.node)
    assert node.fallback and node.spec.pool_size == 32  # the endpoints keep a window
    entry = next(e for e in entries(plan, "s1", "sessions") if e.match["session"] == node.spec.session)
    assert entry.action_params["pool_size"] == 0
    assert sum(size for _, size, _ in usage.pools["s1"]) == 64  # the fallback session reserved no slot
    assert any("falls back" in line for line in plan.explanation)


def test_plans_are_deterministic_and_round_trip():
    topo = T.multi_rack(2, 4, 2)
    spec = JobSpec("d", 7, [(i, 777 * (i + 3)) for i in range(9)], num_nodes=2, workers_per_switch=4)
    caps = {"n0": 2e6, "n1": 1e6}
    one, two = plan_on(topo, spec, caps=caps).to_json(), plan_on(topo, spec, caps=caps).to_json()
    assert one == two
    plan = JobPlan.from_json(one)
    assert plan.to_json() == one
    for rank in range(7):
        text = plan.worker_plan(rank).to_json()
        assert EndpointPlan.from_json(text).wiring.rank == rank


def test_no_matching_lanes_or_nodes_say_why():
    with pytest.raises(PlanError, match="packet mode"):
        plan_on(T.star(4, 1, lanes=64), JobSpec("x", 2, [(0, 1)], packet_mode="jumbo"))
    with pytest.raises(PlanError, match="usable optimizer node"):
        plan_on(T.star(4, 1), JobSpec("x", 2, [(0, 1)], num_nodes=2))
    with pytest.raises(PlanError, match="free worker port"):
        plan_on(T.star(2, 1), JobSpec("x", 3, [(0, 1)], num_nodes=1))
    with pytest.raises(ValueError, match="layer id 0 appears twice"):
        plan_on(T.star(2, 1), JobSpec("x", 2, [(0, 1), (0, 2)], num_nodes=1))


@settings(max_examples=60, deadline=None)
@given(layers=st.lists(st.integers(1, 10**6), min_size=1, max_size=20),
       caps=st.lists(st.floats(1.0, 1e9), min_size=1, max_size=5))
def test_shards_cover_every_element_once_and_balance(layers, caps):
    pieces = ShardBalancer(min_slice=1).assign(list(enumerate(layers)), caps)
    for lid, numel in enumerate(layers):
        mine = sorted((p.offset, p.numel) for p in pieces if p.layer_id == lid)
        assert mine[0][0] == 0 and sum(n for _, n in mine) == numel
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(mine))
    assert pieces == ShardBalancer(min_slice=1).assign(list(enumerate(layers)), caps)
    # no node finishes later than the ideal finish time plus the largest piece it holds
    total, load = sum(layers), [0] * len(caps)
    for p in pieces:
        load[p.node_index] += p.numel
    ideal = total / sum(caps)
    biggest = max(p.numel for p in pieces)
    assert max(load[i] / caps[i] for i in range(len(caps))) <= ideal + biggest / min(caps) + 1e-9
