"""Refusals: no token, wrong token, another job's token, wrong job id, malformed fields -- and nothing changes."""

from __future__ import annotations

import grpc
import pytest
from ctl_helpers import ADMIN, free_port, job, node, star_switch

from luwu.controller.client import ControllerClient, ControllerRefused, ControllerUnreachable
from luwu.proto import controller_pb2 as pb


def snapshot(bc, client):
    """Everything a refused request must leave alone."""
    core = bc.server.core
    return (sorted((s.name, s.SerializeToString()) for s in client.switches()),
            sorted((n.name, n.drained, n.capacity.SerializeToString()) for n in client.nodes()),
            [(j.job_id, j.state, list(j.joined_ranks)) for j in client.jobs(include_ended=True)],
            [core.store.job(j.job_id).plan for j in client.jobs(include_ended=True)],
            core.store.counter("epoch"), core.store.counter("job"))


@pytest.fixture
def deployment(controller, fake_switch):
    bc, admin = controller
    _, address = fake_switch()
    admin.register_node(node("n0"))
    admin.register_switch(star_switch("s1", address, 4, ["n0"]))
    job_a, token_a = admin.create_job(job("a", 2, [100, 200]))
    job_b, token_b = admin.create_job(job("b", 2, [300]))
    return bc, admin, (job_a, token_a), (job_b, token_b)


def refused(code: grpc.StatusCode, fn, *args, **kw) -> str:
    with pytest.raises(ControllerRefused) as err:
        fn(*args, **kw)
    assert err.value.code == code, f"{err.value.code} != {code}: {err.value.message}"
    assert err.value.message  # always says why
    return err.value.message


def test_refusals_change_nothing(deployment):
    bc, admin, (a, token_a), (b, _token_b) = deployment
    before = snapshot(bc, admin)
    anonymous = ControllerClient(bc.address, "")
    stranger = ControllerClient(bc.address, "not-a-token")
    malformed = ControllerClient(bc.address, "")
    malformed._metadata = lambda token: [("authorization", "Basic abc")]
    job_a_client = ControllerClient(bc.address, token_a)
    U, P, N, INV = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND,
                  grpc.StatusCode.INVALID_ARGUMENT)

    assert "authorization" in refused(U, anonymous.create_job, job("c", 2, [1]))
    refused(U, anonymous.join_job, a.job_id, 0, "127.0.0.1:4000")
    refused(U, stranger.status)
    assert "Bearer" in refused(U, malformed.status)
    refused(U, stranger.end_job, a.job_id)
    # a job token reaches its own job only, and no admin call
    refused(P, job_a_client.join_job, b.job_id, 0, "127.0.0.1:4000")
    refused(P, job_a_client.end_job, b.job_id)
    refused(P, job_a_client.plan, b.job_id)
    refused(P, job_a_client.create_job, job("c", 2, [1]))
    refused(P, job_a_client.drain, "n0")
    refused(P, job_a_client.register_node, node("n9"))
    refused(P, job_a_client.join_job, "a-999", 0, "127.0.0.1:4000")  # unknown ids are invisible to job tokens
    # admin: wrong ids and malformed fields
    refused(N, admin.join_job, "nope-1", 0, "127.0.0.1:4000")
    refused(N, admin.drain, "nobody")
    refused(N, admin.counters, "nowhere")
    refused(N, admin.report_health, "node", "ghost")
    refused(INV, admin.join_job, a.job_id, 7, "127.0.0.1:4000")
    refused(INV, admin.join_job, a.job_id, 0, "no-port")
    refused(INV, admin.create_job, job("bad name!", 2, [1]))
    refused(INV, admin.create_job, job("c", 0, [1]))
    refused(INV, admin.create_job, pb.Job(name="c", num_workers=2, packet_mode="huge", num_nodes=0))
    refused(INV, admin.create_job, pb.Job(name="c", num_workers=2, packet_mode="64", num_nodes=1,
                                        layers=[pb.LayerSpec(layer_id=1, numel=5), pb.LayerSpec(layer_id=1, numel=5)]))
    refused(INV, admin.register_switch, pb.Switch(name="s2", p4runtime_address="nohost", target="software",
                                                lanes=64, slots=16))
    refused(INV, admin.register_switch, pb.Switch(name="s2", p4runtime_address="127.0.0.1:1", target="asic",
                                                lanes=64, slots=16))
    refused(INV, admin.register_node, pb.Node(name="n2", data_address="127.0.0.1"))
    refused(INV, admin.report_health, "toaster", "n0")
    refused(grpc.StatusCode.FAILED_PRECONDITION, admin.deregister_node, "n0")  # serves jobs
    refused(grpc.StatusCode.FAILED_PRECONDITION, admin.deregister_switch, "s1")
    assert snapshot(bc, admin) == before

    # the right tokens work
    plan, info = job_a_client.join_job(a.job_id, 0, "127.0.0.1:4000")
    assert plan.wiring.rank == 0 and info["job_id"] == a.job_id
    assert job_a_client.job(a.job_id).joined_ranks == [0]
    assert job_a_client.end_job(a.job_id).state == pb.ENDED
    assert admin.end_job(b.job_id).state == pb.ENDED


def test_unreachable_controller_says_what_to_check():
    client = ControllerClient(f"127.0.0.1:{free_port()}", ADMIN, timeout=2)
    with pytest.raises(ControllerUnreachable, match="is `luwu controller` running\\? check --controller"):
        client.status()
