"""The controller dies (SIGKILL of a real `luwu controller` process) under a running job: every rank
is warned within seconds, naming the controller and its address, and the job goes on without it
(docs/protocol.md 7.5: the data path never needs the controller); what does need it (JoinJob, here
through a new process group) fails naming it; a frozen controller (SIGSTOP: a host that dies
without closing its sockets) is named too, by the stream's keepalive.

Real parts: the controller process, a software switch serving P4Runtime (the controller programs
it), rank processes running init_process_group("luwu"). No timed assertions: seconds are printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "backend"))  # the rank harness of the backend tests
from backend_harness import run_ranks

ADMIN = "controller-death-admin"
LANES = 64
WAIT_BOUND = 60.0  # s any wait here may take (the contract is 10 s; the machine is shared)
FLAGS_ENV = "LUWU_TEST_FLAGS"


def _wait_file(path: Path, bound: float = WAIT_BOUND, alive=lambda: True) -> str:
    deadline = time.monotonic() + bound
    while not path.exists():
        if time.monotonic() > deadline or not alive():
            raise TimeoutError(f"{path} did not appear within {bound} s")
        time.sleep(0.05)
    time.sleep(0.05)  # the writer's write lands after its create
    return path.read_text()


def rank_through_controller_death(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    flags = Path(os.environ[FLAGS_ENV])
    pg = dist.distributed_c10d._get_default_group()
    watch = pg._lease.watch
    before = torch.full((500,), float(rank + 1))
    dist.all_reduce(before)
    (flags / f"ready{rank}").write_text("1")
    killed_at = float(_wait_file(flags / "killed"))
    deadline = time.monotonic() + WAIT_BOUND
    while watch.state != "lost" and time.monotonic() < deadline:
        time.sleep(0.05)
    lost = [e for e in watch.events if e[1] == "lost"]
    after = torch.arange(300, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(after)  # the job goes on: the switch holds its tables
    try:
        dist.new_group([0, 1])  # JoinJob: needs the controller
        needs = "new_group succeeded"
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        needs = f"{type(e).__name__}: {e}"
    return {"state": watch.state, "lost": lost, "killed_at": killed_at, "before": before.numpy(),
            "after": after.numpy(), "needs": needs, "note": pg._lease.controller_note()}


@pytest.fixture
def controller_and_switch(tmp_path):
    """A `luwu controller` process with a software switch registered and programmed; yields
    (process, address); the switch and whatever is left of the controller are stopped at the end."""
    from luwu.controller.client import ControllerClient, ControllerUnreachable, software_switch_record
    from luwu.dataplane.loopback import free_udp_port
    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig
    from luwu.dataplane.switch.p4runtime_server import serve
    from luwu.p4 import P4INFO_TXTPB

    token = tmp_path / "token"
    token.write_text(ADMIN)
    address = f"127.0.0.1:{free_udp_port()}"  # a free port number (TCP and UDP share the range here)
    with open(tmp_path / "controller.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([str(Path(sys.executable).parent / "luwu"), "controller", "--listen", address, "--db",
                                 str(tmp_path / "c.sqlite"), "--token-file", str(token), "--health-timeout", "60"],
                                stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, OMP_NUM_THREADS="1"))
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=1024))
    handle = serve(sw, "127.0.0.1:0", P4INFO_TXTPB, device_id=0)
    for port in (1, 2):
        sw.attach_udp(port, ("127.0.0.1", 0))
    sw.start()
    try:
        admin = ControllerClient(address, ADMIN, timeout=10)
        for _ in range(300):  # bounded wait for the controller to answer
            try:
                admin.status()
                break
            except ControllerUnreachable:
                assert proc.poll() is None, (tmp_path / "controller.log").read_text()
                time.sleep(0.1)
        admin.register_switch(software_switch_record(sw, "star", handle.address))
        yield proc, address, admin
        admin.close()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()
        sw.stop()
        handle.stop()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_ranks_name_a_dead_controller_and_train_on(tmp_path, controller_and_switch, how):
    from luwu.proto import controller_pb2 as pb

    proc, address, admin = controller_and_switch
    job, token = admin.create_job(pb.Job(name="ddp", num_workers=2, packet_mode=str(LANES), num_nodes=0))
    flags = tmp_path / "flags"
    flags.mkdir()
    # eager start: new_group itself joins through the controller (deferred, its first operation would)
    env = {"LUWU_CONTROLLER": address, "LUWU_JOB": job.job_id, "LUWU_TOKEN": token, "LUWU_ENGINE": "embedded",
           "LUWU_EAGER_START": "1", FLAGS_ENV: str(flags)}
    out: dict = {}

    def run():
        try:
            out["r"] = run_ranks(rank_through_controller_death, 2, tmp_path, env=env)
        except AssertionError as e:  # a rank failed: its traceback
            out["error"] = str(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        for rank in (0, 1):
            _wait_file(flags / f"ready{rank}", 120, runner.is_alive)
    except TimeoutError:
        runner.join(30)
        raise AssertionError(f"the ranks did not get ready: {out}") from None
    killed_at = time.time()
    os.kill(proc.pid, getattr(signal, how))
    (flags / "killed").write_text(repr(killed_at))
    runner.join(180)
    assert "r" in out, out.get("error", "the ranks did not finish")
    for rank, res in enumerate(out["r"]):
        assert res["state"] == "lost", res
        assert len(res["lost"]) == 1, res
        (at, _, message), = res["lost"]
        assert f"the controller {address} that planned job {job.job_id} stopped answering" in message, message
        assert "keeps running" in message
        assert f"The controller {address}" in res["note"], res["note"]
        np.testing.assert_array_equal(res["before"], np.full(500, 3.0, np.float32))
        np.testing.assert_array_equal(res["after"], np.arange(300, dtype=np.float32) * 3)
        assert f"luwu controller at {address}" in res["needs"], res["needs"]
        print(f"{how}: rank {rank} named the controller {at - res['killed_at']:.2f} s after the signal: {message}")
