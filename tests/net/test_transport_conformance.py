"""One test body over every transport (luwu.dataplane.net.transport): the endpoint `Transport`
kinds udp (two sockets on loopback), shm (two endpoints whose rings are crossed: one's up ring is
the other's down ring) and raw (AF_PACKET on the two ends of a veth pair, in a network namespace
made here and removed after; root only), and the switch-side `SwitchPort` kinds, each sending
to an endpoint of its kind. Each body sends rows of a buffer (picked out of order, of several
lengths), waits for the receiver's fd to turn readable, receives them across more than one
`recv()` batch, and checks bytes, lengths, order, the stats of both ends and that `close()`
releases the fd. The engine's factory is checked to pick the kind `Wiring.transport` names.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from luwu.dataplane.engine.transport import open_transport
from luwu.dataplane.net.mmsg import BatchSocket
from luwu.dataplane.net.shm_endpoint import ShmEndpoint
from luwu.dataplane.net.shm_ring import ShmRing
from luwu.dataplane.net.transport import (
    RowFill,
    SwitchPort,
    Transport,
    raw_transport,
    shm_transport,
    udp_transport,
)
from luwu.dataplane.session import Wiring
from luwu.dataplane.switch.attach_raw import RawAttachment
from luwu.dataplane.switch.attach_shm import ShmAttachment
from luwu.dataplane.switch.attach_udp import UdpAttachment
from luwu.dataplane.switch.config import SwitchConfig

BATCH = 4  # smaller than the packets sent: a receiver needs more than one recv()
WIDTH = 1536
# row i of the send buffer is an Ethernet frame (broadcast, an experimental EtherType) carrying a
# pattern of its own: a whole frame for raw, a datagram like any other for udp and shm
IDX = [6, 1, 3, 0, 4]
LENGTHS = [60, 1500, 333, 64, 999]
ETH_HEAD = bytes([0xFF] * 6) + bytes([0x02, 0, 0, 0, 0, 0x01]) + bytes([0x88, 0xB5])
DEADLINE_MS = 2000
CLONE_NEWNET = 0x40000000
SHM_ROW = 2048  # ring rows: the longest packet sent fits


def send_buffer() -> np.ndarray:
    buf = np.zeros((8, WIDTH), dtype=np.uint8)
    for i in range(len(buf)):
        buf[i, :len(ETH_HEAD)] = np.frombuffer(ETH_HEAD, dtype=np.uint8)
        buf[i, len(ETH_HEAD):] = (np.arange(WIDTH - len(ETH_HEAD)) * (i + 3) + i) % 251
    return buf


def readable(fd: int, timeout_ms: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout_ms))


def receive(t: Transport, n: int) -> list[bytes]:
    """Up to `n` datagrams from `t`, copied out of its lent rows (bounded in turns and time)."""
    got: list[bytes] = []
    for _ in range(200):
        k = t.recv()
        got.extend(t.rx[i, :int(t.rx_len[i])].tobytes() for i in range(k))
        if len(got) >= n:
            break
        if not k and t.arm() and not readable(t.fd, 50):
            continue
    return got


def closes(t: Transport | SwitchPort) -> None:
    """`close()` gives the fd back (fstat of it fails)."""
    fd = t.fd
    os.fstat(fd)
    t.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def exercise(kind: str, a: Transport, b: Transport) -> None:
    """The one body every endpoint transport runs: a sends, b receives, then back."""
    for t in (a, b):
        assert isinstance(t, Transport)
        assert t.kind == kind
        assert t.drain_errors() == 0 and t.peer_gone(0.0) is None
    assert b.recv() == 0
    assert b.arm() is True  # nothing came: it may sleep
    assert not readable(b.fd, 0)
    buf = send_buffer()
    assert a.send_rows(buf, np.array(IDX), np.array(LENGTHS)) == len(IDX)
    assert readable(b.fd, DEADLINE_MS), f"{kind}: the receiver's fd did not turn readable"
    if b.doorbell:
        assert b.arm() is False  # packets came: do not sleep
    got = receive(b, len(IDX))
    assert got == [buf[i, :n].tobytes() for i, n in zip(IDX, LENGTHS)]
    assert (a.stats["tx_packets"], a.stats["tx_bytes"], a.stats["tx_errors"]) == (len(IDX), sum(LENGTHS), 0)
    assert (b.stats["rx_packets"], b.stats["rx_bytes"]) == (len(IDX), sum(LENGTHS))
    # one packet given as bytes, the other way
    data = ETH_HEAD + b"one packet, the other way" + bytes(40)
    a.arm()
    assert b.send_packet(data) == 1
    assert readable(a.fd, DEADLINE_MS)
    assert receive(a, 1) == [data]
    assert b.stats["tx_packets"] == 1 and a.stats["rx_packets"] == 1
    closes(a)
    closes(b)


def exercise_port(kind: str, port: SwitchPort, ep: Transport) -> None:
    """The one body every switch port runs: the port sends rows (their datagrams at an offset,
    as the switch sends a turn's packets) to an endpoint of its kind."""
    assert isinstance(port, SwitchPort)
    assert port.kind == ep.kind == kind
    assert port.framed == (kind == "raw")
    assert port.arm() is True
    buf = send_buffer()
    off = 16
    wide = np.zeros((len(buf), WIDTH + off), dtype=np.uint8)
    wide[:, off:] = buf
    ep.arm()
    assert port.send_rows(wide, np.array(IDX), np.array(LENGTHS), off, notify=False) == len(IDX)
    port.notify()
    assert readable(ep.fd, DEADLINE_MS), f"{kind}: the endpoint's fd did not turn readable"
    assert receive(ep, len(IDX)) == [buf[i, :n].tobytes() for i, n in zip(IDX, LENGTHS)]
    assert ep.stats["rx_packets"] == len(IDX)
    closes(ep)
    closes(port)


# -- the kinds ---------------------------------------------------------------------------------------
def udp_pair() -> tuple[BatchSocket, BatchSocket]:
    a = udp_transport(("127.0.0.1", 0), ("127.0.0.1", 9), batch=BATCH, max_len=WIDTH)
    b = udp_transport(("127.0.0.1", 0), a.address, batch=BATCH, max_len=WIDTH)  # type: ignore[arg-type]
    a.set_peer(0, *b.address)
    return a, b


@contextlib.contextmanager
def shm_pair(tag: str) -> Iterator[tuple[ShmEndpoint, ShmEndpoint]]:
    """Two endpoints wired to each other: ring pair P made here, and Q whose down ring is P's up
    ring and whose up ring is P's down ring (symbolic links, doorbells too)."""
    p = f"/dev/shm/luwu-test-{os.getpid()}-{tag}-p"
    q = f"/dev/shm/luwu-test-{os.getpid()}-{tag}-q"
    made = [ShmRing(p + ".up", "consumer", 16, SHM_ROW, create=True),
            ShmRing(p + ".down", "producer", 16, SHM_ROW, create=True)]
    links = []
    try:
        for mine, theirs in ((".down", ".up"), (".up", ".down")):
            for bell in ("", ".bell"):
                os.symlink(p + theirs + bell, q + mine + bell)
                links.append(q + mine + bell)
        yield shm_transport(p, batch=BATCH), shm_transport(q, batch=BATCH)
    finally:
        for path in links:
            os.unlink(path)
        for ring in made:
            ring.close()


@contextlib.contextmanager
def veth_namespace() -> Iterator[Callable[[Callable[[], object]], object]]:
    """A network namespace holding a veth pair va <-> vb (up, no IPv6 chatter); yields how to run
    a function inside it (sockets made there stay in it). Removed on exit."""
    if os.geteuid() != 0:
        pytest.skip("raw transports need root (AF_PACKET and a network namespace)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    ns = f"lwtr{os.getpid() % 100000}"

    def sh(*cmd: str) -> None:
        subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=True)

    try:
        sh("ip", "netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace: {e.stderr.strip()}")
    try:
        sh("ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
           "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")
        sh("ip", "-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
        for dev in ("va", "vb"):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        libc = ctypes.CDLL(None, use_errno=True)

        def inside(fn: Callable[[], object]) -> object:
            """Run fn on a thread that entered the namespace (setns moves only that thread)."""
            out: dict[str, object] = {}

            def run() -> None:
                fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
                try:
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        out["error"] = OSError(ctypes.get_errno(), "setns")
                        return
                    out["value"] = fn()
                except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                    out["error"] = e
                finally:
                    os.close(fd)

            t = threading.Thread(target=run)
            t.start()
            t.join(30)
            if "error" in out:
                raise out["error"]  # type: ignore[misc]
            return out["value"]

        yield inside
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


# -- the tests ----------------------------------------------------------------------------------------
def test_udp_transport():
    exercise("udp", *udp_pair())


def test_shm_transport():
    with shm_pair("t") as (a, b):
        assert isinstance(a, RowFill) and isinstance(b, RowFill)
        exercise("shm", a, b)


@pytest.mark.netns
def test_raw_transport():
    with veth_namespace() as inside:
        a, b = inside(lambda: (raw_transport("va", batch=BATCH, max_len=WIDTH),
                               raw_transport("vb", batch=BATCH, max_len=WIDTH)))
        exercise("raw", a, b)


def test_sockets_fill_no_rows():
    """Only a transport with sendable memory of its own is a RowFill (SendStream's direct mode)."""
    a, b = udp_pair()
    try:
        assert not isinstance(a, RowFill)
    finally:
        a.close()
        b.close()


def test_udp_switch_port():
    ep = udp_transport(("127.0.0.1", 0), ("127.0.0.1", 9), batch=BATCH, max_len=WIDTH)
    port = UdpAttachment(1, ("127.0.0.1", 0), ep.address, SwitchConfig())  # type: ignore[arg-type]
    assert port.peer == ep.address
    exercise_port("udp", port, ep)


def test_shm_switch_port():
    port = ShmAttachment(1, SwitchConfig(), prefix=f"/dev/shm/luwu-test-{os.getpid()}-port", slots=16)
    try:
        exercise_port("shm", port, shm_transport(port.prefix, batch=BATCH))
    finally:
        if port.rx.h is not None:  # the body failed before it closed the port
            port.close()


@pytest.mark.netns
def test_raw_switch_port():
    with veth_namespace() as inside:
        port, ep = inside(lambda: (RawAttachment(1, "va", SwitchConfig()),
                                   raw_transport("vb", batch=BATCH, max_len=WIDTH)))
        exercise_port("raw", port, ep)


def test_udp_port_without_peer_sends_nothing():
    port = UdpAttachment(1, ("127.0.0.1", 0), None, SwitchConfig())
    try:
        assert port.peer is None
        assert port.send_rows(send_buffer(), np.array(IDX), np.array(LENGTHS)) == 0
    finally:
        port.close()


def test_engine_factory_picks_the_wiring_kind():
    """open_transport is the one place the engine's kind is chosen."""
    peer = udp_transport(("127.0.0.1", 0), ("127.0.0.1", 9))
    t = open_transport(Wiring(0, "udp", ("127.0.0.1", 0), peer.address), 8, 256, 1 << 20)  # type: ignore[arg-type]
    try:
        assert isinstance(t, BatchSocket) and t.kind == "udp" and not t.doorbell
        t.send_packet(b"to the switch")
        assert readable(peer.fd, DEADLINE_MS) and receive(peer, 1) == [b"to the switch"]
    finally:
        t.close()
        peer.close()
    port = ShmAttachment(1, SwitchConfig(), prefix=f"/dev/shm/luwu-test-{os.getpid()}-wiring", slots=16)
    try:
        t = open_transport(Wiring(0, "shm", ("127.0.0.1", 0), (port.prefix, 0)), 8, 256, 1 << 20)
        assert isinstance(t, ShmEndpoint) and t.kind == "shm" and t.doorbell
        t.close()
    finally:
        port.close()
