"""The optimizer node's control channel under abuse (issue 27), over real loopback sockets against
a real `ControlServer`: silent connections never lock the token holder out, a large claim takes
memory only as its bytes arrive and is dropped when idle, authenticated connections are capped
(total and per source address) and closed when idle, and threads stay bounded."""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import struct
import termios
import threading

import pytest

from luwu.dataplane.optimizer.control import ControlAuth, ControlClient, ControlError, recv_msg
from luwu.dataplane.optimizer.control_server import VERIFY_THREADS, ControlLimits, ControlServer

NODE_TOKEN = "node-control-token"
JOB_TOKENS = {"job-a": "token-of-a"}
MIB = 1 << 20
_HELLO = json.dumps({"op": "hello", "job_id": "", "token": NODE_TOKEN}).encode()
HELLO = struct.pack("!I", len(_HELLO)) + _HELLO  # the node token holder's hello, framed


@pytest.fixture
def server():
    """factory(auth=None, **limits) -> a running TCP ControlServer on 127.0.0.1 (stopped at teardown)."""
    servers = []

    def make(auth=None, **limits):
        srv = ControlServer("127.0.0.1:0", lambda h, b, g: {"echo": h.get("op"), "bytes": sum(len(x) for x in b)},
                            auth=auth or ControlAuth(token=NODE_TOKEN,
                                                     verify=lambda j, t: JOB_TOKENS.get(j) == t),
                            limits=ControlLimits(**limits)).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def sockets():
    """Client sockets the test opens; all closed at teardown."""
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def connect(address: str, made: list, source: str = "127.0.0.1", timeout: float = 20.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout, source_address=(source, 0))
    made.append(s)
    return s


def wait_until(cond, what: str, tries: int = 400) -> None:
    """Bounded in count (and so in time): the server's loop or threads catch up."""
    for _ in range(tries):
        if cond():
            return
        threading.Event().wait(0.025)
    raise AssertionError(f"never happened: {what}")


def closed_with(sock: socket.socket) -> str:
    """The error the server answered before closing ('' if it just closed)."""
    try:
        reply, _ = recv_msg(sock)
    except (ConnectionError, OSError):
        return ""
    assert reply["ok"] is False
    assert sock.recv(1) == b""
    return reply["error"]


def queued(sock: socket.socket | int, request: int) -> int:
    """Bytes a socket's kernel queue holds: termios.FIONREAD (received, not yet read) or
    termios.TIOCOUTQ (sent, not yet acknowledged)."""
    out = array.array("i", [0])
    fcntl.ioctl(sock if isinstance(sock, int) else sock.fileno(), request, out, True)
    return out[0]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("silent", [8, 64])
def test_silent_connections_never_lock_out_the_token_holder(server, sockets, silent):
    """Before: the 9th connection was refused ("too many unauthenticated control connections")
    until a silent one's 10 s hello deadline ran out. Now the oldest silent one is evicted."""
    srv = server(hello_timeout=600.0)  # `luwu node`'s defaults, but no deadline frees a slot during the test
    idle = [connect(srv.address, sockets) for _ in range(silent)]
    wait_until(lambda: srv.connections["unauthenticated"] + srv.refused["evicted"] == silent, "silent ones accepted")
    assert srv.connections["unauthenticated"] == min(silent, srv.limits.max_unauthenticated_per_peer)
    for _ in range(3):  # repeatably, and at once (the client's timeout is 5 s, the hello deadline 600 s)
        client = ControlClient(srv.address, timeout=5.0, token=NODE_TOKEN)
        assert client.call({"op": "stats"})["echo"] == "stats"
        client.close()
    assert srv.refused["handshake"] == 0  # nobody waited for a deadline
    evicted = [s for s in idle if closed_with_now(s)]
    assert len(evicted) == srv.refused["evicted"] >= silent - srv.limits.max_unauthenticated_per_peer


def closed_with_now(sock: socket.socket) -> bool:
    """Whether the server has already closed `sock` (an eviction), without waiting."""
    sock.setblocking(False)
    try:
        data = sock.recv(1 << 16)
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)
    return data == b"" or b"evicted" in data


def test_a_flooding_peer_evicts_only_its_own_connections(server, sockets):
    srv = server(max_unauthenticated=6, max_unauthenticated_per_peer=4)
    other = connect(srv.address, sockets, source="127.0.0.2")  # another host's client, slow to say hello
    wait_until(lambda: srv.connections["unauthenticated"] == 1, "the other peer's connection accepted")
    for _ in range(20):
        connect(srv.address, sockets)
    wait_until(lambda: srv.refused["evicted"] == 16, "the flood evicted its own oldest")
    other.sendall(HELLO)  # still open: its hello is answered
    reply, _ = recv_msg(other)
    assert reply["ok"] is True


def test_a_claimed_blob_takes_memory_only_as_it_arrives_and_idles_out(server):
    """Before: announcing 200 MiB and sending 1 MiB allocated (and zero-filled) 200 MiB at once,
    held with no timeout. Now 1 MiB arrives in about 1 MiB of memory and the idle timeout frees it."""
    srv = server(max_message=256 * MIB, idle_timeout=1.0)
    client = ControlClient(srv.address, timeout=20.0, token=NODE_TOKEN)
    try:
        before = rss_bytes()
        header = json.dumps({"op": "add_job", "blobs": [200 * MIB]}).encode()
        client.sock.sendall(struct.pack("!I", len(header)) + header)
        client.sock.sendall(bytes(MIB))
        wait_until(lambda: srv._in_flight == 200 * MIB, "the claim reserved")
        (served,) = srv._served  # the server's end: wait until its thread has read every byte sent
        wait_until(lambda: queued(client.sock, termios.TIOCOUTQ) == 0 and queued(served, termios.FIONREAD) == 0,
                   "the server read the 1 MiB")
        grown = rss_bytes() - before
        assert grown < 32 * MIB, f"the process grew by {grown >> 20} MiB for 1 MiB received"
        assert "without a byte" in closed_with(client.sock)  # then the idle timeout closes it
        assert srv._in_flight == 0 and srv.refused["idle"] == 1
    finally:
        client.close()


def test_claims_beyond_the_budget_are_refused_before_reading(server):
    srv = server(max_message=8 * MIB)
    client = ControlClient(srv.address, timeout=20.0, token=NODE_TOKEN)
    try:
        header = json.dumps({"op": "add_job", "blobs": [200 * MIB]}).encode()
        client.sock.sendall(struct.pack("!I", len(header)) + header)
        assert "larger than this node accepts" in closed_with(client.sock)
        assert srv.refused["too_large"] == 1 and srv._in_flight == 0
    finally:
        client.close()


def test_authenticated_connections_are_capped(server, sockets):
    """Before: not capped (200 idle ones: 211 threads). Now the one past the cap is refused with
    an error naming the limit, another peer still gets its share, and a slot frees on close."""
    srv = server(max_authenticated=4, max_authenticated_per_peer=3)
    held = [ControlClient(srv.address, timeout=20.0, token=NODE_TOKEN) for _ in range(3)]
    try:
        with pytest.raises(ControlError, match=r"too many authenticated control connections \(3 open, 3 from "
                                               r"127\.0\.0\.1; limits 4 in all, 3 per peer\)"):
            ControlClient(srv.address, timeout=20.0, token=NODE_TOKEN)
        other = connect(srv.address, sockets, source="127.0.0.2")  # another peer is under its own cap
        other.sendall(HELLO)
        assert recv_msg(other)[0]["ok"] is True
        held[0].close()
        wait_until(lambda: srv.connections["authenticated"] == 3, "the closed connection's thread ended")
        held[0] = ControlClient(srv.address, timeout=20.0, token=NODE_TOKEN)
        assert held[0].call({"op": "stats"})["echo"] == "stats"
        assert srv.refused["busy"] == 1
    finally:
        for c in held:
            c.close()


def test_the_total_cap_holds_across_peers(server, sockets):
    srv = server(max_authenticated=2, max_authenticated_per_peer=2)
    replies = []
    for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
        s = connect(srv.address, sockets, source=source)
        s.sendall(HELLO)
        replies.append(recv_msg(s)[0])
    assert [r["ok"] for r in replies] == [True, True, False]
    assert "limits 2 in all" in replies[2]["error"]


def test_an_idle_authenticated_connection_is_dropped(server):
    srv = server(idle_timeout=0.5)
    client = ControlClient(srv.address, timeout=20.0, token=NODE_TOKEN)
    try:
        assert client.call({"op": "stats"})["echo"] == "stats"  # in use: fine
        assert "closed after 0.5 s without a byte" in closed_with(client.sock)  # then silent: closed
        wait_until(lambda: srv.connections["authenticated"] == 0, "its thread ended")
        assert srv.refused["idle"] == 1
    finally:
        client.close()


def test_threads_stay_bounded(server, sockets):
    """200 silent connections cost no thread; 200 authenticated attempts at most the cap's."""
    srv = server(max_authenticated=8)
    wait_until(lambda: threading.active_count() >= 1, "nothing")
    base = threading.active_count()
    for _ in range(200):
        connect(srv.address, sockets)
    wait_until(lambda: srv.connections["unauthenticated"] + srv.refused["evicted"] == 200, "silent ones accepted")
    assert threading.active_count() == base
    authed = []
    for _ in range(200):  # each says hello as it connects (none is evicted as a silent one)
        authed.append(connect(srv.address, sockets))
        authed[-1].sendall(HELLO)
    oks = sum(recv_msg(s)[0]["ok"] for s in authed)
    assert oks == 8 and srv.refused["busy"] == 192
    assert threading.active_count() <= base + 8 + VERIFY_THREADS


def test_a_slow_token_check_does_not_hold_up_the_node_token(server):
    """Job tokens the node does not know are checked off the event loop: while the controller
    is slow to answer, the node's token holder still gets in."""
    release = threading.Event()

    def slow_verify(job_id: str, token: str) -> bool:
        release.wait(30)
        return JOB_TOKENS.get(job_id) == token

    srv = server(auth=ControlAuth(token=NODE_TOKEN, verify=slow_verify))
    outcome: list = []
    job_client = threading.Thread(target=lambda: outcome.append(
        ControlClient(srv.address, timeout=60.0, token=JOB_TOKENS["job-a"], job_id="job-a")))
    job_client.start()
    try:
        wait_until(lambda: srv.connections["unauthenticated"] == 1, "the job client's hello is being checked")
        node = ControlClient(srv.address, timeout=5.0, token=NODE_TOKEN)
        assert node.call({"op": "stats"})["echo"] == "stats"
        node.close()
        assert not outcome  # still waiting on the token check
    finally:
        release.set()
        job_client.join(60)
    assert len(outcome) == 1 and outcome[0].call({"op": "stats"})["echo"] == "stats"
    outcome[0].close()


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="control channel limit idle_timeout must be positive"):
        ControlLimits(idle_timeout=0)


def test_luwu_node_flags_set_the_limits():
    import argparse

    from luwu.daemons.node import add_arguments, control_limits

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--plan", "p.json", "--state-dir", "s"]
    assert control_limits(parser.parse_args(base), 1 << 20) == ControlLimits(max_message=1 << 20)  # the defaults
    args = parser.parse_args([*base, "--control-max-unauthenticated", "5", "--control-max-unauthenticated-per-peer", "2",
                              "--control-hello-timeout", "3", "--control-max-authenticated", "7",
                              "--control-max-authenticated-per-peer", "4", "--control-idle-timeout", "9",
                              "--control-max-message", "2MiB"])
    assert control_limits(args, 1 << 20) == ControlLimits(max_message=2 << 20, max_unauthenticated=5,
                                                          max_unauthenticated_per_peer=2, hello_timeout=3.0,
                                                          max_authenticated=7, max_authenticated_per_peer=4,
                                                          idle_timeout=9.0)
