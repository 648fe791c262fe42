"""Flow-control load on the optimizer node: per-packet ACKs against luwu's heartbeats.

With per-packet ACKs every worker acknowledges every parameter packet the node multicasts, so N
ACK frames arrive on the node's inbound link for each packet, beside the summed-gradient stream
that runs at the same packet rate during the backward pass. With heartbeats the switch keeps the
latest one per worker and sends the node their minimum once per interval, whatever N is
(docs/protocol.md). docs/simulator.md derives the goodput formula.
"""

from __future__ import annotations

from luwu.dataplane import protocol
from luwu.simulate.hardware import Config

HEARTBEAT_INTERVAL = 10e-6  # seconds between the switch's aggregated heartbeats to the node (modelled)


def node_goodput(cfg: Config, workers: int, scheme: str) -> float:
    """Bytes/s of gradient payload the node's inbound link carries under `scheme` ("ack" or
    "heartbeat") with `workers` workers, at the deployment's payload size."""
    p = cfg.net.payload
    data = p + protocol.HEADER_LEN + cfg.net.frame_overhead
    if scheme == "ack":
        return cfg.net.link * p / (data + workers * cfg.net.ack_frame)
    if scheme == "heartbeat":
        hb_share = cfg.net.ack_frame / (HEARTBEAT_INTERVAL * cfg.net.link)
        return cfg.net.link * (1 - hb_share) * p / data
    raise ValueError(f"unknown flow-control scheme {scheme!r}")
