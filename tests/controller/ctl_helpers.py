"""Helpers shared by the controller tests: constants, free ports, registration builders and a
`luwu controller` subprocess. (A uniquely named module: test folders share no `conftest` import.)"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from luwu.controller.client import ControllerClient, ControllerUnreachable
from luwu.proto import controller_pb2 as pb

ADMIN = "test-admin-token"
LANES = 64  # tofino mode: small packets keep the functional checks cheap
SLOTS = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def star_switch(name: str, address: str, workers: int, nodes: list[str], lanes: int = LANES,
                slots: int = SLOTS) -> pb.Switch:
    sw = pb.Switch(name=name, p4runtime_address=address, device_id=0, target="software", lanes=lanes, slots=slots,
                   role=pb.STAR)
    for i in range(workers):
        sw.ports.add(number=i + 1, peer_kind=pb.PEER_WORKER, udp_address=f"127.0.0.1:{free_port()}")
    for j, node in enumerate(nodes):
        sw.ports.add(number=workers + 1 + j, peer_kind=pb.PEER_NODE, peer=node, udp_address=f"127.0.0.1:{free_port()}")
    return sw


def two_tier(tor_address: str, spine_address: str, workers: int, nodes: list[str]) -> tuple[pb.Switch, pb.Switch]:
    """tor0 (workers on ports 1..W, uplink W+1) under spine (tor0 on port 1, nodes on 2..)."""
    tor = pb.Switch(name="tor0", p4runtime_address=tor_address, device_id=0, target="software", lanes=LANES,
                    slots=SLOTS, role=pb.TOR)
    for i in range(workers):
        tor.ports.add(number=i + 1, peer_kind=pb.PEER_WORKER, udp_address=f"127.0.0.1:{free_port()}")
    tor.ports.add(number=workers + 1, peer_kind=pb.PEER_SWITCH, peer="spine", peer_port=1)
    spine = pb.Switch(name="spine", p4runtime_address=spine_address, device_id=0, target="software", lanes=LANES,
                      slots=SLOTS, role=pb.CLUSTER)
    spine.ports.add(number=1, peer_kind=pb.PEER_SWITCH, peer="tor0", peer_port=workers + 1)
    for j, node in enumerate(nodes):
        spine.ports.add(number=2 + j, peer_kind=pb.PEER_NODE, peer=node, udp_address=f"127.0.0.1:{free_port()}")
    return tor, spine


def node(name: str, params_per_second: float = 1e6) -> pb.Node:
    return pb.Node(name=name, data_address=f"127.0.0.1:{free_port()}",
                   capacity=pb.NodeCapacity(params_per_second=params_per_second, ram_bytes=2**30, disk_bytes=2**34))


def job(name: str, workers: int, layers: list[int], nodes: int = 1, **kw) -> pb.Job:
    return pb.Job(name=name, num_workers=workers, packet_mode=str(LANES), num_nodes=nodes,
                  layers=[pb.LayerSpec(layer_id=i, numel=n) for i, n in enumerate(layers)], **kw)


@contextlib.contextmanager
def controller_process(db: Path, token_file: Path, p4info: Path, port: int | None = None, extra: tuple = ()):
    """`luwu controller` (plus `extra` options) as a subprocess; yields (Popen, address). Killed (SIGKILL) at exit
    if alive."""
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    luwu = Path(sys.executable).parent / "luwu"  # the installed entry point (never `python -m` from the repo)
    proc = subprocess.Popen([str(luwu), "controller", "--listen", address, "--db", str(db), "--token-file",
                             str(token_file), "--p4info", str(p4info), "--health-timeout", "60", *extra],
                            env=env, cwd=db.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = ControllerClient(address, token_file.read_text().strip(), timeout=5)
        for _ in range(200):  # bounded wait for the server to answer
            if proc.poll() is not None:
                raise RuntimeError(f"luwu controller exited early:\n{proc.stdout.read()}")
            try:
                client.status()
                break
            except ControllerUnreachable:
                time.sleep(0.1)
        else:
            raise RuntimeError("luwu controller did not answer within 200 attempts")
        client.close()
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
