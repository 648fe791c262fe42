"""The optimizer node's control channel admits only authenticated clients and bounds what one
connection may claim and hold: hello first (with the job's token), sizes checked before anything is
allocated, few connections at once before the hello (the oldest evicted, never the newcomer), and a
hello deadline. The abuse cases (silent connections, large claims, idle and too many authenticated
connections, threads) are in test_optimizer_control_abuse.py."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.dataplane.optimizer import JobSpec, LayerSpec, NodeConfig, OptimizerSpec
from luwu.dataplane.optimizer.control import ControlAuth, ControlClient, ControlError, recv_msg
from luwu.dataplane.optimizer.control_server import ControlLimits, ControlServer
from luwu.dataplane.optimizer.service import OptimizerService

NODE_TOKEN = "node-control-token"
JOB_TOKENS = {"job-a": "token-of-a", "job-b": "token-of-b"}  # what the controller would confirm
HALF_GIB = 512 << 20


def verify(job_id: str, token: str) -> bool:
    return JOB_TOKENS.get(job_id) == token


@pytest.fixture
def server(tmp_path):
    """factory(**kw) -> a running ControlServer answering {"echo": op, "job": grant} (stopped at teardown)."""
    servers = []

    def make(auth=None, **limits):
        srv = ControlServer(f"unix:{tmp_path}/ctl{len(servers)}.sock",
                            lambda h, b, g: {"echo": h.get("op"), "job": g.job_id if g else None,
                                             "bytes": sum(len(x) for x in b)},
                            auth=auth or ControlAuth(token=NODE_TOKEN, verify=verify),
                            limits=ControlLimits(**limits)).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


def raw(address: str, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(address[len("unix:"):])
    return s


def claim(sock: socket.socket, blob_bytes: int, op: str = "add_job") -> None:
    """Send a header that claims a blob of `blob_bytes`, and never the blob."""
    header = json.dumps({"op": op, "blobs": [blob_bytes]}).encode()
    sock.sendall(struct.pack("!I", len(header)) + header)


def closed_with(sock: socket.socket) -> str:
    """The error the server answered before closing the connection ('' if it just closed)."""
    try:
        reply, _ = recv_msg(sock)
    except (ConnectionError, OSError):
        return ""
    assert reply["ok"] is False
    assert sock.recv(1) == b""  # and then closed
    return reply["error"]


def test_requests_without_hello_are_refused(server):
    srv = server()
    plain = ControlClient(srv.address)  # no token: sends its request as the first message
    try:
        with pytest.raises(ControlError, match="first control message must be"):
            plain.stats()
    finally:
        plain.close()
    for job_id, token in (("job-a", "wrong"), ("job-a", JOB_TOKENS["job-b"]), ("", "")):
        with pytest.raises(ControlError, match="first control message must be"):
            ControlClient(srv.address, token=token or "x", job_id=job_id)
    assert srv.refused["handshake"] == 4


def test_job_token_and_node_token(server):
    srv = server()
    with_job = ControlClient(srv.address, token=JOB_TOKENS["job-a"], job_id="job-a")
    node = ControlClient(srv.address, token=NODE_TOKEN)
    try:
        assert with_job.call({"op": "stats"})["job"] == "job-a"
        assert node.call({"op": "stats"})["job"] is None  # every job
    finally:
        with_job.close()
        node.close()


def test_idle_connections_claiming_large_blobs_pin_nothing(server):
    srv = server(max_message=1 << 20)
    socks = [raw(srv.address) for _ in range(4)]
    try:
        for s in socks:  # four connections each claiming 512 MiB before saying hello
            claim(s, HALF_GIB)
        for s in socks:
            assert "control handshake failed" in closed_with(s)
        assert srv.refused["too_large"] == 4
        # an authenticated client is bounded too: the claim is refused before allocation, and the connection goes
        good = ControlClient(srv.address, token=NODE_TOKEN)
        claim(good.sock, HALF_GIB)
        assert "larger than this node accepts" in closed_with(good.sock)
        good.close()
        assert srv._in_flight == 0
    finally:
        for s in socks:
            s.close()


def test_blobs_in_flight_are_bounded_across_connections(server):
    srv = server(max_message=1 << 20)
    slow = ControlClient(srv.address, token=NODE_TOKEN)
    other = ControlClient(srv.address, token=NODE_TOKEN)
    try:
        claim(slow.sock, 800 << 10)  # claims 800 KiB of the 1 MiB budget, sends 1 byte, stalls
        slow.sock.sendall(b"x")
        for _ in range(200):  # bounded: wait until the server has reserved the claim
            if srv._in_flight:
                break
            threading.Event().wait(0.02)
        assert srv._in_flight == 800 << 10
        claim(other.sock, 400 << 10)
        assert "retry later" in closed_with(other.sock)
        slow.sock.sendall(bytes((800 << 10) - 1))  # the stalled message completes and is answered
        reply, _ = recv_msg(slow.sock)
        assert (reply["ok"], reply["echo"], reply["bytes"]) == (True, "add_job", 800 << 10)
        assert srv._in_flight == 0
    finally:
        slow.close()
        other.close()


def test_unauthenticated_connections_are_few_and_short_lived(server):
    srv = server(max_unauthenticated=2, max_unauthenticated_per_peer=2, hello_timeout=0.5)
    idle = [raw(srv.address) for _ in range(2)]  # hold both slots without a hello
    try:
        client = ControlClient(srv.address, token=NODE_TOKEN)  # evicts the oldest, gets through at once
        assert client.call({"op": "stats"})["echo"] == "stats"
        client.close()
        assert "evicted: too many unauthenticated control connections" in closed_with(idle[0])
        assert "no hello within 0.5 s" in closed_with(idle[1])  # the hello deadline closes the other
        assert srv.refused["evicted"] == 1 and srv.refused["handshake"] == 1
    finally:
        for s in idle:
            s.close()


def test_a_job_token_adds_only_its_own_job(tmp_path):
    opt = OptimizerSpec("adamw", lr=0.01)
    layers = [LayerSpec(0, {"w": (4, 3)}, frozenset())]
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=64, param_window=64)
    with LoopbackSwitch(plan, seed=1):
        service = OptimizerService(plan.node_plan(0), NodeConfig(state_dir=tmp_path / "state", ram_budget=16 << 20))
        service.start(control=f"unix:{tmp_path}/node.sock", auth=ControlAuth(token=NODE_TOKEN, verify=verify))
        try:
            client = ControlClient(service.control.address, token=JOB_TOKENS["job-a"], job_id="job-a")
            with pytest.raises(ControlError, match="cannot add job 'job-b'"):
                client.add_job(plan.node_session(0), 2, JobSpec("job-b", opt, layers).to_json(), initial=0)
            assert "job-b" not in service.node.jobs
            assert client.add_job(plan.node_session(0), 2, JobSpec("job-a", opt, layers).to_json(),
                                  initial=0)["job_id"] == "job-a"
            client.close()
            with pytest.raises(ControlError, match="first control message must be"):
                ControlClient(service.control.address).add_job(plan.node_session(0), 2,
                                                               JobSpec("job-a", opt, layers).to_json(), initial=0)
        finally:
            service.close()


def test_node_daemon_refuses_an_open_control_channel(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    plan = StarPlan(workers=2, nodes=1, mode="tofino")
    with LoopbackSwitch(plan, seed=1):
        (tmp_path / "plan.json").write_text(plan.node_plan(0).to_json())
    proc = subprocess.run([str(Path(sys.executable).parent / "luwu"), "node", "--plan", str(tmp_path / "plan.json"),
                           "--state-dir", str(tmp_path / "s"), "--control", f"unix:{tmp_path}/c.sock"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--control needs --control-token-file FILE or --controller" in lines[0], proc.stderr
