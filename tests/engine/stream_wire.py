"""What the send-stream tests share: a real loopback UDP pair (a `BatchSocket` sending to a plain
socket the test reads) and a fill that numbers each packet, so a test can see which packets went
out, in which order, and with which flags."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.protocol import Flag

ROW = 64


@contextmanager
def udp_wire() -> Iterator[tuple[BatchSocket, socket.socket]]:
    """(sender, receiver): the sender's default peer is the receiver (5 s receive timeout)."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)
    tx = BatchSocket(udp_socket(), batch=16, max_len=ROW, peers=1)
    tx.set_peer(0, *rx.getsockname())
    tx.default_peer = 0
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()


def fill_indexed(i0: int, i1: int, rows: np.ndarray, lens: np.ndarray) -> None:
    """A segment fill: packet i carries i in byte 4 (to recognise it on the wire)."""
    rows[:] = 0
    rows[:, 4] = np.arange(i0, i1)
    lens[:] = ROW


def on_wire(rx: socket.socket, k: int) -> tuple[list[int], list[bool]]:
    """The next k packets' indices and whether each carries RETX."""
    pkts = [rx.recv(ROW) for _ in range(k)]
    return [p[4] for p in pkts], [bool(p[1] & int(Flag.RETX)) for p in pkts]
