"""UDP attachment: one switch port = one UDP socket (the embedded loopback deployment).

The kernel's Ethernet/IPv4/UDP headers stand in for the switch's: an endpoint is wired to the
port by sending from its socket to this socket. A port accepts datagrams only from its peer;
everything else is dropped UNKNOWN_PORT (counted). The peer is, in order:

* configured (`peer=(host, port)`, `--port N=HOST:PORT,peer=HOST:PORT`);
* otherwise the address the tables give whoever is bound to the port (`peers.py`: the controller's
  or the loopback plan's `endpoints` entries) -- until they name one the port is unbound and
  refuses everything, so nobody can claim it by sending first;
* or, only when asked for (`peer="learn"`, `peer=learn`), learned from the first packet that
  passes the classifier (whose source guard requires the id bound to the port): for setups that
  cannot know the peer's address in advance, at the cost that whoever sends that first packet
  owns the port.

Sends go to the peer straight from the rows that hold the packets. `UdpAttachment` is the "udp"
kind of `luwu.dataplane.net.transport.SwitchPort`.
"""

from __future__ import annotations

import numpy as np

from ..net.mmsg import BatchSocket, addr_of, parse_sockaddr_in, udp_socket
from ..protocol import DropReason
from .config import SwitchConfig

SOCKADDR_KEY = 8  # family, port and IPv4 address of a sockaddr_in (the rest is padding)
LEARN = "learn"  # the opt-in peer value: the first valid sender becomes the peer


class UdpAttachment:
    """A switch port on a UDP socket (module docstring; the `SwitchPort` interface)."""

    kind = "udp"
    framed = False

    def __init__(self, port: int, listen: tuple[str, int], peer: tuple[str, int] | str | None, config: SwitchConfig):
        if isinstance(peer, str) and peer != LEARN:
            raise ValueError(f"switch port {port}: peer {peer!r} must be (host, port), {LEARN!r} or None")
        self.port = port
        sock = udp_socket(listen[0], listen[1], config.socket_buffer, config.socket_buffer)
        self.sock = BatchSocket(sock, batch=config.batch, max_len=config.max_datagram, peers=1)
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self.learning = peer == LEARN
        self.configured = peer is not None and not self.learning  # the tables never override a configured peer
        self.peer: tuple[str, int] | None = None
        self._peer_key: np.ndarray | None = None
        if self.configured:
            self.set_peer(peer)

    @property
    def fd(self) -> int:
        return self.sock.fd

    def set_peer(self, peer: tuple[str, int]) -> None:
        """Configure the peer: from now on only `peer`, whatever the tables say."""
        self.configured, self.learning = True, False
        self.bind(peer)

    def bind(self, peer: tuple[str, int]) -> None:
        """Accept `peer` (and send to it) until told otherwise (configured, derived or learned)."""
        self.sock.set_peer(0, peer[0], int(peer[1]))
        self.sock.default_peer = 0
        self.peer = (peer[0], int(peer[1]))
        self._peer_key = self.sock.peers[0, :SOCKADDR_KEY].view(np.uint64).copy()  # one word: one compare per row

    def clear_peer(self) -> None:
        """Unbind the port: it refuses every datagram and sends nothing until a peer is set."""
        self.peer = None
        self._peer_key = None

    def foreign(self, addr: np.ndarray) -> np.ndarray:
        """Which received datagrams (their sockaddr rows) come from someone else than the peer
        (all of them while the port has no peer)."""
        if self._peer_key is None:
            return np.ones(len(addr), dtype=bool)
        return addr[:, :SOCKADDR_KEY].view(np.uint64)[:, 0] != self._peer_key[0]

    def learn(self, addr: np.ndarray, valid: np.ndarray, drop: np.ndarray) -> None:
        """Take the source of the first valid packet (rows of this port's segment) as the peer;
        later packets of the segment from other sources become UNKNOWN_PORT (earlier ones
        arrived before the port knew its peer)."""
        first = np.flatnonzero(valid)
        if len(first) == 0:
            return
        j = int(first[0])
        self.bind(parse_sockaddr_in(addr[j]))
        other = self.foreign(addr)
        other[:j + 1] = False
        drop[other & (drop == 0)] = DropReason.UNKNOWN_PORT

    def send_rows(self, rows: np.ndarray, idx: np.ndarray, lengths: np.ndarray, off: int = 0,
                  notify: bool = True) -> int:
        """Send rows `idx` of `rows` (the datagram at byte `off` of each) to the peer; returns how
        many the kernel took (0 while the port has no peer). `notify`: nothing to ring."""
        if self.peer is None:
            return 0
        base, stride = np.uint64(addr_of(rows) + off), np.uint64(rows.strides[0])
        return self.sock.send(base + idx.astype(np.uint64) * stride, lengths)

    def notify(self) -> None:
        """Nothing to ring: the kernel wakes the peer (SwitchPort.notify)."""

    def arm(self, drain: bool = True) -> bool:
        """Nothing to arm: poll() reports the socket whenever datagrams wait (SwitchPort.arm)."""
        return True

    def close(self) -> None:
        self.sock.close()
