"""The engine's transport seam: how an endpoint's packets reach its switch port.

Both transports have the shape the engine and its sessions use: `recv()` fills `rx[:k]` and
`rx_len[:k]`, valid until the next `recv()` (the shm endpoint's `rx` is the ring's own rows,
lent until then or until `arm()`); `send_rows(buf, idx, lengths)` sends rows of a buffer; `fd` is what the engine's
poll() waits on; `stats` counts packets; `close()`. The window, retransmission and session logic
above never sees which one it has.

* `Wiring.transport` "udp" / "ip": a `BatchSocket` (recvmmsg/sendmmsg) sending to the switch's
  address, with the kernel's ICMP reports enabled so a vanished switch port is noticed.
* "shm": a `ShmEndpoint` on the switch port's shared-memory rings (`Wiring.switch[0]` is the
  ring pair's path prefix), for a switch on the same host.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..net.mmsg import BatchSocket, udp_socket
from ..net.shm_endpoint import ShmEndpoint
from ..session import Wiring
from .liveness import enable_error_reports


def open_transport(wiring: Wiring, batch: int, max_len: int, socket_buffer: int) -> BatchSocket | ShmEndpoint:
    """The endpoint side of `wiring`: a shared-memory endpoint or a UDP socket aimed at the switch."""
    if wiring.transport == "shm":
        return ShmEndpoint(wiring.switch[0], batch=batch)
    sock = udp_socket(wiring.local[0], wiring.local[1], socket_buffer, socket_buffer)
    enable_error_reports(sock)
    out = BatchSocket(sock, batch=batch, max_len=max_len, peers=1)
    out.set_peer(0, wiring.switch[0], wiring.switch[1])
    out.default_peer = 0
    return out


def packet_sender(sock) -> Callable[[bytes], object]:
    """How to send one packet given as bytes on `sock`: the shm endpoint's `send_packet` (no numpy
    row, no batch bookkeeping: heartbeats and PULLs go one at a time), else `send_rows` of a row."""
    fast = getattr(sock, "send_packet", None)
    if fast is not None:
        return fast

    def send(data: bytes) -> object:
        return sock.send_rows(np.frombuffer(bytearray(data), dtype=np.uint8)[None], [0], [len(data)])

    return send


def switch_name(wiring: Wiring) -> str:
    """How errors name the switch: its port's address, or its shared-memory port."""
    if wiring.transport == "shm":
        return f"port {wiring.switch_port} over shared memory ({wiring.switch[0]})"
    return f"{wiring.switch[0]}:{wiring.switch[1]}"
