"""The engine daemon's control socket (dataplane/engine/daemon.py) speaks framing.py frames: a client
that sends something else gets one error frame and its connection closed, and the daemon goes on
serving other connections."""

from __future__ import annotations

import socket

from luwu.dataplane.engine.client import EngineClient
from luwu.dataplane.net.framing import recv_msg, send_msg
from luwu.dataplane.process import children


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    return s


def test_a_foreign_client_is_refused_and_the_daemon_serves_on(tmp_path):
    client = EngineClient.spawn(None, str(tmp_path))  # an engine host: connections open their own engines
    try:
        bad = _connect(client.path)
        bad.sendall(b"GET / HTTP/1.1\r\n\r\n")  # its first 4 bytes read as a length of ~1.2 GB
        reply, _ = recv_msg(bad)
        assert reply["ok"] is False and "not a luwu frame" in reply["error"], reply
        try:  # closed by the daemon (a reset: it closed with our unread bytes still queued)
            assert bad.recv(1) == b""
        except ConnectionResetError:
            pass
        bad.close()

        good = _connect(client.path)
        send_msg(good, {"op": "stats", "id": 7})
        reply, _ = recv_msg(good)
        assert reply["id"] == 7 and reply["ok"] is False and "no engine on this connection" in reply["error"], reply
        good.close()
        assert client.process.poll() is None
    finally:
        client.close(timeout=5)
        if client.process.poll() is None:
            children.stop(client.process, grace=1)


def test_frame_reader_splits_bursts_and_joins_fragments():
    """The buffered reader the daemon and its client use: several frames in one recv, a frame cut
    across sends, a bad header, and a close mid-frame read exactly as `recv_msg` reads them."""
    import struct

    import pytest

    from luwu.dataplane.net.framing import FrameError, FrameReader

    a, b = socket.socketpair()
    a.settimeout(20)
    b.settimeout(20)
    try:
        reader = FrameReader(b, chunk=64)  # smaller than the frames below: they span recv calls
        for i in range(5):  # one burst: the reader takes them all, then hands them out one by one
            send_msg(a, {"id": i, "pad": "x" * (37 * i)}, [bytes([i]) * (100 * i)])
        for i in range(5):
            header, blobs = reader.recv_msg(max_message=1 << 20)
            assert header["id"] == i and header["pad"] == "x" * (37 * i)
            assert blobs == ([bytes([i]) * (100 * i)] if i else [b""])
        frame = struct.pack("!I", 11) + b'{"id": 42}\n'
        a.sendall(frame[:3])  # a frame in fragments: the reader waits for the rest
        a.sendall(frame[3:9])
        a.sendall(frame[9:])
        assert reader.recv_msg()[0] == {"id": 42}
        a.sendall(struct.pack("!I", 3) + b"\xff\xfe!")
        with pytest.raises(FrameError, match="not JSON"):
            reader.recv_msg()
        a.sendall(struct.pack("!I", 50) + b'{"id"')
        a.close()
        with pytest.raises(ConnectionError, match="mid-frame"):
            reader.recv_msg()
    finally:
        b.close()


def test_frame_reader_fed_by_an_event_loop_hands_out_only_whole_frames():
    """`feed`/`next_msg` (the engine loop reads the daemon's requests itself): a burst cut at every
    byte gives the same frames as one read, a partial frame consumes nothing, and a garbage length
    is refused as soon as it is buffered, not waited for."""
    import pytest

    from luwu.dataplane.net.framing import FrameError, FrameReader

    a, b = socket.socketpair()
    try:
        for i in range(3):
            send_msg(a, {"id": i}, [b"ab" * i])
        a.close()
        data = b""
        while chunk := b.recv(1 << 16):
            data += chunk
    finally:
        b.close()
    for cut in range(len(data) + 1):
        reader = FrameReader(None)
        got = []
        for piece in (data[:cut], data[cut:]):
            reader.feed(piece)
            while (msg := reader.next_msg(max_message=1 << 20)) is not None:
                got.append(msg)
        assert [(h["id"], blobs) for h, blobs in got] == [(0, [b""]), (1, [b"ab"]), (2, [b"abab"])], cut
        assert not reader.has_buffered()
    reader = FrameReader(None)
    reader.feed(b"GET / HTTP/1.1")
    with pytest.raises(FrameError, match="larger than"):
        reader.next_msg(max_message=1 << 20)


def test_requests_are_served_by_the_engine_loop(tmp_path):
    """After `open`, the engine's own thread reads the connection (Engine.add_reader): a burst of
    pushes and pulls sent without waiting all complete, and `close` ends the connection there."""
    import numpy as np

    from luwu.dataplane.loopback import LoopbackSwitch, StarPlan

    plan = StarPlan(workers=1, nodes=0, mode="tofino")
    with LoopbackSwitch(plan):
        client = EngineClient.spawn(None, str(tmp_path))
        try:
            client.open(plan.worker_plan(0))
            buf = client.buffer(4 * 64 * 20)
            xs = buf.view(np.int32, 64 * 20).reshape(20, 64)
            xs[:] = np.arange(20, dtype=np.int32)[:, None] * 3 + np.arange(64, dtype=np.int32)
            want = xs.copy()
            # sent back to back, no waiting: the daemon reads them in bursts
            handles = [client.allreduce(buf, xs[i], "sum") for i in range(20)]
            for h in handles:
                h.wait(60)
            assert np.array_equal(xs, want)  # one worker: each sum is its own values, each in its place
            stats = client.stats()
            assert stats["engine"]["loop_turns"] > 0
        finally:
            client.close(timeout=10)
            if client.process.poll() is None:
                children.stop(client.process, grace=1)
