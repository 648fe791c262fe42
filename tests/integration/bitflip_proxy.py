"""A bit-flipping UDP proxy: a faulty NIC or switch memory between every endpoint and the switch.

For each switch port p the proxy holds two loopback sockets: `front[p]`, which the port's
endpoint (worker or optimizer node) is told is its switch, and `back[p]`, which the switch is told
is the port's endpoint (its configured peer, docs/protocol.md 6.8). Datagrams from the endpoint
go out of `back[p]` to the switch ("up"), datagrams from the switch go out of `front[p]` to the
endpoint ("down"). Anything from another source is dropped and counted (`foreign`).

Of the datagrams that are *valid* luwu packets (`protocol.looks_like_luwu`: right version, a
known type, the length the type implies), a fraction (default 1%) is corrupted before it is sent
on: 1..8 distinct random bits anywhere in the luwu datagram (header or payload) are flipped. The
UDP checksum stays valid because the proxy re-sends the modified bytes, as a NIC that corrupts a
frame in its buffer and then checksums it would. Invalid datagrams pass untouched.

Deterministic given the seed: each (port, direction) link draws from its own generator
(`random.Random` seeded with seed, port and direction), one draw per valid packet and, for a
corrupted one, the bit count and positions; so the i-th valid packet of a link meets the same
fate in every run with that seed, whatever the interleaving of the links.

Counted, per direction and per message type of the original packet: packets seen, valid,
corrupted; of the corrupted, how many had a bit flipped in the 32-byte header (`header_hit`) and
how many no longer look like luwu at all (`invalid_after`, dropped by any receiver's length,
version or type rules before the checks). From protocol version 2 on it also checks the header
check of every valid packet as it arrives (`arrived_bad_hcheck`, the first ones in `bad_seals`):
a sender that sealed a header wrong. `stats()` returns them.

Use it in this process (`BitflipProxy(...).start()`, a thread) or in a child process of its own
(`ProxyProcess`, this file run as a script: requests on stdin, one JSON line each, answers on
stdout), which keeps its per-packet Python work off the engines' GIL.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import socket
import subprocess
import sys
import threading
from collections import defaultdict

UP, DOWN = "up", "down"  # endpoint -> switch, switch -> endpoint
HEADER_LEN = 32
RECV_BUF = 1 << 16
BATCH = 64  # datagrams drained from one socket before the next is looked at
SOCKET_BUFFER = 8 << 20


def _looks_like_luwu():
    from luwu.dataplane.protocol import looks_like_luwu

    return looks_like_luwu


def _hcheck_ok():
    """A function telling whether a packet's header check (protocol v2) holds; None before v2."""
    from luwu.dataplane import protocol

    if protocol.VERSION < 2:
        return None
    from luwu.dataplane.integrity import HCHECK_OFFSET, header_check

    def ok(data: bytes | bytearray) -> bool:
        return header_check(data) == int.from_bytes(data[HCHECK_OFFSET:HCHECK_OFFSET + 2], "big")

    return ok


def _type_name(data: bytes | bytearray) -> str:
    from luwu.dataplane.protocol import MsgType

    t = data[0] & 0xF
    try:
        return MsgType(t).name
    except ValueError:
        return f"type{t}"


def _udp(host: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    s.bind((host, 0))
    s.setblocking(False)
    return s


class BitflipProxy:
    """Corrupts `fraction` of the valid luwu packets on every port, both directions.

    Args:
        ports: the switch ports to sit in front of.
        fraction: probability that a valid luwu packet is corrupted (0 disables corruption:
            a plain relay, for the control runs).
        seed: seeds every link's generator.
        max_bits: a corrupted packet gets 1..max_bits distinct flipped bits (uniform).
        directions: which directions corrupt (UP, DOWN or both); the other relays untouched.
        host: the loopback address the proxy binds.

    Examples:
        >>> proxy = BitflipProxy([1, 2], fraction=0.01, seed=7)
        >>> proxy.connect(endpoints={1: e1, 2: e2}, switch={1: s1, 2: s2}); proxy.start()
        >>> # endpoints send to proxy.front[p], the switch's port p peers with proxy.back[p]
    """

    def __init__(self, ports, fraction: float = 0.01, seed: int = 0, max_bits: int = 8,
                 directions=(UP, DOWN), host: str = "127.0.0.1"):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction {fraction} must be in [0, 1]")
        if not 1 <= max_bits <= 64:
            raise ValueError(f"max_bits {max_bits} must be in 1..64")
        self.ports = [int(p) for p in ports]
        self.fraction = float(fraction)
        self.seed = int(seed)
        self.max_bits = int(max_bits)
        self.directions = set(directions)
        self.front = {p: _udp(host) for p in self.ports}
        self.back = {p: _udp(host) for p in self.ports}
        self.endpoint: dict[int, tuple[str, int]] = {}
        self.switch: dict[int, tuple[str, int]] = {}
        self.rng = {(p, d): random.Random((self.seed << 20) | (p << 1) | (d == DOWN)) for p in self.ports
                    for d in (UP, DOWN)}
        self.counts: dict[str, dict[str, dict[str, int]]] = {UP: defaultdict(lambda: defaultdict(int)),
                                                             DOWN: defaultdict(lambda: defaultdict(int))}
        self.other = {"foreign": 0, "send_failed": 0, "unconnected": 0}
        self.log: list[tuple] = []  # (direction, port, type, length, bits) of the first corruptions
        self.log_limit = 200
        self._lock = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._looks = _looks_like_luwu()
        self._hcheck = _hcheck_ok()
        self.bad_seals: list[tuple] = []  # valid packets that arrived with a wrong header check (a sender's bug)

    def addresses(self) -> dict:
        """{"front": {port: (host, udp)}, "back": {...}}: what the endpoints and the switch must use."""
        return {"front": {p: s.getsockname()[:2] for p, s in self.front.items()},
                "back": {p: s.getsockname()[:2] for p, s in self.back.items()}}

    def connect(self, endpoints: dict, switch: dict) -> None:
        """Where each port's endpoint and the switch's port socket are (port -> (host, udp))."""
        with self._lock:
            self.endpoint.update({int(p): (str(a[0]), int(a[1])) for p, a in endpoints.items()})
            self.switch.update({int(p): (str(a[0]), int(a[1])) for p, a in switch.items()})

    # -- the relay -------------------------------------------------------------------------------
    def corrupt(self, data: bytearray, port: int, direction: str, mtype: str) -> bool:
        """Maybe corrupt `data` (a valid packet of type `mtype`) in place; True if it was."""
        rng = self.rng[(port, direction)]
        if rng.random() >= self.fraction or direction not in self.directions:
            return False
        k = rng.randint(1, self.max_bits)
        nbits = 8 * len(data)
        positions = rng.sample(range(nbits), min(k, nbits))
        for b in positions:
            data[b >> 3] ^= 0x80 >> (b & 7)
        c = self.counts[direction][mtype]
        c["corrupted"] += 1
        c["bits"] += len(positions)
        if min(positions) < 8 * HEADER_LEN:
            c["header_hit"] += 1
        if not self._looks(data):
            c["invalid_after"] += 1
        if len(self.log) < self.log_limit:
            self.log.append((direction, port, mtype, len(data), sorted(positions)))
        return True

    def _relay(self, sock: socket.socket, port: int, direction: str, buf: bytearray, view: memoryview) -> None:
        expect = self.endpoint.get(port) if direction == UP else self.switch.get(port)
        out_sock = self.back[port] if direction == UP else self.front[port]
        dest = self.switch.get(port) if direction == UP else self.endpoint.get(port)
        for _ in range(BATCH):
            try:
                n, src = sock.recvfrom_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error queued on the socket (a peer went away): next datagram
                continue
            if expect is None or dest is None:
                self.other["unconnected"] += 1
                continue
            if src[:2] != expect:
                self.other["foreign"] += 1
                continue
            data = bytearray(view[:n])
            with self._lock:
                valid = self._looks(data)
                mtype = _type_name(data) if n else "empty"
                c = self.counts[direction][mtype]
                c["seen"] += 1
                if valid:
                    c["valid"] += 1
                    if self._hcheck is not None and not self._hcheck(data):  # the sender sealed it wrong
                        c["arrived_bad_hcheck"] += 1
                        if len(self.bad_seals) < 20:
                            self.bad_seals.append((direction, port, mtype, n, bytes(data[:HEADER_LEN]).hex()))
                    self.corrupt(data, port, direction, mtype)
            try:
                out_sock.sendto(data, dest)
            except OSError:  # a full send buffer or an unreachable peer: lost, as on a real link
                self.other["send_failed"] += 1

    def run(self) -> None:
        """The relay loop (until `stop()`)."""
        sel = selectors.DefaultSelector()
        for p in self.ports:
            sel.register(self.front[p], selectors.EVENT_READ, (p, UP))
            sel.register(self.back[p], selectors.EVENT_READ, (p, DOWN))
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        buf = bytearray(RECV_BUF)
        view = memoryview(buf)
        try:
            while not self._stop:
                for key, _ in sel.select(0.5):
                    if key.data is None:
                        return
                    port, direction = key.data
                    self._relay(key.fileobj, port, direction, buf, view)
        finally:
            sel.close()

    def start(self) -> BitflipProxy:
        self._thread = threading.Thread(target=self.run, name="bitflip-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5.0)
        for s in (*self.front.values(), *self.back.values(), self._wake_r, self._wake_w):
            s.close()

    def stats(self) -> dict:
        """{"up"/"down": {type: {seen, valid, corrupted, bits, header_hit, invalid_after}}, "other": ...,
        "corrupted": total, "log": first corruptions}."""
        with self._lock:
            out = {d: {t: dict(c) for t, c in self.counts[d].items()} for d in (UP, DOWN)}
            out["other"] = dict(self.other)
            out["corrupted"] = sum(c.get("corrupted", 0) for d in (UP, DOWN) for c in self.counts[d].values())
            out["log"] = [list(e) for e in self.log]
            out["bad_seals"] = [list(e) for e in self.bad_seals]
        return out


class ProxyProcess:
    """A `BitflipProxy` in a child process (this file as a script), driven like LoopbackSwitch.

    Args: as BitflipProxy. `start()` returns the addresses; `connect()`, `stats()`, `stop()`.
    The child exits when its stdin closes, so it never outlives the test.
    """

    def __init__(self, ports, fraction: float = 0.01, seed: int = 0, max_bits: int = 8, directions=(UP, DOWN)):
        self.config = {"ports": list(ports), "fraction": fraction, "seed": seed, "max_bits": max_bits,
                       "directions": list(directions)}
        self.proc: subprocess.Popen | None = None
        self.front: dict[int, tuple[str, int]] = {}
        self.back: dict[int, tuple[str, int]] = {}

    def _ask(self, req: dict) -> dict:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bit-flipping proxy exited (code {self.proc.poll()})")
        return json.loads(line)

    def start(self) -> ProxyProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        got = self._ask(self.config)
        self.front = {int(p): (a[0], int(a[1])) for p, a in got["front"].items()}
        self.back = {int(p): (a[0], int(a[1])) for p, a in got["back"].items()}
        return self

    def connect(self, endpoints: dict, switch: dict) -> None:
        self._ask({"op": "connect", "endpoints": {str(p): list(a) for p, a in endpoints.items()},
                   "switch": {str(p): list(a) for p, a in switch.items()}})

    def stats(self) -> dict:
        return self._ask({"op": "stats"})

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self._ask({"op": "stop"})
        except (OSError, RuntimeError, ValueError):
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve() -> int:
    first = sys.stdin.readline()
    if not first:
        return 1
    cfg = json.loads(first)
    proxy = BitflipProxy(cfg["ports"], cfg.get("fraction", 0.01), cfg.get("seed", 0), cfg.get("max_bits", 8),
                         cfg.get("directions", (UP, DOWN)))
    addr = proxy.addresses()
    print(json.dumps({k: {str(p): list(a) for p, a in v.items()} for k, v in addr.items()}), flush=True)
    proxy.start()
    try:
        for line in sys.stdin:
            req = json.loads(line)
            op = req.get("op")
            if op == "connect":
                proxy.connect(req["endpoints"], req["switch"])
                print(json.dumps({"ok": True}), flush=True)
            elif op == "stats":
                print(json.dumps(proxy.stats()), flush=True)
            elif op == "stop":
                print(json.dumps({"stopped": True}), flush=True)
                break
            else:
                print(json.dumps({"error": f"unknown op {op!r}"}), flush=True)
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
