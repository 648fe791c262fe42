"""Point-to-point messages between ranks (torch.distributed send/recv) over TCP.

The switch aggregates and multicasts; it has no unicast path between workers, so send/recv do not
go through it. Each rank listens on one TCP port (its address is published in the c10d store);
a connection between two ranks is opened on first use by whichever sends first and is then used
by that sender for every message to that peer, so messages with the same tag arrive in the order
they were sent (TCP keeps order; a simultaneous first send from both sides may open a second
connection, and each sender keeps to the one it uses first; both stay open, as either side may be
sending on either). A message is a fixed header `magic, source rank, tag, length` and the payload
bytes. Nothing blocks the caller: a sender thread writes queued messages and completes their send
handles; a receiver thread reads every connection and hands each message to the matching posted
`recv` (by source and tag, in order), or keeps it until one is posted.
"""

from __future__ import annotations

import collections
import itertools
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

HEADER = struct.Struct("!IiqQ")  # magic, source rank, tag, payload bytes
MAGIC = 0x4C555750  # "LUWP"
HELLO_TAG = -(2**63)  # first header on a new connection: who dialled (user tags are never this)
ADDR_KEY = "luwu/p2p/{rank}"
CONNECT_RETRY = 0.05  # s between connection attempts while a peer's listener comes up
RECV_CHUNK = 1 << 20  # bytes read per system call


class P2PError(RuntimeError):
    pass


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.peer: int | None = None


class P2PChannel:
    def __init__(self, store, rank: int, world_size: int, host: str = "127.0.0.1",
                 timeout: timedelta = timedelta(seconds=300)):
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.timeout = timeout
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, 0))
        self.listener.listen(max(8, world_size))
        self.listener.setblocking(False)
        self.address = self.listener.getsockname()
        store.set(ADDR_KEY.format(rank=rank), f"{self.address[0]}:{self.address[1]}")
        self._out: dict[int, socket.socket] = {}  # peer -> the socket this rank sends on
        self._out_lock = threading.Lock()
        self._send_q: queue.SimpleQueue = queue.SimpleQueue()
        self._posted: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._arrived: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._posted_any: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # by tag
        self._stamps = itertools.count()  # arrival order, for receives from any source
        self._match_lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._new_socks: queue.SimpleQueue = queue.SimpleQueue()
        self._conns: dict[int, _Conn] = {}  # fd -> connection, owned by the receiver thread
        self._stop = False
        self.error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name=f"luwu-p2p-send-{rank}", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"luwu-p2p-recv-{rank}", daemon=True)
        self._sender.start()
        self._receiver.start()

    # -- API (any thread) ----------------------------------------------------------------------------
    def send(self, dst: int, tag: int, payload: bytes | memoryview, done: Callable[[BaseException | None], None]):
        self._check_peer(dst, "send to")
        self._send_q.put((dst, int(tag), payload, done))

    def recv(self, src: int, tag: int, deliver: Callable[[bytes], None],
             done: Callable[[BaseException | None], None]) -> None:
        """`deliver(payload)` then `done(None)` when the message arrives (`done(error)` if deliver raises)."""
        self._check_peer(src, "receive from")
        key = (src, int(tag))
        with self._match_lock:
            if self._arrived[key]:
                payload = self._arrived[key].popleft()[1]
            else:
                self._posted[key].append((deliver, done))
                return
        self._deliver(payload, deliver, done)

    def recv_any(self, tag: int, deliver: Callable[[int, bytes], None],
                 done: Callable[[BaseException | None], None]) -> None:
        """Like `recv` from whichever rank's message with `tag` arrived first: `deliver(src, payload)`.
        A message that arrives later goes to a receive posted for its source before one posted for
        any source."""
        tag = int(tag)
        with self._match_lock:
            waiting = [(q[0][0], key) for key, q in self._arrived.items() if key[1] == tag and q]
            if not waiting:
                self._posted_any[tag].append((deliver, done))
                return
            _, key = min(waiting)
            payload = self._arrived[key].popleft()[1]
        self._deliver(payload, lambda data: deliver(key[0], data), done)

    def close(self) -> None:
        self._stop = True
        self._send_q.put(None)
        self._wake_w.send(b"x")
        self._sender.join(5)
        self._receiver.join(5)
        error = P2PError("the luwu point-to-point channel was closed before this message completed")
        with self._match_lock:
            posted = [d for q in self._posted.values() for d in q] + [d for q in self._posted_any.values() for d in q]
            self._posted.clear()
            self._posted_any.clear()
        for _, done in posted:
            done(error)
        unread = []  # dialled but not yet taken up by the receiver thread
        while not self._new_socks.empty():
            unread.append(self._new_socks.get())
        for sock in set(self._out.values()) | {c.sock for c in self._conns.values()} | set(unread):
            sock.close()
        self._sel.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"luwu: cannot {what} rank {peer}: ranks are 0..{self.world_size - 1}")
        if peer == self.rank:
            raise ValueError(f"luwu: rank {self.rank} cannot {what} itself")

    # -- sending ---------------------------------------------------------------------------------------
    def _connection(self, peer: int) -> socket.socket:
        with self._out_lock:
            sock = self._out.get(peer)
        if sock is not None:
            return sock
        key = ADDR_KEY.format(rank=peer)
        try:
            self.store.wait([key], self.timeout)
            host, port = self.store.get(key).decode().rsplit(":", 1)
        except Exception as e:  # noqa: BLE001
            raise P2PError(f"rank {peer} never published its point-to-point address (is it running the same "
                           f"luwu process group?): {e}") from e
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=self.timeout.total_seconds())
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise P2PError(f"cannot connect to rank {peer} at {host}:{port} for send/recv: {e}; check "
                                   "LUWU_P2P_HOST on that rank and firewalls") from e
                time.sleep(CONNECT_RETRY)
        sock.settimeout(None)  # blocking: the receiver reads it only when the selector says it is readable
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(HEADER.pack(MAGIC, self.rank, HELLO_TAG, 0))  # hello: tells the peer who dialled
        with self._out_lock:
            existing = self._out.setdefault(peer, sock)
        # The receiver reads it even when this rank sends on another: the peer may answer on it, and
        # it must stay open -- if the peer's hello on its own connection arrived first here (so this
        # rank sends on that one), our hello may have arrived first there, and the peer sends on this.
        self._new_socks.put(sock)
        self._wake_w.send(b"x")
        return existing

    def _send_loop(self) -> None:
        while True:
            item = self._send_q.get()
            if item is None:
                return
            dst, tag, payload, done = item
            try:
                sock = self._connection(dst)
                view = memoryview(payload).cast("B")
                sock.sendall(HEADER.pack(MAGIC, self.rank, tag, len(view)))
                sock.sendall(view)
            except Exception as e:  # noqa: BLE001
                done(e if isinstance(e, P2PError) else P2PError(f"send to rank {dst} (tag {tag}) failed: {e}"))
                continue
            done(None)

    # -- receiving -------------------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        conns = self._conns
        while not self._stop:
            while not self._new_socks.empty():
                sock = self._new_socks.get()
                c = conns[sock.fileno()] = _Conn(sock)
                self._sel.register(sock, selectors.EVENT_READ, c)
            for key, _ in self._sel.select(timeout=1.0):
                if key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                elif key.data is None:
                    self._accept(conns)
                else:
                    self._read(key.data, conns)

    def _accept(self, conns: dict[int, _Conn]) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)  # shared with the sender thread, whose sendall must be able to wait
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = conns[sock.fileno()] = _Conn(sock)
        self._sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Conn, conns: dict[int, _Conn]) -> None:
        try:
            data = c.sock.recv(RECV_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._sel.unregister(c.sock)
            conns.pop(c.sock.fileno(), None)
            if c.peer is not None:
                with self._out_lock:
                    if self._out.get(c.peer) is not c.sock:
                        c.sock.close()
            else:
                c.sock.close()
            return
        c.buf += data
        while len(c.buf) >= HEADER.size:
            magic, src, tag, n = HEADER.unpack_from(c.buf)
            if magic != MAGIC:  # not a luwu peer: drop the connection, keep serving the others
                self._sel.unregister(c.sock)
                conns.pop(c.sock.fileno(), None)
                c.sock.close()
                return
            if len(c.buf) < HEADER.size + n:
                return
            payload = bytes(c.buf[HEADER.size: HEADER.size + n])
            del c.buf[: HEADER.size + n]
            if tag == HELLO_TAG:
                c.peer = src
                with self._out_lock:
                    self._out.setdefault(src, c.sock)  # answer on the connection the peer opened
                continue
            self._arrive(src, tag, payload)

    def _arrive(self, src: int, tag: int, payload: bytes) -> None:
        key = (src, tag)
        with self._match_lock:
            if self._posted[key]:
                deliver, done = self._posted[key].popleft()
            elif self._posted_any[tag]:
                deliver_any, done = self._posted_any[tag].popleft()
                deliver = lambda data: deliver_any(src, data)  # noqa: E731
            else:
                self._arrived[key].append((next(self._stamps), payload))
                return
        self._deliver(payload, deliver, done)

    @staticmethod
    def _deliver(payload: bytes, deliver, done) -> None:
        try:
            deliver(payload)
        except Exception as e:  # noqa: BLE001 - e.g. a size mismatch: that recv fails, the channel goes on
            done(e)
            return
        done(None)
