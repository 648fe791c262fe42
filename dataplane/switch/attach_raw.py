"""Raw attachment: one switch port = one network interface, whole Ethernet frames through an
AF_PACKET socket (Mininet, veth pairs). The parser finds luwu in UDP to the configured port;
the sender rewrites destinations from `endpoints`; other IPv4 is routed by `ipv4_lpm`. `RawAttachment` is the "raw" kind of
`luwu.dataplane.net.transport.SwitchPort`.
"""

from __future__ import annotations

import numpy as np

from ..net.mmsg import BatchSocket, raw_socket
from ..protocol import ETH_IP_UDP_LEN, aggregation_packet_len
from .config import ConfigError, SwitchConfig


class RawAttachment:
    """A switch port on a network interface (module docstring; the `SwitchPort` interface)."""

    kind = "raw"
    framed = True

    def __init__(self, port: int, ifname: str, config: SwitchConfig):
        need = ETH_IP_UDP_LEN + aggregation_packet_len(config.lanes)
        if config.max_frame < need:
            raise ConfigError(f"raw port {port} ({ifname}): {config.lanes}-lane frames are {need} bytes but "
                              f"max_frame is {config.max_frame}; raise max_frame or use fewer lanes")
        self.port = port
        self.ifname = ifname
        try:
            sock = raw_socket(ifname, config.socket_buffer)
        except OSError as e:
            raise ConfigError(f"raw port {port}: cannot open interface {ifname!r}: {e.strerror} "
                              f"(needs root and an existing interface)") from None
        self.sock = BatchSocket(sock, batch=config.batch, max_len=config.max_frame)
        self.address = ifname
        self.peer = ifname

    @property
    def fd(self) -> int:
        return self.sock.fd

    def send_rows(self, rows: np.ndarray, idx: np.ndarray, lengths: np.ndarray, off: int = 0,
                  notify: bool = True) -> int:
        """Send rows `idx` of `rows` as whole frames (starting at byte `off` of each); returns how
        many the kernel took. `notify`: nothing to ring."""
        if len(idx) == 0:
            return 0
        if off:
            rows = rows[:, off:]  # a view: the frames still leave from their rows
        return self.sock.send_rows(rows, idx, lengths)

    def notify(self) -> None:
        """Nothing to ring: the kernel wakes the peer (SwitchPort.notify)."""

    def arm(self, drain: bool = True) -> bool:
        """Nothing to arm: poll() reports the socket whenever frames wait (SwitchPort.arm)."""
        return True

    def close(self) -> None:
        self.sock.close()
