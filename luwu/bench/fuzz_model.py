"""`luwu bench fuzz`'s world: the switch's wiring and tables, the attack packets, and an
independent model of what the switch must do with each of them.

The model is written from docs/protocol.md (6.7's validation order, 6.8's source guard, the UDP
attachment's peer binding), not from the switch's code, so the bench can hold the running switch
to it: every attack packet gets a predicted fate (a drop reason, or the stateful path it takes),
and the switch's counters must add up to the predictions exactly.

Wiring (switch ports, `W` = ranks per honest job):

    1 .. W        honest job 0, ranks 0..W-1 (collective session 1; node session 5)
    W+1 .. 2W     honest job 1, ranks 0..W-1 (collective session 2)
    2W+1          the compromised rank: rank 0 of the attacker's own job C (sessions 3 and 4);
                  the attacker owns this rank's socket, so it sends from a bound port
    2W+2          job C's other rank (an idle sink)
    2W+3          job C's optimizer node (a sink)
    2W+4          honest job 0's optimizer node (a sink: anything it receives was forged)
    2W+5          a spare port with no configured peer (the attacker's unbound socket sends to it)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luwu.dataplane.integrity import TRAILER_LEN, headers_ok, seal_headers, wire_len
from luwu.dataplane.protocol import (
    DATA_HEADER,
    DTYPE_ITEMSIZE,
    HEADER_LEN,
    MAX_UDP_PAYLOAD,
    NODE,
    VERSION,
    DropReason,
    Dtype,
    Flag,
    MsgType,
    NextStep,
    aggregation_packet_len,
    header_view,
    ver_type,
)

# attack sources
COMPROMISED = 0  # the socket of job C's rank 0 (the peer of its switch port)
UNBOUND = 1  # a socket that is nobody's peer

KINDS = ("random", "mutated", "fields", "spoofed", "truncated", "oversized", "foreign")

# predicted fates beyond the drop reasons (codes above any DropReason)
AGGREGATE = 100  # slot state machine: one of ABSORBED / COMPLETED / RESENT or drop DUPLICATE
FALLBACK = 101  # GRAD forwarded unaggregated to the session's node (event FALLBACK)
FALLBACK_NO_ROUTE = 102  # the same in a session with no node: event FALLBACK and a NO_ROUTE copy
HEARTBEAT = 103  # a worker heartbeat: HB_ROUND or HB_ABSORBED
MULTICAST = 104  # PARAM/HEARTBEAT from the node, RESULT from a parent
PULL = 105  # unicast to the node
FATE_NAMES = {AGGREGATE: "aggregate", FALLBACK: "fallback", FALLBACK_NO_ROUTE: "fallback_no_route",
              HEARTBEAT: "heartbeat", MULTICAST: "multicast", PULL: "pull"}
STATELESS = (DropReason.MALFORMED, DropReason.BAD_VERSION, DropReason.BAD_TYPE, DropReason.UNKNOWN_SESSION,
             DropReason.UNKNOWN_WORKER, DropReason.FOREIGN_SLOT, DropReason.BAD_DIRECTION,
             DropReason.UNKNOWN_PORT, DropReason.SPOOFED)

# well-known non-luwu UDP payloads (their first byte decides the luwu reason they meet)
FOREIGN_PAYLOADS = (
    bytes.fromhex("abcd01000001000000000000076578616d706c6503636f6d0000010001"),  # DNS query
    b"\x1b" + bytes(47),  # NTP client request
    b"M-SEARCH * HTTP/1.1\r\nHOST: 239.255.255.250:1900\r\nMAN: \"ssdp:discover\"\r\nMX: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    bytes.fromhex("c3000000010844d6") + bytes(1192),  # a QUIC long-header Initial (padded)
    b"<134>1 2026-01-01T00:00:00Z host app - - - syslog line",
    bytes(64),  # all zero
)


@dataclass(frozen=True)
class Topology:
    workers: int  # ranks per honest job
    lanes: int
    pool: int  # slots per session pool (a power of two)

    @property
    def packet_len(self) -> int:
        return aggregation_packet_len(self.lanes)

    def honest_port(self, job: int, rank: int) -> int:
        return 1 + job * self.workers + rank

    @property
    def compromised_port(self) -> int:
        return 2 * self.workers + 1

    @property
    def idle_rank_port(self) -> int:
        return 2 * self.workers + 2

    @property
    def c_node_port(self) -> int:
        return 2 * self.workers + 3

    @property
    def honest_node_port(self) -> int:
        return 2 * self.workers + 4

    @property
    def spare_port(self) -> int:
        return 2 * self.workers + 5

    @property
    def ports(self) -> list[int]:
        return list(range(1, self.spare_port + 1))

    @property
    def slots(self) -> int:
        return 5 * self.pool

    def sessions(self) -> dict[int, dict]:
        """session -> base, members {rank: port}, up_port, mcast group, epoch."""
        w = self.workers
        job0 = {r: self.honest_port(0, r) for r in range(w)}
        job1 = {r: self.honest_port(1, r) for r in range(w)}
        c = {0: self.compromised_port, 1: self.idle_rank_port}
        c_alone = {0: self.compromised_port}  # job C's collective: N = 1, so its packets complete sums
        return {
            1: {"base": 0, "members": job0, "up_port": 0, "mcast": 1, "epoch": 101},
            2: {"base": self.pool, "members": job1, "up_port": 0, "mcast": 2, "epoch": 102},
            3: {"base": 2 * self.pool, "members": c, "up_port": self.c_node_port, "mcast": 3, "epoch": 103},
            4: {"base": 3 * self.pool, "members": c_alone, "up_port": self.c_node_port, "mcast": 4, "epoch": 104},
            5: {"base": 4 * self.pool, "members": job0, "up_port": self.honest_node_port, "mcast": 1, "epoch": 105},
        }

    def runtime(self) -> dict:
        """The switch's tables (runtime JSON, docs/protocol.md 6.1)."""
        entries, groups = [], {}
        for sid, s in self.sessions().items():
            ranks = sorted(s["members"])
            entries.append({"table": "sessions", "match": {"session": sid}, "action_name": "set_session",
                            "action_params": {"pool_base": s["base"], "pool_size": self.pool,
                                              "num_workers": len(ranks), "worker_mask": (1 << len(ranks)) - 1,
                                              "epoch": s["epoch"], "mcast_grp": s["mcast"],
                                              "next_step": int(NextStep.ROOT), "up_port": s["up_port"],
                                              "up_worker": 0}})
            for i, r in enumerate(ranks):
                entries.append({"table": "workers", "match": {"session": sid, "worker": r},
                                "action_name": "set_worker",
                                "action_params": {"worker_bit": 1 << i, "port": s["members"][r]}})
            groups[s["mcast"]] = [{"egress_port": s["members"][r], "instance": r} for r in ranks]
        return {"table_entries": entries,
                "multicast_group_entries": [{"multicast_group_id": g, "replicas": reps} for g, reps in groups.items()]}


# --- the independent model ----------------------------------------------------------------------

class Model:
    """Predicts the fate of datagrams (vectorised) from the topology alone."""

    def __init__(self, topo: Topology, max_datagram: int):
        self.topo = topo
        self.max_datagram = max_datagram  # the switch's receive buffer: longer datagrams arrive truncated
        sessions = topo.sessions()
        self.session_ok = np.zeros(1 << 16, dtype=bool)
        self.base = np.zeros(1 << 16, dtype=np.int64)
        self.up_port = np.zeros(1 << 16, dtype=np.int64)
        self.worker_port = {}  # (session, worker) -> port
        for sid, s in sessions.items():
            self.session_ok[sid] = True
            self.base[sid] = s["base"]
            self.up_port[sid] = s["up_port"]
            for r, p in s["members"].items():
                self.worker_port[(sid, r)] = p
        self.wkey = np.array(sorted(sid << 16 | r for sid, r in self.worker_port), dtype=np.int64)
        self.wport = np.array([self.worker_port[(k >> 16, k & 0xFFFF)] for k in self.wkey], dtype=np.int64)
        self.item = np.zeros(256, dtype=np.int64)
        for d, n in DTYPE_ITEMSIZE.items():
            self.item[int(d)] = n
        # the UDP attachment's binding: which source each port accepts (a port with no peer: none)
        self.owner = np.full(topo.spare_port + 1, 99, dtype=np.int64)  # honest endpoints' addresses
        self.owner[topo.compromised_port] = COMPROMISED
        self.owner[topo.spare_port] = -1

    def predict(self, rows: np.ndarray, length: np.ndarray, port: np.ndarray, src: np.ndarray) -> np.ndarray:
        """Fates (DropReason codes or the fates above) of datagrams `rows[i, :length[i]]` sent from
        `src[i]` to switch port `port[i]` (`length` = the datagram's size as sent)."""
        n = len(length)
        fate = np.zeros(n, dtype=np.int64)

        def drop(mask, reason):
            fate[(fate == 0) & mask] = int(reason)

        owner = self.owner[port]
        drop(owner != src, DropReason.UNKNOWN_PORT)  # an unbound port refuses everyone
        drop((length < HEADER_LEN) | (length > self.max_datagram), DropReason.MALFORMED)
        drop(~headers_ok(rows[:, :HEADER_LEN]), DropReason.BAD_CHECKSUM)  # the header check first (protocol.md 3.5)
        h = header_view(rows)
        version, mtype = h["ver_type"] >> 4, (h["ver_type"] & 0xF).astype(np.int64)
        drop(version != VERSION, DropReason.BAD_VERSION)
        drop((mtype < MsgType.GRAD) | (mtype > MsgType.PULL), DropReason.BAD_TYPE)
        count = h["count"].astype(np.int64)
        agg = (mtype >= MsgType.GRAD) & (mtype <= MsgType.RESULT)
        want = np.full(n, -1, dtype=np.int64)
        # the whole chunks the count needs (docs/protocol.md 3.3), 4-byte lanes for every dtype (FIXED16 too, 5.2)
        want[agg] = wire_len(count[agg], h["dtype"][agg], h["flags"][agg], self.topo.lanes)
        # header-only ZERO contributions: INT32 GRAD/ALLREDUCE only (protocol.md 3.2)
        zero = agg & ((h["flags"] & Flag.ZERO) != 0)
        zero_ok = zero & ((mtype == MsgType.GRAD) | (mtype == MsgType.ALLREDUCE)) & (h["dtype"] == Dtype.INT32)
        want[zero] = np.where(zero_ok[zero], HEADER_LEN, -1)
        item = self.item[h["dtype"]]
        is_param = mtype == MsgType.PARAM
        want[is_param] = np.where(item[is_param] > 0, HEADER_LEN + count[is_param] * item[is_param] + TRAILER_LEN, -1)
        want[mtype == MsgType.HEARTBEAT] = HEADER_LEN
        is_pull = mtype == MsgType.PULL
        want[is_pull] = HEADER_LEN + 12 * count[is_pull] + TRAILER_LEN
        most = np.where(h["dtype"] == Dtype.FIXED16, 2 * self.topo.lanes, self.topo.lanes)  # FIXED16: 2 values a lane
        drop((length != want) | (agg & (count > most)), DropReason.MALFORMED)
        session = h["session"].astype(np.int64)
        drop(~self.session_ok[session], DropReason.UNKNOWN_SESSION)
        worker = h["worker"].astype(np.int64)
        from_node = worker == NODE
        key = session << 16 | worker
        pos = np.minimum(np.searchsorted(self.wkey, key), len(self.wkey) - 1)
        known = self.wkey[pos] == key
        passing = (mtype == MsgType.GRAD) & ((h["flags"] & Flag.FALLBACK) != 0)
        drop(~from_node & ~known & ~passing, DropReason.UNKNOWN_WORKER)
        # a passing GRAD (a rank this switch does not know) must come from a child switch's port;
        # a star has none (protocol.md 6.8)
        drop(np.where(from_node, self.up_port[session] != port, (known & (self.wport[pos] != port)) | ~known),
             DropReason.SPOOFED)
        contributes = (mtype == MsgType.GRAD) | (mtype == MsgType.ALLREDUCE)
        wrong_way = ((contributes & from_node) | (mtype == MsgType.AGG) | (mtype == MsgType.RESULT)  # all roots here
                     | ((mtype == MsgType.PARAM) & ~from_node) | (is_pull & from_node))
        drop(wrong_way, DropReason.BAD_DIRECTION)
        in_pool = ((h["slot"].astype(np.int64) - self.base[session]) & 0xFFFFFFFF) < self.topo.pool
        drop((mtype == MsgType.ALLREDUCE) & ~in_pool, DropReason.FOREIGN_SLOT)
        live = fate == 0
        to_node = passing | ((mtype == MsgType.GRAD) & ~in_pool)
        fate[live & contributes & ~to_node] = AGGREGATE
        fwd = live & (mtype == MsgType.GRAD) & to_node
        fate[fwd] = np.where(self.up_port[session[fwd]] > 0, FALLBACK, FALLBACK_NO_ROUTE)
        hb = live & (mtype == MsgType.HEARTBEAT)
        fate[hb & ~from_node] = HEARTBEAT
        fate[hb & from_node] = MULTICAST
        fate[live & is_param] = MULTICAST
        fate[live & is_pull] = PULL
        assert not (fate == 0).any(), "the model left a packet without a fate"
        return fate


# --- the attack ------------------------------------------------------------------------------------

def _reseal(rows: np.ndarray, idx: np.ndarray) -> None:
    """A matching header check on rows `idx` (attack packets that get past the parser)."""
    if len(idx):
        hb = rows[idx, :HEADER_LEN]
        seal_headers(hb)
        rows[idx, :HEADER_LEN] = hb


class Attack:
    """Blocks of attack datagrams: rows (small ones) or a separate buffer (oversized ones)."""

    def __init__(self, topo: Topology, seed: int, block: int):
        self.topo = topo
        self.rng = np.random.default_rng(seed)
        self.block = block
        self.width = max(topo.packet_len, 1300)  # rows hold every datagram but the oversized ones
        self.rows = np.zeros((block, self.width), dtype=np.uint8)
        self.big = np.zeros((block, MAX_UDP_PAYLOAD), dtype=np.uint8)  # oversized datagrams (row i <- packet i)
        s = topo.sessions()
        self.claims = [(sid, r) for sid in s for r in s[sid]["members"]] + [(sid, NODE) for sid in s]
        self.honest_claims = [(sid, r) for sid, r in self.claims if sid in (1, 2, 5)]
        self.own_claims = [(sid, r) for sid, r in self.claims if sid in (3, 4) and r == 0]
        self.peered = [p for p in topo.ports if p != topo.spare_port]

    def _valid(self, idx: np.ndarray, claims: list[tuple[int, int]]) -> None:
        """Write well-formed packets (ALLREDUCE, GRAD, HEARTBEAT, PARAM, PULL) for `claims` into rows idx."""
        rng, topo, rows = self.rng, self.topo, self.rows
        n = len(idx)
        c = np.array(claims, dtype=np.int64)[rng.integers(0, len(claims), n)]
        mtype = rng.choice([MsgType.ALLREDUCE] * 4 + [MsgType.GRAD] * 2 + [MsgType.HEARTBEAT, MsgType.PARAM,
                                                                           MsgType.PULL], n).astype(np.int64)
        rows[idx] = 0
        hb = np.zeros((n, HEADER_LEN), dtype=np.uint8)
        h = hb.view(DATA_HEADER)[:, 0]
        seq = rng.integers(0, 1 << 12, n)
        sessions = topo.sessions()
        base = np.array([sessions.get(int(sid), {"base": 0})["base"] for sid in c[:, 0]], dtype=np.int64)
        h["ver_type"] = [ver_type(t) for t in mtype]
        h["session"], h["worker"], h["seq"] = c[:, 0], c[:, 1], seq
        agg = (mtype == MsgType.ALLREDUCE) | (mtype == MsgType.GRAD)
        h["flags"] = np.where(agg, (seq // topo.pool) & 1, 0)
        h["slot"] = np.where(agg, base + seq % topo.pool, rng.integers(0, 8, n))
        h["count"] = np.where(agg, rng.integers(1, topo.lanes + 1, n), 0)
        h["dtype"] = np.where(agg, int(Dtype.INT32), int(Dtype.FP32))
        h["tensor"], h["numel"] = rng.integers(0, 64, n), topo.lanes * 64
        h["offset"] = (seq * topo.lanes) & 0xFFFFFFFF
        pc = rng.integers(1, 9, n)
        h["count"] = np.where(mtype == MsgType.PARAM, pc * 4, np.where(mtype == MsgType.PULL, pc, h["count"]))
        length = np.select([agg, mtype == MsgType.HEARTBEAT, mtype == MsgType.PARAM],
                           [wire_len(h["count"].astype(np.int64), int(Dtype.INT32), 0, topo.lanes), HEADER_LEN, HEADER_LEN + 16 * pc + TRAILER_LEN],
                           HEADER_LEN + 12 * pc + TRAILER_LEN)  # (the trailer's value is the switch's no concern)
        seal_headers(hb)
        rows[idx, :HEADER_LEN] = hb
        payload = rng.integers(0, 256, (n, topo.packet_len - HEADER_LEN), dtype=np.uint8)
        keep = np.arange(HEADER_LEN, topo.packet_len)[None, :] < length[:, None]
        rows[idx, HEADER_LEN:topo.packet_len] = np.where(keep, payload, 0)
        self._len[idx] = length

    def next_block(self, n: int):
        """n attack datagrams: (rows, big, length, port, src, kind, oversized) -- row i of `big`
        holds datagram i when oversized[i], else row i of `rows`."""
        rng, topo = self.rng, self.topo
        self._len = np.zeros(n, dtype=np.int64)
        kind = rng.integers(0, len(KINDS), n)
        # where it comes from: mostly the compromised rank's own (bound) port, where it meets the pipeline
        r = rng.random(n)
        src = np.where(r < 0.75, COMPROMISED, UNBOUND)
        port = np.where(r < 0.65, topo.compromised_port, 0)
        port = np.where((r >= 0.65) & (r < 0.9), np.array(self.peered)[rng.integers(0, len(self.peered), n)], port)
        port = np.where(r >= 0.9, topo.spare_port, port)
        rows = self.rows[:n]

        def of(k):
            return np.flatnonzero(kind == KINDS.index(k))

        i = of("random")
        self._len[i] = rng.integers(0, 300, len(i))
        rows[i] = rng.integers(0, 256, (len(i), self.width), dtype=np.uint8)
        for k in ("mutated", "fields", "truncated", "oversized"):
            j = of(k)
            # mostly the live honest jobs' packets (the switch must refuse them from here), some of job C's own
            own = rng.random(len(j)) < 0.3
            self._valid(j[~own], self.honest_claims)
            self._valid(j[own], self.own_claims)
        i = of("mutated")  # 1-8 header bits flipped
        for _ in range(8):
            live = rng.random(len(i)) < 0.6
            bit = rng.integers(0, 8 * HEADER_LEN, len(i))
            rows[i[live], bit[live] // 8] ^= (1 << (bit[live] % 8)).astype(np.uint8)
        rows[i[rng.random(len(i)) < 0.5], 0] = ver_type(MsgType.ALLREDUCE)  # keep half valid-looking at byte 0
        _reseal(rows, i[rng.random(len(i)) < 0.5])  # half past the header check, to the checks behind it
        i = of("fields")  # random values in chosen fields
        hb = rows[i, :HEADER_LEN].copy()
        h = hb.view(DATA_HEADER)[:, 0]
        pick = rng.random((len(i), 8)) < 0.35
        h["ver_type"] = np.where(pick[:, 0], rng.integers(0, 256, len(i)), h["ver_type"])
        h["flags"] = np.where(pick[:, 1], rng.integers(0, 256, len(i)), h["flags"])
        h["session"] = np.where(pick[:, 2], rng.choice([0, 1, 2, 3, 4, 5, 6, 1023, 65535], len(i)), h["session"])
        h["worker"] = np.where(pick[:, 3], rng.choice([0, 1, 2, 3, 31, 32, NODE, 65534], len(i)), h["worker"])
        h["count"] = np.where(pick[:, 4], rng.integers(0, 2 * topo.lanes + 2, len(i)), h["count"])
        h["slot"] = np.where(pick[:, 5], rng.integers(0, 8 * topo.pool, len(i)), h["slot"])
        h["seq"] = np.where(pick[:, 6], rng.integers(0, 1 << 32, len(i)), h["seq"])
        h["dtype"] = np.where(pick[:, 7], rng.integers(0, 8, len(i)), h["dtype"])
        rows[i, :HEADER_LEN] = hb
        _reseal(rows, i[rng.random(len(i)) < 0.8])
        i = of("spoofed")  # a valid packet in another's name
        self._valid(i, self.honest_claims + [(3, 1), (3, NODE), (4, NODE)])
        hv = header_view(rows[i])
        claim_port = np.array([self._claim_port(int(s), int(w)) for s, w in zip(hv["session"], hv["worker"])])
        from_own = rng.random(len(i)) < 0.5  # from the compromised rank's port, or from a wrong address
        from_own |= claim_port == 0  # a collective's node has no port: forge it from the compromised one
        port[i] = np.where(from_own, topo.compromised_port, claim_port)
        src[i] = np.where(from_own | (rng.random(len(i)) < 0.5), COMPROMISED, UNBOUND)
        i = of("truncated")
        self._len[i] = rng.integers(0, self._len[i])
        i = of("oversized")
        over = np.zeros(n, dtype=bool)
        over[i] = True
        for j in i.tolist():
            full = int(self._len[j])
            self._len[j] = int(rng.choice([full + 1, full + 4, full + 1000, 9000, MAX_UDP_PAYLOAD,
                                           int(rng.integers(full + 1, MAX_UDP_PAYLOAD + 1))]))
            self.big[j, :full] = rows[j, :full]
        i = of("foreign")
        for j, f in zip(i.tolist(), rng.integers(0, len(FOREIGN_PAYLOADS), len(i)).tolist()):
            data = FOREIGN_PAYLOADS[f]
            rows[j, :len(data)] = np.frombuffer(data, dtype=np.uint8)
            self._len[j] = len(data)
        return rows, self.big[:n], self._len.copy(), port, src, kind, over

    def _claim_port(self, session: int, worker: int) -> int:
        s = self.topo.sessions()[session]
        return s["up_port"] if worker == NODE else s["members"][worker]

    def model_rows(self, rows: np.ndarray, big: np.ndarray, over: np.ndarray) -> np.ndarray:
        """The first bytes of every datagram (the header) in one array, for the model."""
        out = rows[:, :HEADER_LEN].copy()
        out[over] = big[over, :HEADER_LEN]
        return out
