"""Batched datagram I/O: recvmmsg/sendmmsg through ctypes, with the message headers filled
by numpy so that one system call moves a whole batch and Python never loops per packet.

Used by the software switch (one socket per switch port) and by the SmartNIC engine. Works
for UDP sockets (optionally with per-message destinations) and AF_PACKET sockets bound to an
interface (whole Ethernet frames). `BatchSocket` is the "udp" and "raw" kinds of the endpoint
`Transport` (transport.py, which opens them: `udp_transport`, `raw_transport`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct

import numpy as np

# the C library through the process's own symbols (dlopen(NULL)): ctypes.util.find_library("c") runs
# `ldconfig -p` in a child process, once per module per daemon, on init_process_group's path
_libc = ctypes.CDLL(None, use_errno=True)
_libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_libc.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]

MSG_DONTWAIT = 0x40
SOCKADDR_LEN = 16  # sockaddr_in; AF_PACKET sockets here are bound and need no address

# struct mmsghdr on LP64 Linux: struct msghdr (56 bytes) + unsigned msg_len (+ padding)
MMSGHDR = np.dtype(
    [
        ("name", "<u8"), ("namelen", "<u4"), ("_pad0", "<u4"), ("iov", "<u8"), ("iovlen", "<u8"),
        ("control", "<u8"), ("controllen", "<u8"), ("flags", "<i4"), ("_pad1", "<u4"),
        ("len", "<u4"), ("_pad2", "<u4"),
    ]
)
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
assert MMSGHDR.itemsize == 64 and IOVEC.itemsize == 16


def addr_of(a: np.ndarray) -> int:
    # ctypes.data, not __array_interface__: the latter builds a descr list for structured dtypes
    # (about 8 us for an mmsghdr array, several times per event-loop turn)
    return a.ctypes.data


def recv_vectors(rows: np.ndarray, addrs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """iovec and mmsghdr arrays for recvmmsg into the rows of `rows` (one datagram per row),
    with source addresses into the rows of `addrs` when given. Keep both arrays alive."""
    n, width = rows.shape
    iov = np.zeros(n, dtype=IOVEC)
    iov["base"] = addr_of(rows) + np.arange(n, dtype=np.uint64) * np.uint64(width)
    iov["len"] = width
    hdr = np.zeros(n, dtype=MMSGHDR)
    hdr["iov"] = addr_of(iov) + np.arange(n, dtype=np.uint64) * np.uint64(IOVEC.itemsize)
    hdr["iovlen"] = 1
    if addrs is not None:
        hdr["name"] = addr_of(addrs) + np.arange(n, dtype=np.uint64) * np.uint64(SOCKADDR_LEN)
    return iov, hdr


def sockaddr_in(host: str, port: int) -> np.ndarray:
    """A struct sockaddr_in as 16 bytes."""
    b = np.zeros(SOCKADDR_LEN, dtype=np.uint8)
    b[0:2] = np.frombuffer(np.uint16(socket.AF_INET).tobytes(), np.uint8)
    b[2:4] = np.frombuffer(port.to_bytes(2, "big"), np.uint8)
    b[4:8] = np.frombuffer(socket.inet_aton(host), np.uint8)
    return b


def parse_sockaddr_in(b: np.ndarray) -> tuple[str, int]:
    return socket.inet_ntoa(bytes(b[4:8])), int.from_bytes(bytes(b[2:4]), "big")


class BatchSocket:
    """A datagram socket with preallocated batches for recvmmsg and sendmmsg: the "udp" (an
    AF_INET socket) and "raw" (AF_PACKET) kinds of `transport.Transport`.

    Receive: `recv()` fills `rx[:k]` (one datagram per row), `rx_len[:k]` and, for UDP,
    `rx_addr[:k]` (sockaddr_in bytes), and returns k.
    Send: `send(rows, lengths, dests)` sends datagram i from row address `rows[i]` with length
    `lengths[i]` to destination `dests[i]` (a row index into `self.peers`, or -1 / None for
    the connected or bound peer).
    """

    tx_full = False  # a blocking sendmmsg never stops short for want of room (Transport)
    doorbell = False  # poll() reports the socket whenever datagrams wait: no arming

    def __init__(self, sock: socket.socket, batch: int = 64, max_len: int = 65536, peers: int = 0):
        self.sock = sock
        self.fd = sock.fileno()
        self.batch = batch
        self.max_len = max_len
        self.rx = np.zeros((batch, max_len), dtype=np.uint8)
        self.rx_len = np.zeros(batch, dtype=np.int64)
        self.rx_addr = np.zeros((batch, SOCKADDR_LEN), dtype=np.uint8)
        self._want_addr = sock.family == socket.AF_INET
        self.kind = "udp" if self._want_addr else "raw"
        self._rx_iov, self._rx_hdr = recv_vectors(self.rx, self.rx_addr if self._want_addr else None)
        self._rx_hdr_addr = addr_of(self._rx_hdr)
        self._tx_iov = np.zeros(batch, dtype=IOVEC)
        self._tx_hdr = np.zeros(batch, dtype=MMSGHDR)
        self._tx_hdr["iov"] = addr_of(self._tx_iov) + np.arange(batch, dtype=np.uint64) * np.uint64(IOVEC.itemsize)
        self._tx_hdr["iovlen"] = 1
        self._tx_hdr_addr = addr_of(self._tx_hdr)
        # field views made once: indexing a structured array by name costs a microsecond a time
        self._tx_base, self._tx_len = self._tx_iov["base"], self._tx_iov["len"]
        self._tx_name, self._tx_namelen = self._tx_hdr["name"], self._tx_hdr["namelen"]
        self.peers = np.zeros((max(peers, 1), SOCKADDR_LEN), dtype=np.uint8)
        self._peers_addr = addr_of(self.peers)  # follows `peers` (set_peer grows it)
        self.default_peer: int | None = None  # destination of sends that name none (unconnected sockets)
        self.stats = {"rx_packets": 0, "rx_bytes": 0, "tx_packets": 0, "tx_bytes": 0, "tx_errors": 0}

    @property
    def address(self) -> tuple[str, int] | str:
        """The bound (host, port) of a UDP socket, the interface name of a raw one."""
        name = self.sock.getsockname()
        return (name[0], name[1]) if self._want_addr else name[0]

    # -- receive ---------------------------------------------------------------------------
    def arm(self, drain: bool = True) -> bool:
        """Nothing to arm: poll() reports the socket whenever datagrams wait (Transport.arm)."""
        return True

    def drain_errors(self) -> int:
        """Take the ICMP reports queued on a UDP socket (`enable_error_reports`); returns how
        many say the peer is gone."""
        return drain_error_reports(self.sock) if self._want_addr else 0

    def peer_gone(self, now: float) -> str | None:
        """None: a socket's peer shows as gone through `drain_errors` and refused receives."""
        return None

    def recv(self, block: bool = False) -> int:
        if self._want_addr:
            self._rx_hdr["namelen"] = SOCKADDR_LEN
        k = _libc.recvmmsg(self.fd, self._rx_hdr_addr, self.batch, 0 if block else MSG_DONTWAIT, None)
        if k < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return 0
            raise OSError(err, os.strerror(err))
        self.rx_len[:k] = self._rx_hdr["len"][:k]
        self.stats["rx_packets"] += k
        self.stats["rx_bytes"] += int(self.rx_len[:k].sum())
        return k

    # -- send ------------------------------------------------------------------------------
    def set_peer(self, index: int, host: str, port: int) -> None:
        if index >= len(self.peers):
            grown = np.zeros((index + 1, SOCKADDR_LEN), dtype=np.uint8)
            grown[: len(self.peers)] = self.peers
            self.peers = grown
            self._peers_addr = addr_of(grown)
        self.peers[index] = sockaddr_in(host, port)

    def send(self, rows: np.ndarray, lengths: np.ndarray | list[int], dests: np.ndarray | None = None, block: bool = True) -> int:
        """Send len(rows) datagrams; returns how many the kernel took (all of them when blocking)."""
        total = len(rows)
        done = 0
        while done < total:
            n = min(self.batch, total - done)
            self._tx_base[:n] = rows[done:done + n]
            self._tx_len[:n] = lengths[done:done + n]
            if dests is not None:
                d = np.asarray(dests[done:done + n])
                self._tx_name[:n] = np.where(d >= 0, self._peers_addr + d.astype(np.uint64) * np.uint64(SOCKADDR_LEN), 0)
                self._tx_namelen[:n] = np.where(d >= 0, SOCKADDR_LEN, 0)
            elif self.default_peer is not None:
                self._tx_name[:n] = self._peers_addr + self.default_peer * SOCKADDR_LEN
                self._tx_namelen[:n] = SOCKADDR_LEN
            else:
                self._tx_name[:n] = 0
                self._tx_namelen[:n] = 0
            k = _libc.sendmmsg(self.fd, self._tx_hdr_addr, n, 0 if block else MSG_DONTWAIT)
            if k < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err in (errno.EAGAIN, errno.EWOULDBLOCK) and not block:
                    break
                if err in (errno.ECONNREFUSED, errno.EAGAIN, errno.ENOBUFS, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    # a peer that went away (ICMP port unreachable on loopback) or a full queue:
                    # the datagram is lost like any other; the protocol recovers
                    self.stats["tx_errors"] += 1
                    done += 1
                    continue
                raise OSError(err, os.strerror(err))
            sent_bytes = int(np.asarray(lengths[done:done + k]).sum())
            self.stats["tx_packets"] += k
            self.stats["tx_bytes"] += sent_bytes
            done += k
        return done

    def reflect(self, k: int) -> int:
        """Send the k datagrams just received back to their sources (a relay or echo)."""
        n = min(k, self.batch)
        self._tx_iov["base"][:n] = self._rx_iov["base"][:n]
        self._tx_iov["len"][:n] = self.rx_len[:n]
        self._tx_hdr["name"][:n] = addr_of(self.rx_addr) + np.arange(n, dtype=np.uint64) * np.uint64(SOCKADDR_LEN)
        self._tx_hdr["namelen"][:n] = SOCKADDR_LEN
        sent = _libc.sendmmsg(self.fd, self._tx_hdr_addr, n, 0)
        if sent > 0:
            self.stats["tx_packets"] += sent
            self.stats["tx_bytes"] += int(self.rx_len[:sent].sum())
        return max(sent, 0)

    def send_rows(self, buf: np.ndarray, idx: np.ndarray | list[int], lengths: np.ndarray | list[int],
                  dests: np.ndarray | None = None) -> int:
        """Send rows `idx` of a C-contiguous 2-D uint8 buffer."""
        base = np.uint64(addr_of(buf))
        rows = base + np.asarray(idx, dtype=np.uint64) * np.uint64(buf.strides[0])
        return self.send(rows, lengths, dests)

    def send_packet(self, data: bytes) -> int:
        """Send one datagram given as bytes to the default peer (a heartbeat, a PULL); returns 1."""
        return self.send_rows(np.frombuffer(bytearray(data), dtype=np.uint8)[None], [0], [len(data)])

    def close(self) -> None:
        self.sock.close()


def udp_socket(host: str = "127.0.0.1", port: int = 0, rcvbuf: int = 8 << 20, sndbuf: int = 8 << 20) -> socket.socket:
    """A bound UDP socket with buffers as large as the system allows (root may exceed rmem_max)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, port))
    for opt, force, size in ((socket.SO_RCVBUF, 33, rcvbuf), (socket.SO_SNDBUF, 32, sndbuf)):
        try:
            s.setsockopt(socket.SOL_SOCKET, force, size)  # SO_RCVBUFFORCE / SO_SNDBUFFORCE (root)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, opt, size)
    return s


SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
ETH_P_ALL = 0x0003


def raw_socket(ifname: str, rcvbuf: int = 8 << 20) -> socket.socket:
    """An AF_PACKET socket bound to one interface that does not see its own transmissions."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((ifname, 0))
    try:
        s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    except OSError:
        pass
    try:
        s.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return s


IP_RECVERR = getattr(socket, "IP_RECVERR", 11)  # Linux
# struct sock_extended_err { u32 ee_errno; u8 origin, type, code, pad; u32 info; u32 data; }
_EXT_ERR = struct.Struct("=IBBBBII")
_DEAD_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH}


def enable_error_reports(sock: socket.socket) -> None:
    """Ask the kernel to report ICMP errors (port unreachable) on this unconnected UDP socket."""
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
    except OSError:
        pass  # not Linux: the node heartbeat watch still works, the switch watch waits for silence only


def drain_error_reports(sock: socket.socket) -> int:
    """Read the socket's queued ICMP errors; returns how many said the peer is gone. Clears the
    pending socket error too, so poll() stops reporting POLLERR."""
    dead = 0
    for _ in range(1024):  # bounded: the queue holds at most what the receive buffer allows
        try:
            _, anc, _, _ = sock.recvmsg(1, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        except OSError as e:
            if e.errno in _DEAD_ERRNOS:
                dead += 1
                continue
            break
        for level, _type, data in anc:
            if (level == socket.IPPROTO_IP and len(data) >= _EXT_ERR.size
                    and _EXT_ERR.unpack_from(data)[0] in _DEAD_ERRNOS):
                dead += 1
    try:
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:
        pass
    return dead
