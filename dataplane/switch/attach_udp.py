"""UDP attachment: one switch port = one UDP socket (the embedded loopback deployment).

The kernel's Ethernet/IPv4/UDP headers stand in for the switch's: an endpoint is wired to the
port by sending from its socket to this socket. The port's peer is configured, or learned from
the first packet that passes the classifier; afterwards a datagram from any other address is
dropped UNKNOWN_PORT. Sends go to the peer straight from the rows that hold the packets.
"""

from __future__ import annotations

import numpy as np

from ..net.mmsg import BatchSocket, parse_sockaddr_in, udp_socket
from ..protocol import DropReason
from .config import SwitchConfig

SOCKADDR_KEY = 8  # family, port and IPv4 address of a sockaddr_in (the rest is padding)


class UdpAttachment:
    kind = "udp"
    framed = False

    def __init__(self, port: int, listen: tuple[str, int], peer: tuple[str, int] | None, config: SwitchConfig):
        self.port = port
        sock = udp_socket(listen[0], listen[1], config.socket_buffer, config.socket_buffer)
        self.sock = BatchSocket(sock, batch=config.batch, max_len=config.max_datagram, peers=1)
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self.peer: tuple[str, int] | None = None
        self._peer_key: np.ndarray | None = None
        if peer is not None:
            self.set_peer(peer)

    @property
    def fd(self) -> int:
        return self.sock.fd

    def set_peer(self, peer: tuple[str, int]) -> None:
        self.sock.set_peer(0, peer[0], int(peer[1]))
        self.sock.default_peer = 0
        self.peer = (peer[0], int(peer[1]))
        self._peer_key = self.sock.peers[0, :SOCKADDR_KEY].copy()

    def foreign(self, addr: np.ndarray) -> np.ndarray:
        """Which received datagrams (their sockaddr rows) come from someone else than the peer."""
        if self._peer_key is None:
            return np.zeros(len(addr), dtype=bool)
        return (addr[:, :SOCKADDR_KEY] != self._peer_key).any(axis=1)

    def learn(self, addr: np.ndarray, valid: np.ndarray, drop: np.ndarray) -> None:
        """Take the source of the first valid packet (rows of this port's segment) as the peer;
        later packets of the segment from other sources become UNKNOWN_PORT (earlier ones
        arrived before the port knew its peer)."""
        first = np.flatnonzero(valid)
        if len(first) == 0:
            return
        j = int(first[0])
        self.set_peer(parse_sockaddr_in(addr[j]))
        other = self.foreign(addr)
        other[:j + 1] = False
        drop[other & (drop == 0)] = DropReason.UNKNOWN_PORT

    def send(self, addresses: np.ndarray, lengths: np.ndarray) -> int:
        if self.peer is None:
            return 0
        return self.sock.send(addresses, lengths)

    def close(self) -> None:
        self.sock.close()
