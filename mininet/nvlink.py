"""The GPUs of one rail-only server talking over their NVLink bridge (emulated: TCP on the `nv0` link).

A rail-only fabric has no path between rails, so an allreduce over all GPUs is hierarchical
(Wang et al.): a reduce-scatter inside each server over NVLink (GPU k gets shard k of the
server's sum), an in-network allreduce of shard k on rail k, then an all-gather inside the server.
`NvlinkPeers` does the two intra-server steps: one TCP connection from every GPU to every other,
frames of (sender, tag, bytes), a reader thread per incoming connection so sends never block on
a peer that is still sending. Every wait is bounded.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time

import numpy as np

from luwu.dataplane.net.framing import recv_exact
from luwu.worker.backend.hierarchy import shard_bounds  # the backend's rail-only shards: the same cut

FRAME = struct.Struct("!HHQ")  # sender index, tag, payload bytes
HELLO = struct.Struct("!H")  # the connecting GPU's index
WIRE_DTYPE = "<i4"  # int32, one byte order on every GPU
TAG_REDUCE_SCATTER, TAG_ALL_GATHER = 1, 2
CONNECT_RETRY = 0.05  # s between connection attempts while a peer's listener is not up yet


class NvlinkError(RuntimeError):
    """A peer GPU could not be reached, or did not send in time."""


class NvlinkPeers:
    def __init__(self, index: int, addresses: list[str], port: int, timeout: float):
        self.index = index
        self.addresses = addresses
        self.port = port
        self.timeout = timeout
        self.listener = socket.create_server((addresses[index], port), backlog=len(addresses))
        self.out: dict[int, socket.socket] = {}
        self.inbox: dict[tuple[int, int], queue.Queue] = {}
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _box(self, peer: int, tag: int) -> queue.Queue:
        with self._lock:
            return self.inbox.setdefault((peer, tag), queue.Queue())

    def connect(self) -> None:
        """Connect to every peer and accept every peer's connection (both within the timeout)."""
        deadline = time.monotonic() + self.timeout
        peers = [j for j in range(len(self.addresses)) if j != self.index]
        for j in peers:
            while True:
                try:
                    s = socket.create_connection((self.addresses[j], self.port),
                                                 timeout=max(0.1, deadline - time.monotonic()))
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise NvlinkError(f"GPU {self.index}: cannot reach GPU {j} at {self.addresses[j]}:{self.port} "
                                          f"over NVLink: {e}") from None
                    time.sleep(CONNECT_RETRY)
            s.settimeout(self.timeout)
            s.sendall(HELLO.pack(self.index))
            self.out[j] = s
        self.listener.settimeout(max(0.1, deadline - time.monotonic()))
        for _ in peers:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                raise NvlinkError(f"GPU {self.index}: not every peer connected within {self.timeout} s") from None
            conn.settimeout(self.timeout)
            (peer,) = HELLO.unpack(recv_exact(conn, HELLO.size))
            conn.settimeout(None)  # readers idle while the rail works; recv() bounds every wait instead
            t = threading.Thread(target=self._read, args=(peer, conn), daemon=True)
            t.start()
            self._readers.append(t)

    def _read(self, peer: int, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    head = recv_exact(conn, FRAME.size, eof_ok=True)
                    if not head:
                        return
                    sender, tag, n = FRAME.unpack(head)
                    self._box(sender, tag).put(np.frombuffer(recv_exact(conn, n), dtype=WIRE_DTYPE).astype(np.int32))
            except (OSError, ConnectionError) as e:
                for tag in (TAG_REDUCE_SCATTER, TAG_ALL_GATHER):
                    self._box(peer, tag).put(NvlinkError(f"GPU {peer}: connection lost: {e}"))

    def send(self, peer: int, tag: int, x: np.ndarray) -> None:
        data = np.ascontiguousarray(x, dtype=WIRE_DTYPE).tobytes()
        self.out[peer].sendall(FRAME.pack(self.index, tag, len(data)) + data)

    def recv(self, peer: int, tag: int) -> np.ndarray:
        try:
            got = self._box(peer, tag).get(timeout=self.timeout)
        except queue.Empty:
            raise NvlinkError(f"GPU {self.index}: nothing from GPU {peer} within {self.timeout} s") from None
        if isinstance(got, Exception):
            raise got
        return got

    def close(self) -> None:
        for s in self.out.values():
            s.close()
        self.listener.close()


def hierarchical_allreduce(peers: NvlinkPeers, x: np.ndarray, rail_allreduce) -> tuple[np.ndarray, dict]:
    """Sum `x` over every GPU of every server: NVLink reduce-scatter, `rail_allreduce(shard)` on this
    GPU's rail, NVLink all-gather. int32 sums wrap like the switch's."""
    k, parts = peers.index, len(peers.addresses)
    bounds = shard_bounds(x.size, parts)
    t0 = time.monotonic()
    for j in range(parts):
        if j != k:
            peers.send(j, TAG_REDUCE_SCATTER, x[bounds[j][0]:bounds[j][1]])
    lo, hi = bounds[k]
    partial = x[lo:hi].astype(np.int64)
    for j in range(parts):
        if j != k:
            partial += peers.recv(j, TAG_REDUCE_SCATTER)
    partial = partial.astype(np.int32)  # modular: the same wrap as summing in int32
    t1 = time.monotonic()
    mine = rail_allreduce(partial)
    t2 = time.monotonic()
    out = np.empty_like(x)
    out[lo:hi] = mine
    for j in range(parts):
        if j != k:
            peers.send(j, TAG_ALL_GATHER, mine)
    for j in range(parts):
        if j != k:
            out[bounds[j][0]:bounds[j][1]] = peers.recv(j, TAG_ALL_GATHER)
    t3 = time.monotonic()
    return out, {"reduce_scatter_s": t1 - t0, "rail_allreduce_s": t2 - t1, "all_gather_s": t3 - t2}
