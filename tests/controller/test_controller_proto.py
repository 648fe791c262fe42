"""The committed stubs are what proto/generate.py makes from controller.proto, and import package-qualified."""

from __future__ import annotations

from pathlib import Path

import pytest

import luwu.proto
from luwu.proto import controller_pb2, controller_pb2_grpc

PROTO_DIR = Path(luwu.proto.__file__).resolve().parent


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) is needed to regenerate the stubs")
    from importlib import util

    spec = util.spec_from_file_location("luwu_proto_generate", PROTO_DIR / "generate.py")
    generate = util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == set(generate.OUTPUTS)
    for path in written:
        committed = (PROTO_DIR / path.name).read_text()
        assert path.read_text() == committed, f"{path.name} is stale: run `python proto/generate.py` and commit"


def test_stubs_are_package_qualified_and_versioned():
    grpc_source = (PROTO_DIR / "controller_pb2_grpc.py").read_text()
    assert "from luwu.proto import controller_pb2" in grpc_source
    assert controller_pb2.DESCRIPTOR.package == "luwu.v1"
    service = controller_pb2.DESCRIPTOR.services_by_name["Controller"]
    methods = {m.name for m in service.methods}
    assert {"RegisterSwitch", "DeregisterSwitch", "RegisterNode", "DeregisterNode", "CreateJob", "JoinJob", "GetJob",
            "ListJobs", "EndJob", "GetPlan", "ReportHealth", "GetCounters", "ListSwitches", "ListNodes", "DrainNode",
            "Status", "WatchJob"} <= methods
    assert service.methods_by_name["WatchJob"].server_streaming
    assert hasattr(controller_pb2_grpc, "ControllerStub")


def test_finsy_and_controller_protos_load_in_one_process():
    import finsy  # noqa: F401  (its google/rpc/status.proto must not clash with ours)
    from finsy.proto import rpc_status

    assert rpc_status.Status(code=3).code == 3
    assert controller_pb2.Switch(name="s").name == "s"
