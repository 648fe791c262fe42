"""The controller's gRPC surface against hostile input: undecodable requests answer INVALID_ARGUMENT,
no error echoes a large input, and a job token cannot repoint a rank that has already joined."""

from __future__ import annotations

import grpc
import pytest
from ctl_helpers import ADMIN, job, node, star_switch

from luwu.controller.client import ControllerClient, ControllerRefused
from luwu.controller.grpc_surface import MAX_DETAIL, MAX_ECHO, clip
from luwu.proto import controller_pb2 as pb

BIG = 1 << 20  # a 1 MB string


def raw_call(address: str, method: str, payload: bytes) -> grpc.RpcError:
    """Send `payload` as the raw request bytes of `method`; return the error it gets."""
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 8 << 20)]) as channel:
        call = channel.unary_unary(f"/luwu.v1.Controller/{method}", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            call(payload, metadata=[("authorization", f"Bearer {ADMIN}")], timeout=20)
    return err.value


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\x05abc", b"\x0a\x02\xc3\x28"],
                         ids=["garbage", "truncated", "bad-utf8"])
def test_undecodable_request_is_invalid_argument(controller, payload):
    bc, _ = controller
    err = raw_call(bc.address, "GetJob", payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid luwu.v1.GetJobRequest" in err.details()


def test_undecodable_stream_request_is_invalid_argument(controller):
    bc, _ = controller
    with grpc.insecure_channel(bc.address) as channel:
        call = channel.unary_stream("/luwu.v1.Controller/WatchJob", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(call(b"\xff\xff\xff", metadata=[("authorization", f"Bearer {ADMIN}")], timeout=20))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("method,request_", [
    ("GetJob", pb.GetJobRequest(job_id="j" * BIG)),
    ("DrainNode", pb.DrainNodeRequest(name="n" * BIG)),
    ("RegisterNode", pb.RegisterNodeRequest(node=pb.Node(name="x", data_address="h" * BIG))),
    ("CreateJob", pb.CreateJobRequest(job=pb.Job(name="a b " * (BIG // 4), num_workers=2))),
])
def test_errors_never_echo_large_inputs(controller, method, request_):
    bc, _ = controller
    err = raw_call(bc.address, method, request_.SerializeToString())
    assert err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
    assert 0 < len(err.details()) <= MAX_DETAIL
    assert max(len(w) for w in err.details().split()) <= MAX_ECHO


def test_clip_keeps_short_messages_whole():
    msg = "no job 'abc': `luwu-ctl jobs` lists them"
    assert clip(msg) == msg
    assert clip("x" * 500) == "x" * (MAX_ECHO - 3) + "..."


def test_job_token_cannot_repoint_a_joined_rank(controller, fake_switch):
    bc, admin = controller
    _, address = fake_switch()
    admin.register_node(node("n0"))
    admin.register_switch(star_switch("s1", address, 2, ["n0"]))
    created, token = admin.create_job(job("a", 2, [100]))
    with ControllerClient(bc.address, token) as worker:
        worker.join_job(created.job_id, 0, "127.0.0.1:9100")
        worker.join_job(created.job_id, 0, "127.0.0.1:9100")  # a retry from the same address is fine
        with pytest.raises(ControllerRefused) as err:
            worker.join_job(created.job_id, 0, "10.6.6.6:9100")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "already joined from 127.0.0.1:9100" in err.value.message
    plan = bc.server.core.store.job(created.job_id)
    assert plan.joined == {0: "127.0.0.1:9100"}
    endpoints = [e for e in bc.server.core.desired("s1").entries if e.table == "endpoints" and e.match["dst"] == 0]
    assert endpoints and all(e.action_params["dst_udp"] == 9100 and e.action_params["dst_ip"] == 0x7F000001 for e in endpoints)
    admin.join_job(created.job_id, 0, "127.0.0.1:9200")  # the admin may move a rank (operator recovery)
    assert bc.server.core.store.job(created.job_id).joined == {0: "127.0.0.1:9200"}
