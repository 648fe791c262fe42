"""The engine's transport seam: how an endpoint's packets reach its switch port.

What a transport is lives in `luwu.dataplane.net.transport` (`Transport`): `recv()` fills
`rx[:k]` and `rx_len[:k]`, valid until the next `recv()` (the shm endpoint's `rx` is the ring's
own rows, lent until then or until `arm()`); `send_rows(buf, idx, lengths)` sends rows of a
buffer, `send_packet(data)` one packet; `fd` is what the engine's poll() waits on (after `arm()`
where `doorbell` says so); `stats` counts packets; `close()`. The engine, its window,
retransmission and session logic never see which kind they have; `open_transport` is the one
place that chooses, from `Wiring.transport`:

* "udp" / "ip": a `BatchSocket` (recvmmsg/sendmmsg) sending to the switch's address, with the
  kernel's ICMP reports enabled so a vanished switch port is noticed (`drain_errors`).
* "shm": a `ShmEndpoint` on the switch port's shared-memory rings (`Wiring.switch[0]` is the
  ring pair's path prefix), for a switch on the same host.
"""

from __future__ import annotations

from collections.abc import Callable

from ..net.transport import Transport, shm_transport, udp_transport
from ..session import Wiring


def open_transport(wiring: Wiring, batch: int, max_len: int, socket_buffer: int) -> Transport:
    """The endpoint side of `wiring`: a shared-memory endpoint or a UDP socket aimed at the switch."""
    if wiring.transport == "shm":
        return shm_transport(wiring.switch[0], batch=batch)
    return udp_transport(wiring.local, wiring.switch, batch=batch, max_len=max_len, socket_buffer=socket_buffer)


def packet_sender(sock: Transport) -> Callable[[bytes], object]:
    """How to send one packet given as bytes on `sock` (heartbeats and PULLs go one at a time)."""
    return sock.send_packet


def switch_name(wiring: Wiring) -> str:
    """How errors name the switch: its port's address, or its shared-memory port."""
    if wiring.transport == "shm":
        return f"port {wiring.switch_port} over shared memory ({wiring.switch[0]})"
    return f"{wiring.switch[0]}:{wiring.switch[1]}"
