"""The node's side of a pull lets go of the served copy once the workers acknowledge it
(dataplane/engine/node_server.py `_serve`).

The parameter stream keeps acknowledged segments for a while (it compacts its list every 64),
and the optimizer node recycles a replaced copy's buffer only when nothing references it
(dataplane/optimizer/served.py): a copy held by an acknowledged segment made the node fault in a
fresh buffer for nearly every layer's next version. A real `NodeServerSession` on a loopback UDP
socket, acknowledged as the workers' merged heartbeat would, with an explicit clock.
"""

from __future__ import annotations

import gc
import socket
import weakref

import numpy as np

from luwu.dataplane.engine.heartbeats import HeartbeatPolicy
from luwu.dataplane.engine.node_server import NodeServerSession
from luwu.dataplane.engine.node_worker import elems_per_param_packet
from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.protocol import HEADER_LEN, Dtype
from luwu.dataplane.session import SessionSpec

LANES = 64


class _Provider:
    """Serves one float32 copy per tensor (the test keeps only a weak reference to it)."""

    def __init__(self, copies: dict[int, np.ndarray]):
        self.copies = copies

    def lookup(self, tensor: int, version: int):
        return self.copies[tensor], Dtype.FP32


def test_an_acknowledged_pull_no_longer_holds_its_served_copy():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx = BatchSocket(udp_socket(), batch=16, max_len=HEADER_LEN + 4 * LANES, peers=1)
    tx.set_peer(0, *rx.getsockname())
    tx.default_peer = 0
    try:
        spec = SessionSpec(session=3, kind="node", epoch=1, pool_base=0, pool_size=64, num_workers=2, lanes=LANES,
                           param_window=64, node_rank=0)
        s = NodeServerSession(spec, tx, RtoEstimator(RtoPolicy(initial=0.1, minimum=0.01, maximum=1.0)),
                              HeartbeatPolicy(), now=0.0)
        epp = elems_per_param_packet(LANES, Dtype.FP32)  # fp32 values per PARAM (its trailer takes a lane's room)
        copies = {t: np.arange(5 * epp, dtype=np.float32) + t for t in range(3)}
        refs = {t: weakref.ref(a) for t, a in copies.items()}
        s.bind(_Provider(copies), lambda *a: None)
        for pull_id, t in enumerate(copies):  # three pulls, five packets each, all sent
            s.waiting[pull_id] = (t, 0)
        s.retry_waiting()
        assert s.stats["pulls_served"] == 3
        assert s.pump(now=0.001) == 15
        del copies, s.provider.copies  # the node replaced them: only the stream may still hold them
        gc.collect()
        assert all(r() is not None for r in refs.values())  # unacknowledged: a resend needs them
        s.on_workers_heartbeat(ack=10, credit=64, now=0.002)  # the first two pulls got through
        gc.collect()
        assert refs[0]() is None and refs[1]() is None
        assert refs[2]() is not None
        s.on_workers_heartbeat(ack=15, credit=64, now=0.003)
        gc.collect()
        assert refs[2]() is None
    finally:
        tx.close()
        rx.close()
