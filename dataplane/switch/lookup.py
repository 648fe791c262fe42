"""Dense, read-only numpy views of the tables for the vectorised pipeline.

Rebuilt by `Tables.compiled()` whenever an entry changes (entries change rarely, packets never
stop). Small key spaces are direct-indexed arrays (`sessions` by id, the drop simulators by
port, multicast groups by id); two-field exact keys (`workers`, `endpoints`, `child_ports`) are sorted 32-bit
keys searched with `np.searchsorted`; `ipv4_lpm` is one sorted array per prefix length present.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from ..protocol import MAX_SESSIONS
from .table_schema import MULTICAST_GROUP_BITS, PORT_BITS

NO_ENTRY = -1
PAIR_CACHE = 4096  # `ScalarTables.pair_row` answers kept per tables version
SESSION_PARAMS = ("pool_base", "pool_size", "num_workers", "worker_mask", "epoch", "mcast_grp", "next_step",
                  "up_port", "up_worker")


class ExactPairs:
    """An exact table keyed by (a:16, b:16): sorted keys `a << 16 | b` and one array per param."""

    def __init__(self, rows: dict, names: tuple[str, ...]):
        items = sorted(((a << 16) | b, params) for (a, b), (_, params) in rows.items())
        self.keys = np.array([k for k, _ in items], dtype=np.int64)
        self.params = {n: np.array([p[n] for _, p in items], dtype=np.int64) for n in names}

    def find(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hit, row) for every (a, b); `row` is meaningful where `hit`."""
        q = (a.astype(np.int64) << 16) | b.astype(np.int64)
        n = len(self.keys)
        if n == 0:
            return np.zeros(len(q), dtype=bool), np.zeros(len(q), dtype=np.int64)
        i = np.minimum(np.searchsorted(self.keys, q), n - 1)
        return self.keys[i] == q, i


class CompiledTables:
    def __init__(self, version: int, entries: dict, defaults: dict, groups: dict):
        self.version = version
        # sessions, direct-indexed by id (0 never valid)
        self.s_valid = np.zeros(MAX_SESSIONS, dtype=bool)
        self.s = {n: np.zeros(MAX_SESSIONS, dtype=np.int64) for n in SESSION_PARAMS}
        for (sid,), (_, p) in entries["sessions"].items():
            self.s_valid[sid] = True
            for n in SESSION_PARAMS:
                self.s[n][sid] = p[n]
        self.s["log2_pool"] = np.zeros(MAX_SESSIONS, dtype=np.int64)
        nz = self.s["pool_size"] > 0
        self.s["log2_pool"][nz] = np.log2(self.s["pool_size"][nz]).astype(np.int64)
        self.workers = ExactPairs(entries["workers"], ("worker_bit", "port"))
        self.endpoints = ExactPairs(entries["endpoints"], ("dst_mac", "dst_ip", "dst_udp"))
        self.child_ports = ExactPairs(entries["child_ports"], ())  # (session, port of a child switch)
        # drop simulators, direct-indexed by port; NO_ENTRY = no simulated loss on that port
        self.ingress_threshold = np.full(1 << PORT_BITS, NO_ENTRY, dtype=np.int64)
        self.egress_threshold = np.full(1 << PORT_BITS, NO_ENTRY, dtype=np.int64)
        for (port,), (_, p) in entries["ingress_drop_sim"].items():
            self.ingress_threshold[port] = p["threshold"]
        for (port,), (_, p) in entries["egress_drop_sim"].items():
            self.egress_threshold[port] = p["threshold"]
        self.any_ingress_drop = bool((self.ingress_threshold > 0).any())
        self.any_egress_drop = bool((self.egress_threshold > 0).any())
        # multicast groups in CSR form: replicas of group g are rep_*[g_start[g] : g_start[g] + g_len[g]]
        self.g_start = np.zeros(1 << MULTICAST_GROUP_BITS, dtype=np.int64)
        self.g_len = np.zeros(1 << MULTICAST_GROUP_BITS, dtype=np.int64)
        ports, insts = [], []
        for gid in sorted(groups):
            self.g_start[gid] = len(ports)
            self.g_len[gid] = len(groups[gid])
            for port, inst in groups[gid]:
                ports.append(port)
                insts.append(inst)
        self.rep_port = np.array(ports, dtype=np.int64)
        self.rep_instance = np.array(insts, dtype=np.int64)
        # ipv4_lpm: longest prefix first
        self.lpm = []
        by_len: dict[int, list] = {}
        for ((addr, plen),), (act, p) in entries["ipv4_lpm"].items():
            by_len.setdefault(plen, []).append((addr, act, p))
        for plen in sorted(by_len, reverse=True):
            rows = sorted(by_len[plen], key=lambda r: r[0])
            mask = ((1 << plen) - 1) << (32 - plen)
            self.lpm.append((mask, np.array([r[0] for r in rows], dtype=np.int64),
                             np.array([r[1] == "ipv4_forward" for r in rows]),
                             np.array([r[2].get("port", 0) for r in rows], dtype=np.int64),
                             np.array([r[2].get("dst_mac", 0) for r in rows], dtype=np.int64)))
        act, p = defaults.get("ipv4_lpm", ("NoAction", {}))
        self.lpm_default = (act == "ipv4_forward", p.get("port", 0), p.get("dst_mac", 0))
        self._scalar: ScalarTables | None = None

    def scalar(self) -> ScalarTables:
        """The same lookups as Python lists and dicts, for the small-turn path (made once per version)."""
        if self._scalar is None:
            self._scalar = ScalarTables(self)
        return self._scalar

    def session_hit(self, session: np.ndarray) -> np.ndarray:
        s = session.astype(np.int64)
        inside = s < MAX_SESSIONS
        return self.s_valid[np.where(inside, s, 0)] & inside

    def route_ipv4(self, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward?, port, dst_mac) per destination address, longest prefix first."""
        n = len(dst)
        fwd = np.full(n, self.lpm_default[0])
        port = np.full(n, self.lpm_default[1], dtype=np.int64)
        mac = np.full(n, self.lpm_default[2], dtype=np.int64)
        done = np.zeros(n, dtype=bool)
        for mask, addrs, is_fwd, ports, macs in self.lpm:
            q = dst.astype(np.int64) & mask
            i = np.minimum(np.searchsorted(addrs, q), len(addrs) - 1)
            hit = (addrs[i] == q) & ~done
            fwd[hit] = is_fwd[i[hit]]
            port[hit] = ports[i[hit]]
            mac[hit] = macs[i[hit]]
            done |= hit
        return fwd, port, mac


class ScalarTables:
    """`CompiledTables` as Python objects, for turns of a few packets (fast/classify_few.py,
    fast/route_few.py), where a numpy call per lookup costs more than the lookup.

    `sessions[sid]`: the session's `SESSION_PARAMS` as a tuple (valid sessions only; `zeros` is
    the row a miss reads). `workers_keys` / `workers_bit` / `workers_port`: the `workers` table's
    sorted keys and params as lists (`pair_row` finds a key, clamping a miss's row as
    `ExactPairs.find` does). `groups[g]`: (replica ports, replica instances) of multicast group g."""

    def __init__(self, t: CompiledTables):
        params = [t.s[n] for n in SESSION_PARAMS]
        self.sessions = {sid: tuple(int(col[sid]) for col in params) for sid in np.flatnonzero(t.s_valid).tolist()}
        self.zeros = tuple(int(col[0]) for col in params)
        self.workers_keys = t.workers.keys.tolist()
        self.workers_bit = t.workers.params["worker_bit"].tolist()
        self.workers_port = t.workers.params["port"].tolist()
        self.child_keys = frozenset(t.child_ports.keys.tolist())
        self._pairs: dict[int, tuple[bool, int]] = {}  # pair_row's answers so far
        self.decided: dict[tuple, tuple] = {}  # fast/classify_few.py's per-header decisions so far
        self.turns: dict[tuple, tuple] = {}  # fast/classify_few.py's per-turn arrays of turns without contributions
        self.groups: dict[int, tuple[list[int], list[int]]] = {}
        for g in np.flatnonzero(t.g_len).tolist():
            a, n = int(t.g_start[g]), int(t.g_len[g])
            self.groups[g] = (t.rep_port[a:a + n].tolist(), t.rep_instance[a:a + n].tolist())

    def pair_row(self, a: int, b: int) -> tuple[bool, int]:
        """`ExactPairs.find` on `workers` for one key: (hit, row), a miss's row clamped the same way."""
        q = (a << 16) | b
        got = self._pairs.get(q)
        if got is None:
            keys = self.workers_keys
            i = min(bisect_left(keys, q), len(keys) - 1) if keys else 0
            got = (bool(keys) and keys[i] == q, i)
            if len(self._pairs) < PAIR_CACHE:  # (keys a sender chose: bounded)
                self._pairs[q] = got
        return got
