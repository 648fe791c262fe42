"""The node acknowledges a layer's gradient as soon as it is whole (dataplane/engine/node_server.py
`on_agg`), not at the next heartbeat interval.

A worker's push completes on the node's acknowledgement of its last packet, and `step()` waits for
its last push: a gradient shorter than a quarter window (the other reason to acknowledge) waited for
the interval, on the training step's critical path. A real `NodeServerSession` on a loopback UDP
socket with an explicit clock: the heartbeats it sends are read off the socket.
"""

from __future__ import annotations

import socket

import numpy as np

from luwu.dataplane.engine.heartbeats import HeartbeatPolicy
from luwu.dataplane.engine.node_server import NodeServerSession
from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy
from luwu.dataplane.integrity import check_words_rows
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.protocol import HEADER_LEN, HEARTBEAT_HEADER, Dtype, MsgType, header_view, ver_type
from luwu.dataplane.session import SessionSpec

LANES = 64
DATA = LANES - 2  # gradient elements per AGG: the last 2 lanes are its check words (docs/protocol.md 3.6)
POLICY = HeartbeatPolicy(interval=0.006, keepalive=0.1, min_gap=0.0005)


class _Provider:
    def lookup(self, tensor: int, version: int):
        return None


def _agg_rows(tensor: int, seqs: list[int], chunks: int, first: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The switch's AGG packets of one tensor of `chunks` chunks: seq `seqs[i]` carries chunk
    `first + i` (`first` defaults to seqs[0]), with the check words of a sum of two."""
    first = seqs[0] if first is None else first
    rows = np.zeros((len(seqs), HEADER_LEN + 4 * LANES), dtype=np.uint8)
    h = header_view(rows)
    h["ver_type"] = ver_type(MsgType.AGG)
    h["session"] = 3
    h["seq"] = seqs
    h["tensor"] = tensor
    h["offset"] = [(s_ - seqs[0] + first) * DATA for s_ in seqs]
    h["count"] = DATA
    h["numel"] = chunks * DATA
    h["dtype"] = int(Dtype.FIXED32)
    h["exponent"] = -20
    lanes = rows[:, HEADER_LEN:].view(">i4")
    lanes[:, :DATA] = 1 << 10
    lanes[:, DATA:] = check_words_rows(lanes[:, :DATA], h, int(Dtype.FIXED32), 2).astype(np.uint32).view(np.int32)
    return rows, h


def _heartbeats(rx: socket.socket) -> list[int]:
    """The acks of every heartbeat waiting on `rx`."""
    acks = []
    while True:
        try:
            data = rx.recv(4096)
        except BlockingIOError:
            return acks
        acks.append(int(np.frombuffer(data[:HEADER_LEN], dtype=HEARTBEAT_HEADER)[0]["ack"]))


def test_a_whole_gradient_is_acknowledged_after_min_gap_not_the_interval():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = BatchSocket(udp_socket(), batch=16, max_len=HEADER_LEN + 4 * LANES, peers=1)
    tx.set_peer(0, *rx.getsockname())
    tx.default_peer = 0
    got: list[tuple[int, np.ndarray]] = []
    try:
        spec = SessionSpec(session=3, kind="node", epoch=1, pool_base=0, pool_size=64, num_workers=2, lanes=LANES,
                           param_window=64, node_rank=0)
        s = NodeServerSession(spec, tx, RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01, maximum=1.0)), POLICY,
                              now=0.0)
        s.bind(_Provider(), lambda t, g, sat: got.append((t, g.copy())))
        s.pump(now=0.0)  # the first heartbeat (nothing acknowledged yet)
        assert _heartbeats(rx) == [0]

        # half of a two-chunk gradient (well under a quarter window): no reason to tell anyone yet
        rows, h = _agg_rows(tensor=5, seqs=[0], chunks=2)
        s.on_agg(np.arange(1), rows, h, now=0.0001)
        s.pump(now=0.001)
        assert _heartbeats(rx) == []
        assert got == []

        # its second half: the gradient is whole, and its sender's push waits for this acknowledgement
        rows, h = _agg_rows(tensor=5, seqs=[1], chunks=2)
        s.on_agg(np.arange(1), rows, h, now=0.0011)
        assert [t for t, _ in got] == [5]
        s.pump(now=0.0012)  # past min_gap since the last heartbeat, long before the interval
        assert _heartbeats(rx) == [2], "a whole gradient must be acknowledged at once, not at the next interval"
        # and nothing more until something new arrives (or the interval or keepalive passes)
        s.pump(now=0.002)
        assert _heartbeats(rx) == []
    finally:
        tx.close()
        rx.close()
