"""What a transport is: the one interface every way of moving luwu packets implements, and the
factories that open each kind.

A transport moves datagrams in batches, with no Python step per packet. Three kinds exist:

| kind | what a datagram is | endpoint side (`Transport`) | switch side (`SwitchPort`) |
|---|---|---|---|
| "udp" | a luwu datagram in a UDP packet (recvmmsg/sendmmsg) | `mmsg.BatchSocket` (`udp_transport`) | `switch/attach_udp.py::UdpAttachment` |
| "raw" | a whole Ethernet frame on one interface (AF_PACKET) | `mmsg.BatchSocket` (`raw_transport`) | `switch/attach_raw.py::RawAttachment` |
| "shm" | a luwu datagram in a row of a /dev/shm ring (shm_ring.py) | `shm_endpoint.ShmEndpoint` (`shm_transport`) | `switch/attach_shm.py::ShmAttachment` |

Both interfaces are `typing.Protocol`s: a type that the classes above satisfy as they are, not a
wrapper layer (the engine calls `BatchSocket.recv` itself, bound once; nothing is added per batch
or per packet). mypy checks the endpoint classes against `Transport` (`_conforms` below);
tests/net/test_transport_conformance.py runs one test body over every kind.

* `Transport`, an endpoint's batched datagram channel (the engine's port to its switch): `recv()`
  lends `rx[:k]` / `rx_len[:k]` (until the next `recv()` or `arm()`), `send_rows()` sends rows of
  a buffer, `send_packet()` one packet given as bytes, `fd` is what poll() waits on (after
  `arm()`), `stats` counts packets and bytes, `close()` releases the socket or the mappings. The
  engine (dataplane/engine/transport.py::open_transport picks the kind from `Wiring.transport`)
  and its sessions see nothing else.
* `RowFill`, what a transport with sendable memory of its own adds (the shm endpoint writes
  packets straight into the up ring: docs/shared_memory.md "Zero-copy send").
* `SwitchPort`, a switch port's attachment. Receiving is not per port: the switch's event loop
  takes every port of a kind into one buffer per turn (recvmmsg on the ports' `fd`s,
  switch/receiver.py; the rings side by side, switch/shm_arena.py), so a port has no `recv()`;
  it sends rows of the turn's buffer (`send_rows`), says whether it has a peer, and is armed
  and rung like an endpoint. `SoftwareSwitch.attach_udp/attach_raw/attach_shm` make them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .mmsg import BatchSocket, enable_error_reports, raw_socket, udp_socket
from .shm_endpoint import ShmEndpoint

KINDS = ("udp", "raw", "shm")


@runtime_checkable
class Transport(Protocol):
    """An endpoint's batched datagram channel (module docstring).

    Attributes:
        kind: "udp", "raw" or "shm".
        batch: the most datagrams one `recv()` returns.
        rx: rows of received datagrams, one per row; `rx[:k]` after `recv()` returned k.
        rx_len: their lengths.
        stats: "rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "tx_errors" (and the kind's own).
        tx_full: the last sends stopped short for want of room that frees by itself (a ring the
            peer has not drained yet): send the rest soon. The caller clears it before sending.
        doorbell: True when `fd` turns readable only after `arm()` (a ring's doorbell): a caller
            must arm before every sleep; False when it is readable whenever datagrams wait.
    """

    kind: str
    batch: int
    rx: np.ndarray
    rx_len: np.ndarray
    stats: dict[str, int]
    tx_full: bool
    doorbell: bool

    @property
    def fd(self) -> int:
        """The file descriptor poll() waits on for received datagrams."""
        ...

    @property
    def address(self) -> tuple[str, int] | str:
        """This end: a UDP (host, port), an interface name, or a ring pair's path prefix."""
        ...

    def recv(self, block: bool = False) -> int:
        """Take up to `batch` datagrams into `rx[:k]` / `rx_len[:k]`; returns k (0: none waiting)."""
        ...

    def send_rows(self, buf: np.ndarray, idx, lengths, dests=None) -> int:
        """Send datagram i from row `idx[i]` of the C-contiguous 2-D uint8 `buf`, `lengths[i]`
        bytes, to the peer (or to `dests[i]`, on a BatchSocket with several); returns how many
        were taken (a full queue loses the rest, counted in stats["tx_errors"])."""
        ...

    def send_packet(self, data: bytes) -> int:
        """Send one datagram given as bytes (a heartbeat, a PULL); returns 1."""
        ...

    def arm(self, drain: bool = True) -> bool:
        """Call before sleeping in poll() on `fd`; False: datagrams arrived, do not sleep.
        `drain=False`: the last poll() did not report `fd` (a ring: no doorbell byte to read)."""
        ...

    def drain_errors(self) -> int:
        """Take the errors the kernel queued (ICMP reports on UDP); returns how many say the
        peer is gone (0 where the kind has none)."""
        ...

    def peer_gone(self, now: float) -> str | None:
        """A line naming the peer when it is known to be gone (a ring's peer process exited;
        sockets learn it from `drain_errors` instead: None). Cheap to call every timer tick."""
        ...

    def close(self) -> None:
        """Release the socket or the mappings (and with them `fd`)."""
        ...


@runtime_checkable
class RowFill(Protocol):
    """A transport whose send memory a caller can write packets into (ShmEndpoint)."""

    @property
    def tx_row_bytes(self) -> int:
        """The largest datagram `send_filled` can write."""
        ...

    def send_filled(self, n: int, write) -> int:
        """Publish up to `n` datagrams that `write(j0, j1, rows, lengths)` writes in place;
        returns how many (fewer: no room yet, sets `tx_full`; nothing is lost)."""
        ...


@runtime_checkable
class SwitchPort(Protocol):
    """A switch port's attachment (module docstring).

    Attributes:
        kind: "udp", "raw" or "shm".
        framed: True when its datagrams are whole Ethernet frames (raw), False for bare luwu
            datagrams (udp, shm).
        port: the switch port number.
        peer: whom it sends to (None: nobody yet; the pipeline's copies to it drop NO_ROUTE).
    """

    kind: str
    framed: bool
    port: int

    @property
    def fd(self) -> int:
        """What the event loop's poll() waits on."""
        ...

    @property
    def address(self) -> tuple[str, int] | str:
        """Where endpoints reach the port: a UDP (host, port), an interface, a ring prefix."""
        ...

    @property
    def peer(self) -> tuple[str, int] | str | None:
        ...

    def send_rows(self, rows: np.ndarray, idx: np.ndarray, lengths: np.ndarray, off: int = 0,
                  notify: bool = True) -> int:
        """Send rows `idx` of `rows`, the datagram of each starting at byte `off`; returns how
        many went out. `notify=False`: a ring's reader is woken later by `notify()`."""
        ...

    def notify(self) -> None:
        """Wake the peer for what `send_rows(..., notify=False)` published (sockets: nothing)."""
        ...

    def arm(self, drain: bool = True) -> bool:
        """As `Transport.arm` (sockets: True, poll() reports them whenever datagrams wait)."""
        ...

    def close(self) -> None:
        ...


# -- the factories: each kind's endpoint, opened the one way -----------------------------------------
def udp_transport(local: tuple[str, int], peer: tuple[str, int], batch: int = 64, max_len: int = 65536,
                  socket_buffer: int = 8 << 20, error_reports: bool = True) -> BatchSocket:
    """An endpoint on a UDP socket bound to `local`, sending to `peer`.

    Args:
        local: (host, port) to bind; port 0 picks a free one.
        peer: where `send_rows` / `send_packet` send (the switch port's address).
        batch: datagrams per recvmmsg.
        max_len: the largest datagram received whole (longer ones are cut).
        socket_buffer: SO_RCVBUF and SO_SNDBUF (root may exceed the system's maximum).
        error_reports: ask for the kernel's ICMP reports (`drain_errors`, and a refused `recv`
            once the peer's port is closed).

    Returns:
        The `Transport` (a `BatchSocket`, kind "udp").

    Example::

        t = udp_transport(("127.0.0.1", 0), switch_address)
        t.send_packet(heartbeat)
    """
    sock = udp_socket(local[0], local[1], socket_buffer, socket_buffer)
    if error_reports:
        enable_error_reports(sock)
    out = BatchSocket(sock, batch=batch, max_len=max_len, peers=1)
    out.set_peer(0, peer[0], int(peer[1]))
    out.default_peer = 0
    return out


def raw_transport(ifname: str, batch: int = 64, max_len: int = 16384, socket_buffer: int = 8 << 20) -> BatchSocket:
    """An endpoint on network interface `ifname`: whole Ethernet frames (AF_PACKET; root only).

    Returns:
        The `Transport` (a `BatchSocket`, kind "raw"); raises OSError when the interface cannot
        be opened (no such interface, not root).
    """
    return BatchSocket(raw_socket(ifname, socket_buffer), batch=batch, max_len=max_len)


def shm_transport(prefix: str, batch: int = 64) -> ShmEndpoint:
    """An endpoint on the shared-memory switch port whose rings are `<prefix>.up/.down`
    (made by `SoftwareSwitch.attach_shm`); ConnectionRefusedError when they are gone.

    Returns:
        The `Transport` (a `ShmEndpoint`, kind "shm").
    """
    return ShmEndpoint(prefix, batch=batch)


def _conforms(udp: BatchSocket, shm: ShmEndpoint) -> tuple[Transport, Transport, RowFill]:
    """Never called: mypy checks here that both endpoint classes implement the interface."""
    return udp, shm, shm
