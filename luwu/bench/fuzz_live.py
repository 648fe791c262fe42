"""`luwu bench fuzz`'s honest side, in its own process: the live jobs' ranks and the sinks.

Each honest rank streams ALLREDUCE phases (int32 lanes, values a hash of job, rank, seq and lane,
so every sum is known) through its own switch port with a window of `pool` packets, paced to
`rate` phases per second per job, and goes back to its oldest missing result after `retry`
seconds without progress (RETX set). Every RESULT copy it receives is checked lane by lane against
the exact int32 sum; anything else that reaches an honest rank is an unexpected delivery. A rank
whose oldest phase does not complete within `hang` seconds is a hang (it stops). The sinks (job C's
idle rank and node, honest job 0's node) only drain and count what reaches them.

Talks to the bench over a pipe: it sends its socket addresses, receives the switch's port
addresses, then answers "status", and on "stop" finishes the phases it started and reports.
"""

from __future__ import annotations

import os
import select
import time

import numpy as np

from luwu.dataplane.engine.node_server import FallbackAggregator
from luwu.dataplane.integrity import seal_headers
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.protocol import HEADER_LEN, NODE, Dtype, Flag, MsgType, header_view, ver_type

HOST = "127.0.0.1"
MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)


def contribution(seed: int, job: int, rank: int, seqs: np.ndarray, lanes: int) -> np.ndarray:
    """Rank `rank`'s int32 values for phases `seqs` of job `job` (a splitmix64 hash per lane)."""
    key = np.uint64(((seed * 1_000_003 + job * 1009 + rank * 31 + 1) * MIX[3]) & 0xFFFFFFFFFFFFFFFF)
    x = (seqs.astype(np.uint64)[:, None] << np.uint64(20)) + np.arange(lanes, dtype=np.uint64)[None, :]
    x = x * np.uint64(MIX[0]) + key
    x ^= x >> np.uint64(30)
    x *= np.uint64(MIX[1])
    x ^= x >> np.uint64(27)
    x *= np.uint64(MIX[2])
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(32)).astype(np.uint32).view(np.int32)


def expected_sum(seed: int, job: int, ranks: int, seqs: np.ndarray, lanes: int) -> np.ndarray:
    total = np.zeros((len(seqs), lanes), dtype=np.int64)
    for r in range(ranks):
        total += contribution(seed, job, r, seqs, lanes)
    return total.astype(np.int32)  # int32 wrap-around, as the switch adds


class Rank:
    def __init__(self, job: int, rank: int, session: int, spec: dict):
        self.job, self.rank, self.session = job, rank, session
        self.lanes, self.pool, self.seed, self.ranks = spec["lanes"], spec["pool"], spec["seed"], spec["workers"]
        self.plen = HEADER_LEN + 4 * self.lanes
        self.sock = BatchSocket(udp_socket(HOST, 0), batch=64, max_len=65536, peers=1)
        self.address = self.sock.sock.getsockname()[:2]
        self.got = np.zeros(self.pool, dtype=bool)  # ring over [ack, nxt)
        self.ack = self.nxt = 0
        self.limit: int | None = None  # after "stop": the last phase the job started
        self.last_progress = time.monotonic()
        self.last_send = 0.0
        self.hung = False
        self.stats = {"sent": 0, "resent": 0, "results_checked": 0, "phases": 0, "wrong": 0, "unexpected": 0}
        self.rows = np.zeros((self.pool, self.plen), dtype=np.uint8)

    def wire(self, switch_addr) -> None:
        self.sock.set_peer(0, *switch_addr)
        self.sock.default_peer = 0

    @property
    def done(self) -> bool:
        return self.hung or (self.limit is not None and self.ack >= self.limit)

    def send(self, seqs: np.ndarray, retx: bool) -> None:
        n = len(seqs)
        rows = self.rows[:n]
        h = header_view(rows)
        h["ver_type"] = ver_type(MsgType.ALLREDUCE)
        h["flags"] = ((seqs // self.pool) & 1) | (int(Flag.RETX) if retx else 0)
        h["session"], h["worker"], h["count"] = self.session, self.rank, self.lanes
        h["seq"], h["slot"] = seqs, self.pool * (self.session - 1) + seqs % self.pool
        h["tensor"], h["offset"], h["dtype"] = self.job, (seqs * self.lanes) & 0xFFFFFFFF, int(Dtype.INT32)
        h["numel"] = 0
        seal_headers(rows)
        values = contribution(self.seed, self.job, self.rank, seqs, self.lanes)
        rows[:, HEADER_LEN:] = values.astype(">i4").view(np.uint8)
        self.sock.send_rows(self.rows, np.arange(n), np.full(n, self.plen, dtype=np.int64))
        self.stats["sent"] += n
        self.stats["resent"] += n if retx else 0
        self.last_send = time.monotonic()

    def pump(self, allowed: int, now: float, retry: float, hang: float) -> None:
        """Send new phases up to `allowed` (pacing) within the window; go back N after `retry` s."""
        if self.done:
            return
        end = min(self.ack + self.pool, allowed if self.limit is None else self.limit)
        if end > self.nxt:
            if self.ack == self.nxt:  # idle until now (pacing): the hang clock starts with this send
                self.last_progress = now
            self.send(np.arange(self.nxt, end, dtype=np.int64), False)
            self.nxt = end
        if self.ack < self.nxt and now - self.last_progress > hang:
            self.hung = True
        elif self.ack < self.nxt and now - max(self.last_progress, self.last_send) > retry:
            missing = np.arange(self.ack, self.nxt, dtype=np.int64)
            self.send(missing[~self.got[missing % self.pool]], True)

    def receive(self) -> None:
        while True:
            k = self.sock.recv()
            if not k:
                return
            rx, n = self.sock.rx[:k], self.sock.rx_len[:k]
            h = header_view(rx)
            seq = h["seq"].astype(np.int64)
            ok = ((n == self.plen) & (h["ver_type"] == ver_type(MsgType.RESULT)) & (h["session"] == self.session)
                  & (h["worker"] == NODE) & (h["count"] == self.lanes) & (h["tensor"] == self.job) & (seq < self.nxt)
                  & (h["offset"] == (seq * self.lanes) & 0xFFFFFFFF) & (h["dtype"] == int(Dtype.INT32)))
            self.stats["unexpected"] += int((~ok).sum())
            idx = np.flatnonzero(ok)
            if not len(idx):
                continue
            want = expected_sum(self.seed, self.job, self.ranks, seq[idx], self.lanes)
            lanes = rx[idx, HEADER_LEN:self.plen].copy().view(">i4").astype(np.int32)
            good = (lanes == want).all(axis=1)
            self.stats["results_checked"] += len(idx)
            self.stats["wrong"] += int((~good).sum())
            fresh = seq[idx][seq[idx] >= self.ack]
            self.got[fresh % self.pool] = True
            moved = False
            while self.ack < self.nxt and self.got[self.ack % self.pool]:
                self.got[self.ack % self.pool] = False
                self.ack += 1
                moved = True
            if moved:
                self.stats["phases"] = self.ack
                self.last_progress = time.monotonic()


class Sink:
    """An endpoint that only counts what reaches it, by message type. A node sink also runs the
    optimizer node's own FallbackAggregator over FALLBACK GRADs: a sum it completes from forged
    packets is one the real node would have handed to its optimizer."""

    def __init__(self, name: str, node_of: int = 0, lanes: int = 0):
        self.name = name
        self.fallback = FallbackAggregator(node_of, lanes) if node_of else None
        self.forged_sums = 0
        self.sock = BatchSocket(udp_socket(HOST, 0), batch=64, max_len=65536)
        self.address = self.sock.sock.getsockname()[:2]
        self.by_type: dict[str, int] = {}
        self.fallback_grads_by_worker: dict[int, int] = {}

    def receive(self) -> None:
        while True:
            k = self.sock.recv()
            if not k:
                return
            h = header_view(self.sock.rx[:k])
            for vt, flags, worker, n in zip(h["ver_type"].tolist(), h["flags"].tolist(), h["worker"].tolist(),
                                            self.sock.rx_len[:k].tolist()):
                name = MsgType(vt & 0xF).name if n >= HEADER_LEN and 1 <= vt & 0xF <= 7 else "other"
                self.by_type[name] = self.by_type.get(name, 0) + 1
                if name == "GRAD" and flags & Flag.FALLBACK:
                    self.fallback_grads_by_worker[worker] = self.fallback_grads_by_worker.get(worker, 0) + 1
            if self.fallback is not None:
                fb = np.flatnonzero((h["ver_type"] == ver_type(MsgType.GRAD)) & ((h["flags"] & Flag.FALLBACK) != 0)
                                    & (self.sock.rx_len[:k] == HEADER_LEN + 4 * self.fallback.lanes))
                self.forged_sums += len(self.fallback.absorb(self.sock.rx[:k], h, fb))


def live_main(conn, spec: dict) -> None:
    """Process entry point: spec has workers, lanes, pool, seed, rate, retry, hang."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    w = spec["workers"]
    ranks = [Rank(job, r, job + 1, spec) for job in range(2) for r in range(w)]
    sinks = {"idle_rank": Sink("idle_rank"), "c_node": Sink("c_node"),
             "honest_node": Sink("honest_node", node_of=w, lanes=spec["lanes"])}
    conn.send({"ranks": [r.address for r in ranks], "sinks": {k: s.address for k, s in sinks.items()}})
    ports = conn.recv()  # the switch's address of every rank's port, in order
    for r, addr in zip(ranks, ports):
        r.wire(addr)
    poller = select.poll()
    for sock in [r.sock for r in ranks] + [s.sock for s in sinks.values()]:
        poller.register(sock.fd, select.POLLIN)
    poller.register(conn.fileno(), select.POLLIN)
    conn.recv()  # "go"
    t0 = time.monotonic()
    stopping = False
    while True:
        now = time.monotonic()
        allowed = int(spec["rate"] * (now - t0)) + 1
        for r in ranks:
            r.receive()
            r.pump(allowed, now, spec["retry"], spec["hang"])
        for s in sinks.values():
            s.receive()
        if conn.poll():
            msg = conn.recv()
            if msg == "status":
                conn.send(_report(ranks, sinks, time.process_time()))
            elif msg == "stop" and not stopping:
                stopping = True
                for job in range(2):  # every rank of a job finishes the phases any rank started
                    last = max(r.nxt for r in ranks if r.job == job)
                    for r in ranks:
                        if r.job == job:
                            r.limit = last
        if stopping and all(r.done for r in ranks):
            break
        poller.poll(2)
    for s in sinks.values():
        s.receive()
    conn.send(_report(ranks, sinks, time.process_time()))


def _report(ranks: list[Rank], sinks: dict[str, Sink], cpu: float) -> dict:
    total = {k: sum(r.stats.get(k, 0) for r in ranks) for k in ("sent", "resent", "results_checked", "wrong",
                                                                  "unexpected")}
    jobs = {}
    for job in range(2):
        rs = [r for r in ranks if r.job == job]
        jobs[job] = {"phases_completed": min(r.ack for r in rs), "hung_ranks": sum(r.hung for r in rs)}
    return {**total, "hangs": sum(r.hung for r in ranks), "jobs": jobs, "cpu_s": cpu,
            "sinks": {k: {"by_type": s.by_type, "fallback_grads_by_worker": s.fallback_grads_by_worker,
                          "forged_sums": s.forged_sums,
                          "node_rejected": s.fallback.rejected if s.fallback is not None else 0}
                      for k, s in sinks.items()}}
