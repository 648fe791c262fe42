"""End to end: engines wired by JoinJob allreduce through a controller-programmed tree of software switches.

Three software switches on loopback UDP (tor0, tor1 under cluster), each serving P4Runtime; the
controller plans a 2-worker job across both racks and programs all three; two real engines
built from the EndpointPlans JoinJob returns sum int32 tensors bit-exactly through the tree.
"""

from __future__ import annotations

import numpy as np
import pytest
from ctl_helpers import LANES, free_port

from luwu.controller.client import software_switch_record
from luwu.proto import controller_pb2 as pb

WAIT = 60.0  # seconds an allreduce may take on a loaded machine before the test gives up


@pytest.fixture
def tree(software_switch):
    """tor0 and tor1 (one worker port each, uplink port 2) wired over UDP to cluster ports 1 and 2."""
    (tor0, a0), (tor1, a1), (cluster, ac) = software_switch(), software_switch(), software_switch()
    for tor in (tor0, tor1):
        tor.attach_udp(1, ("127.0.0.1", 0))
    for i, tor in enumerate((tor0, tor1)):
        cluster.attach_udp(i + 1, ("127.0.0.1", 0))
        tor.attach_udp(2, ("127.0.0.1", 0), peer=cluster.ports[i + 1].address)
        cluster.ports[i + 1].set_peer(tor.ports[2].address)
    for sw in (tor0, tor1, cluster):
        sw.start()
    try:
        yield (tor0, a0), (tor1, a1), (cluster, ac)
    finally:
        for sw in (tor0, tor1, cluster):
            sw.stop()


def test_engines_allreduce_through_a_programmed_tree(controller, tree):
    from luwu.dataplane.engine import Engine, EngineConfig

    _, admin = controller
    (tor0, a0), (tor1, a1), (cluster, ac) = tree
    records = [
        software_switch_record(tor0, "tor0", a0, role=pb.TOR, peers={2: ("cluster", 1)}),
        software_switch_record(tor1, "tor1", a1, role=pb.TOR, peers={2: ("cluster", 2)}),
        software_switch_record(cluster, "cluster", ac, role=pb.CLUSTER, peers={1: ("tor0", 2), 2: ("tor1", 2)}),
    ]
    for rec in records:
        assert admin.register_switch(rec).message == "registered and programmed"
    created, token = admin.create_job(pb.Job(name="ddp", num_workers=2, packet_mode=str(LANES), num_nodes=0))
    assert sorted(created.switches) == ["cluster", "tor0", "tor1"]
    engines = []
    try:
        for rank in range(2):
            plan, _info = admin.join_job(created.job_id, rank, f"127.0.0.1:{free_port()}", token=token)
            assert plan.wiring.switch == (tor0 if rank == 0 else tor1).ports[1].address
            engines.append(Engine(plan, EngineConfig()).start())
        rng = np.random.default_rng(7)
        xs = [rng.integers(-(2**31), 2**31, 5 * LANES + 3, dtype=np.int64).astype(np.int32) for _ in range(2)]
        results = [h.wait(WAIT) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]
    finally:
        for e in engines:
            e.close()
    expected = xs[0] + xs[1]  # int32 wrap-around, like the switch
    for r in results:
        np.testing.assert_array_equal(r, expected)
    assert admin.job(created.job_id).state == pb.RUNNING
    completed = {s.switch: {v.label: v.packets for v in s.values if v.counter == "events"} for s in admin.counters()}
    assert all(completed[name].get("COMPLETED", 0) > 0 for name in ("tor0", "tor1", "cluster"))
