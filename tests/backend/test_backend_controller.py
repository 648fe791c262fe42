"""The controller plan source: with LUWU_CONTROLLER, LUWU_JOB and LUWU_TOKEN set, every rank joins the
controller's job (JoinJob) and allreduces through the software switch the controller programmed.

A real controller (in this process), a real software switch serving P4Runtime with one UDP port per
worker, and real rank processes running init_process_group("luwu")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

pytest.importorskip("luwu.controller.server")

ADMIN = "backend-test-admin"
LANES = 64


def allreduce_on_rank(rank: int, world: int) -> dict:
    pg = dist.distributed_c10d._get_default_group()
    t = torch.arange(300, dtype=torch.int32) * (rank + 1)
    dist.all_reduce(t)
    f = torch.full((200,), 0.25 * (rank + 1))
    dist.all_reduce(f)
    return {"source": pg.plan_source, "ints": t.numpy(), "floats": f.numpy()}


def test_ranks_join_the_controllers_job(tmp_path):
    from luwu.controller.client import ControllerClient, software_switch_record
    from luwu.controller.config import ControllerConfig
    from luwu.controller.server import BackgroundController
    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig
    from luwu.dataplane.switch.p4runtime_server import serve
    from luwu.p4 import P4INFO_TXTPB
    from luwu.proto import controller_pb2 as pb

    world = 2
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=1024))
    handle = serve(sw, "127.0.0.1:0", P4INFO_TXTPB, device_id=0)
    for port in range(1, world + 1):
        sw.attach_udp(port, ("127.0.0.1", 0))
    sw.start()
    bc = BackgroundController(ControllerConfig(listen="127.0.0.1:0", db=str(tmp_path / "c.sqlite"), admin_token=ADMIN,
                                               p4info=str(P4INFO_TXTPB), health_timeout=60.0, program_timeout=15.0))
    try:
        with ControllerClient(bc.address, ADMIN) as admin:
            rec = software_switch_record(sw, "star", handle.address)
            assert admin.register_switch(rec).message == "registered and programmed"
            job, token = admin.create_job(pb.Job(name="ddp", num_workers=world, packet_mode=str(LANES), num_nodes=0))
            env = {"LUWU_CONTROLLER": bc.address, "LUWU_JOB": job.job_id, "LUWU_TOKEN": token,
                   "LUWU_ENGINE": "embedded"}
            results = run_ranks(allreduce_on_rank, world, tmp_path, env=env)
            assert admin.job(job.job_id).state == pb.RUNNING
    finally:
        bc.stop()
        sw.stop()
        handle.stop()
    for res in results:
        assert res["source"] == f"controller {bc.address}, job {job.job_id}"
        np.testing.assert_array_equal(res["ints"], np.arange(300, dtype=np.int32) * 3)
        np.testing.assert_array_equal(res["floats"], np.full(200, 0.75, np.float32))


def test_controller_that_is_down_is_named():
    import socket

    from luwu.worker.backend.config import BackendConfig
    from luwu.worker.backend.plan_source import plan_from_controller

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = BackendConfig(controller=dead, job="job-x")
    with pytest.raises(ConnectionError, match=f"cannot reach the luwu controller at {dead}"):
        plan_from_controller(0, 2, cfg)
