"""A real controller, two software switches serving P4Runtime on loopback, two optimizer nodes, two jobs."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest
from ctl_helpers import ADMIN, LANES, SLOTS, controller_process, job, node, two_tier

from luwu.controller.client import ControllerClient, ControllerRefused
from luwu.controller.plan import JobPlan
from luwu.controller.programmer import SwitchProgrammer, SwitchTarget
from luwu.dataplane.p4runtime import device_config_marker
from luwu.dataplane.protocol import NODE, Dtype, MsgType, Packet
from luwu.proto import controller_pb2 as pb

LAYERS_A = [3000, 5000, 700, 12000]
LAYERS_B = [900, 900, 900]


def _register(client, tor_addr, spine_addr, workers=4):
    client.register_node(node("n0", 2e6))
    client.register_node(node("n1", 1e6))
    tor, spine = two_tier(tor_addr, spine_addr, workers, ["n0", "n1"])
    for sw in (spine, tor):
        resp = client.register_switch(sw)
        assert resp.message == "registered and programmed", resp.message


def _read_back(p4info, name, address):
    prog = SwitchProgrammer(p4info, lambda t: device_config_marker(LANES, SLOTS), 10.0)
    return asyncio.run(prog.read_program(SwitchTarget(name, address, 0)))


def _key(e):
    return (e.table, json.dumps(e.match, sort_keys=True), e.action_name, json.dumps(e.action_params, sort_keys=True))


def test_two_jobs_on_two_switches(controller, software_switch, p4info):
    _bc, client = controller
    (tor_sw, tor_addr), (spine_sw, spine_addr) = software_switch(), software_switch()
    _register(client, tor_addr, spine_addr)
    job_a, token_a = client.create_job(job("a", 2, LAYERS_A, nodes=1))
    job_b, token_b = client.create_job(job("b", 2, LAYERS_B, nodes=1))
    assert job_a.state == pb.PLANNED and token_a and token_b and token_a != token_b
    plans = [JobPlan.from_json(client.plan(j.job_id).plan_json) for j in (job_a, job_b)]
    assert [p.nodes for p in plans] == [["n0"], ["n1"]]  # the faster node first, then the idle one

    # disjoint slot pools on every switch both jobs use
    for switch in ("tor0", "spine"):
        ranges = plans[0].slot_ranges()[switch] + plans[1].slot_ranges()[switch]
        for (b1, s1, _), (b2, s2, _) in itertools.combinations(ranges, 2):
            assert b1 + s1 <= b2 or b2 + s2 <= b1, f"pools overlap on {switch}"
    # every layer assigned exactly once
    for plan, layers in zip(plans, (LAYERS_A, LAYERS_B)):
        for lid, numel in enumerate(layers):
            assert sum(s.numel for s in plan.shards if s.layer_id == lid) == numel
            offsets = sorted(s.offset for s in plan.shards if s.layer_id == lid)
            assert len(offsets) == len(set(offsets))

    # what the switches hold, read back over P4Runtime, is exactly both plans' programs
    for name, address, sw in (("tor0", tor_addr, tor_sw), ("spine", spine_addr, spine_sw)):
        back = _read_back(p4info, name, address)
        want = [e for p in plans for e in p.programs[name].entries]
        assert sorted(map(_key, back.entries)) == sorted(map(_key, want))
        groups = {g.multicast_group_id: g.pairs() for p in plans for g in p.programs[name].groups}
        assert {g.multicast_group_id: g.pairs() for g in back.groups} == groups
        assert sw.tables.multicast_groups() == groups

    # the programmed tree works: ranks 0, 1 of job a allreduce through tor0 -> spine -> tor0
    plan = plans[0]
    data = next(s.spec for s in plan.sessions if s.spec.purpose == "data")
    port = {p.rank: p.port for p in plan.placements}
    up = []
    for rank in (0, 1):
        payload = np.full(LANES, rank + 5, dtype=">i4").tobytes()
        up += tor_sw.process_datagrams([(port[rank], Packet(MsgType.ALLREDUCE, data.session, rank, count=LANES,
                                                            slot=data.pool_base, dtype=Dtype.INT32, numel=LANES,
                                                            payload=payload).pack())])
    assert [p for p, _ in up] == [5]  # one partial sum up the uplink (port workers + 1)
    down = spine_sw.process_datagrams([(1, up[0][1])])
    assert [p for p, _ in down] == [1] and Packet.unpack(down[0][1]).worker == NODE
    back_down = tor_sw.process_datagrams([(5, down[0][1])])
    assert sorted(p for p, _ in back_down) == [port[0], port[1]]
    assert all(np.all(Packet.unpack(raw).lanes() == 11) for _, raw in back_down)

    # the node serving job a gets its endpoint plan: its port on the spine, the node session only
    (node_plan,) = client.node_plans(job_a.job_id, "n0", token=token_a)
    assert node_plan.wiring.rank == NODE and node_plan.wiring.switch_port == 2
    assert [s.kind for s in node_plan.sessions] == ["node"] and node_plan.sessions[0].node_rank == 0
    with pytest.raises(ControllerRefused, match="does not serve"):
        client.node_plans(job_a.job_id, "n1")

    # ending a job removes exactly its entries
    client.end_job(job_a.job_id, token=token_a)
    back = _read_back(p4info, "tor0", tor_addr)
    assert sorted(map(_key, back.entries)) == sorted(map(_key, plans[1].programs["tor0"].entries))


def test_restart_between_create_and_join_keeps_the_plan(tmp_path, software_switch, p4info):
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN + "\n")
    db = tmp_path / "controller.sqlite"
    (tor_sw, tor_addr), (_, spine_addr) = software_switch(), software_switch()
    with controller_process(db, token_file, p4info) as (proc, address):
        client = ControllerClient(address, ADMIN)
        _register(client, tor_addr, spine_addr)
        created, token = client.create_job(job("a", 2, LAYERS_A, nodes=1))
        before = client.plan(created.job_id).plan_json
        tables_before = {t: tor_sw.tables.entries(t) for t in ("sessions", "workers")}
        client.close()
        proc.kill()  # no goodbye: SIGKILL
    with controller_process(db, token_file, p4info) as (proc, address):
        client = ControllerClient(address, ADMIN)
        assert client.plan(created.job_id).plan_json == before
        assert [j.job_id for j in client.jobs()] == [created.job_id]
        assert {s.name for s in client.switches()} == {"tor0", "spine"}
        assert {n.name for n in client.nodes()} == {"n0", "n1"}
        endpoint, info = client.join_job(created.job_id, 1, "127.0.0.1:45001", token=token)
        assert endpoint.wiring.rank == 1 and endpoint.wiring.local == ("127.0.0.1", 45001)
        assert info["job_id"] == created.job_id and info["group_ranks"] == [0, 1]
        assert {s.session for s in endpoint.sessions} == {s["session"] for s in info["sessions"]}
        rank1 = [e for e in tor_sw.tables.entries("endpoints") if e["match"]["dst"] == 1]
        assert rank1 and all(e["params"]["dst_udp"] == 45001 for e in rank1)
        assert {t: tor_sw.tables.entries(t) for t in ("sessions", "workers")} == tables_before
        # a second job after the restart never reuses an epoch
        second, _ = client.create_job(job("b", 2, LAYERS_B, nodes=1))
        epochs = [s.spec.epoch for j in (created, second)
                  for s in JobPlan.from_json(client.plan(j.job_id).plan_json).sessions]
        assert len(epochs) == len(set(epochs))
        client.close()
    assert proc.returncode is not None


def test_restarted_controller_reprograms_a_wiped_switch(controller_config, software_switch):
    from luwu.controller.server import BackgroundController

    (tor_sw, tor_addr), (_spine_sw, spine_addr) = software_switch(), software_switch()
    bc = BackgroundController(controller_config)
    client = ControllerClient(bc.address, ADMIN)
    _register(client, tor_addr, spine_addr)
    client.create_job(job("a", 2, LAYERS_A, nodes=1))
    want = {t: tor_sw.tables.entries(t) for t in ("sessions", "workers", "endpoints")}
    client.close()
    bc.stop()
    tor_sw.tables.clear()  # the switch lost its state while the controller was away
    bc = BackgroundController(controller_config)
    try:
        assert bc.wait_reconciled(30) == {}
        assert {t: tor_sw.tables.entries(t) for t in want} == want
    finally:
        bc.stop()


@pytest.mark.parametrize("bad", ["no-nodes", "lanes"])
def test_unplaceable_jobs_are_refused_and_change_nothing(controller, software_switch, bad):
    _, client = controller
    (_, tor_addr), (_, spine_addr) = software_switch(), software_switch()
    _register(client, tor_addr, spine_addr)
    spec = job("x", 2, LAYERS_B, nodes=3) if bad == "no-nodes" else pb.Job(
        name="x", num_workers=2, packet_mode="jumbo", num_nodes=1, layers=[pb.LayerSpec(layer_id=0, numel=9)])
    with pytest.raises(ControllerRefused) as err:
        client.create_job(spec)
    assert err.value.code.name == "FAILED_PRECONDITION"
    assert client.jobs(include_ended=True) == []
