"""The BMv2 runner's port plumbing, checked without BMv2: veth pairs, the hosts' namespace,
AF_PACKET send/capture and cleanup, with a tiny in-test "switch" that copies frames from the
switch end of port 1 to the switch end of port 2."""

from __future__ import annotations

import os
import select
import subprocess
import threading

import pytest
from bmv2_harness import ETH_P_ALL, PACKET_OUTGOING, Ports, packet_socket
from conformance_frames import frame_in, luwu_layer
from conformance_topology import WORKERS

pytestmark = pytest.mark.netns

if os.geteuid() != 0:
    pytest.skip("needs root for veth pairs and a network namespace", allow_module_level=True)

ROUNDS = 50  # bound on the copier's select loop


def _copier(ports: Ports, stop: threading.Event) -> threading.Thread:
    src = packet_socket()
    src.bind((ports.switch_if(1), ETH_P_ALL))
    dst = packet_socket()
    dst.bind((ports.switch_if(2), ETH_P_ALL))

    def run():
        try:
            for _ in range(ROUNDS):
                if stop.is_set():
                    return
                if select.select([src], [], [], 0.1)[0]:
                    data, addr = src.recvfrom(65536)
                    if addr[2] != PACKET_OUTGOING:
                        dst.send(data)
        finally:
            src.close()
            dst.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_exchange_and_cleanup():
    ports = Ports(2)
    stop = threading.Event()
    try:
        t = _copier(ports, stop)
        frame = frame_in(WORKERS[0], luwu_layer(7, 3, 0, count=1), bytes(12))
        got = ports.exchange(1, frame, expect=1)
        assert got == [(2, frame)]
        assert ports.exchange(2, frame, expect=0) == []  # nothing copies port 2 back
        stop.set()
        t.join(5)
    finally:
        ports.close()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert ports.switch_if(1) not in links and ports.switch_if(2) not in links
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert ports.ns not in namespaces
