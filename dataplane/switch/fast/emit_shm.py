"""Mirrors: dataplane/switch/switch.py `SoftwareSwitch.emit`, for a shared-memory turn's few copies
(up to SMALL_EMIT) that all go to shared-memory ports without impairments, on Python ints
(`emit_small`), and for a turn's many copies that all go into one multicast pool (`emit_pooled`).

Declines: `emit_small` returns False, having done nothing observable, for a batch that is not a
split shm batch, more than SMALL_EMIT copies, a copy to a port that is not shared memory or has
impairments, or two replicas of a packet on one port; `SoftwareSwitch.emit` then emits the turn.
`emit_pooled` (more than SMALL_EMIT copies) declines the same way, and for copies that do not all
go by reference into one existing multicast pool with room for them (having freed, as the general
path's `_Pool.alloc` would first, the pool rows every reader is done with).

`SoftwareSwitch.emit` handles every kind of port, impairments, routed frames and any number of
copies with whole-array operations (a mask and a selection per port, np.unique, the multicast
pools' grouping), some fifty numpy calls for a turn's one to a dozen copies. Most shm turns emit a
PULL or an AGG to the node, or a PARAM, heartbeat or RESULT to every worker, and nothing else;
this module emits those with the same primitives (`Batch.write_back`, `MulticastPools.fill`,
`ShmAttachment.send_rows` / `send_refs`, the pools' claims) and the same outcome: the same rows
in the same order on every ring, pool rows for the packets that go to two or more ports, the same
counters. One thing it does better: a sum the fold left in its lane register (`Batch.results`)
whose one copy goes to one port (an AGG to the node) is written from the register straight into
the down ring's row (`ShmAttachment.send_results`) instead of into its own row and then copied.
`emit_small` says False for a turn that is not of this kind (the caller emits it).
tests/switch/test_switch_shm_arena.py compares shm turns with datagram batches either way.
"""

from __future__ import annotations

import numpy as np

from ...protocol import HEADER_LEN
from ..attach_shm import MulticastPools, shm_row_bytes
from ..batch import Batch, Emission

SMALL_EMIT = 32  # copies: turns with more take SoftwareSwitch.emit's vectorised path


def emit_small(sw, b: Batch, em: Emission) -> bool:
    """Emit `em` of split batch `b` (shm_arena.py) when every copy goes to a shared-memory port
    without impairments (returns False, having done nothing observable, otherwise)."""
    n = len(em)
    prows, arena, luwu_len, deferred = b.prow, b.arena, b.luwu_len, b.results
    if prows is None or arena is None or luwu_len is None or n > SMALL_EMIT:
        return False
    if n == 1:  # (most turns: a PULL, a heartbeat or an AGG to the node) the general steps, for one copy
        return _emit_one(sw, b, arena, int(em.pkt[0]), int(em.port[0]), int(luwu_len[em.pkt[0]]), int(prows[em.pkt[0]]))
    pk, pt = em.pkt.tolist(), em.port.tolist()
    atts = {}
    for p in sorted(set(pt)):
        att = sw.ports.get(p)
        link = sw.links_out.get(p)
        if att is None or att.kind != "shm" or (link is not None and link.active):
            return False
        atts[p] = att
    # the copies of a packet are adjacent (the sender's order): one run per packet
    runs: list[tuple[int, list[int]]] = []
    for i, p in zip(pk, pt):
        if runs and runs[-1][0] == i:
            runs[-1][1].append(p)
        else:
            runs.append((i, [p]))
    multi: dict[tuple[int, ...], list[int]] = {}  # port set -> its packets (MulticastPools.place's groups)
    for i, ports in runs:
        if len(ports) >= 2:
            key = tuple(sorted(ports))
            if len(set(key)) != len(key):
                return False  # two replicas on one port: place's general grouping decides those
            multi.setdefault(key, []).append(i)
    prow = prows.tolist()
    heads = b.rows
    lengths = luwu_len.tolist()
    direct: set[int] = set()  # packets whose one copy is written from its lane register into the ring
    results = None
    if deferred is not None:  # deferred sums (Batch.results)
        results = deferred.tolist()
        row_bytes = min(att.row_bytes for att in atts.values())
        direct = {i for i, ports in runs if len(ports) == 1 and results[i] >= 0 and lengths[i] <= row_bytes}
    # the rewritten headers into the rows the other packets leave from (Batch.write_back)
    back = [i for i, _ in runs if i not in direct]
    if len(back) > 2:
        b.write_back(np.array(back, dtype=np.int64))
    else:
        for i in back:
            arena[prow[i], :HEADER_LEN] = heads[i, :HEADER_LEN]
    how = dict.fromkeys(back, -1)  # packet -> pool id of its references, -1 inline, -2 direct
    how.update(dict.fromkeys(direct, -2))
    at: dict[int, int] = {}  # packet -> its pool position
    if multi:
        if sw._pools is None:
            sw._pools = MulticastPools(shm_row_bytes(sw.config.lanes))
        for key, pkts in multi.items():
            pool = sw._pools.pool(key)
            if pool is None:
                continue
            pos = MulticastPools.fill_list(pool, pkts, arena, prow, lengths, results, b.result_lanes)
            for i, where in zip(pkts, pos):
                how[i] = pool.id
                at[i] = where
    if deferred is not None:  # deferred sums of copies that leave from their own rows
        inline = [i for i in back if how[i] == -1]
        if inline:
            b.materialize(np.array(inline, dtype=np.int64))
    holders: dict[int, list] = {}
    for p, att in atts.items():
        # this port's copies in emission order, as runs of references to one pool, inline rows or sums
        mine = [i for i, q in zip(pk, pt) if q == p]
        sent = 0
        a = 0
        m = len(mine)
        while a < m:
            kind = how[mine[a]]
            z = a + 1
            while z < m and how[mine[z]] == kind:
                z += 1
            part = mine[a:z]
            lens = [lengths[i] for i in part]
            if kind == -2:  # sums straight from their registers (the packets' own rows hold headers only)
                if deferred is None or b.result_lanes is None:  # (a batch's deferred sums come with their registers)
                    raise RuntimeError("a deferred sum without its lane registers")
                sel = np.array(part, dtype=np.int64)
                sent += att.send_results(heads[sel], b.result_lanes, deferred[sel], np.array(lens, dtype=np.int64))
            elif kind == -1:
                sent += att.send_list(arena, [prow[i] for i in part], lens)
            else:
                sent += att.send_refs(kind, [at[i] for i in part], lens)
                holders.setdefault(kind, []).append((att, att.tx.published()))
            a = z  # a full ring loses the rest of the run (counted per port as ever)
        sw._count_port(p, "tx_ring_full", len(mine) - sent)
        sw._count_port(p, "tx_packets", sent)
    if holders:
        sw._pools.claim(holders)
    for att in atts.values():
        att.notify()
    return True


def emit_pooled(sw, b: Batch, em: Emission) -> bool:
    """Emit `em` of split batch `b` when it is more than SMALL_EMIT copies that all go by
    reference into one existing multicast pool with room for them: every packet to the same 2+
    shared-memory ports without impairments, its copies side by side (a turn's RESULTs to every
    worker: `MulticastPools._uniform`). Returns False, having done nothing observable, otherwise.

    What `SoftwareSwitch.emit` does with such a turn, without its per-port masks and selections:
    the rewritten headers into the packets' rows (`Batch.write_back`), one pool row per packet
    (`MulticastPools.fill`: the header, then the deferred sum from its register), each port's
    references in emission order (`ShmAttachment.send_refs`), the counters, the pool's claim."""
    n = len(em)
    prows, arena, luwu_len = b.prow, b.arena, b.luwu_len
    if prows is None or arena is None or luwu_len is None or n <= SMALL_EMIT or sw._pools is None or em.l3.any():
        return False
    ent = MulticastPools._uniform(em.pkt, em.port, np.ones(n, dtype=bool))  # (every copy eligible: no l3)
    if ent is None:
        return False
    ports = sorted(em.port[ent[0]].tolist())
    atts = []
    for p in ports:
        att = sw.ports.get(p)
        link = sw.links_out.get(p)
        if att is None or att.kind != "shm" or att.peer is None or (link is not None and link.active):
            return False
        atts.append(att)
    pool = sw._pools._pools.get(tuple(ports))  # (made by the general path's first such turn)
    pkts = em.pkt[ent[:, 0]]
    if pool is None:
        return False
    if pool.slots - (pool.head - pool.tail) < len(pkts):
        # short of rows: free those every reader is done with, as `alloc` does first (the same rows
        # whoever does it); still short, the general path goes on (dead readers' rows, or inline)
        pool.reclaim(check_dead=False)
        if pool.slots - (pool.head - pool.tail) < len(pkts):
            return False
    b.write_back(pkts)
    pos = MulticastPools.fill(pool, pkts, arena, b.off, luwu_len, prows, b.results, b.result_lanes)
    if len(pos) != len(pkts):
        raise AssertionError(f"a pool with {len(pkts)} free rows gave {len(pos)}")
    lengths = luwu_len[pkts]
    holders: list = []
    for p, att in zip(ports, atts):
        sent = att.send_refs(pool.id, pos, lengths)
        holders.append((att, att.tx.published()))
        sw._count_port(p, "tx_ring_full", len(pkts) - sent)
        sw._count_port(p, "tx_packets", sent)
    sw._pools.claim({pool.id: holders})
    for att in atts:
        att.notify()
    return True


def _emit_one(sw, b: Batch, arena: np.ndarray, i: int, p: int, n: int, r: int) -> bool:
    """`emit_small` of a turn whose one copy is packet i (`n` bytes, arena row `r`) to port p (the same outcome)."""
    att = sw.ports.get(p)
    link = sw.links_out.get(p)
    if att is None or att.kind != "shm" or (link is not None and link.active):
        return False
    deferred = b.results
    if deferred is not None and deferred[i] >= 0 and n <= att.row_bytes:  # its sum straight from its register
        if b.result_lanes is None:  # (a batch's deferred sums come with their registers)
            raise RuntimeError("a deferred sum without its lane registers")
        sent = att.send_results(b.rows[i:i + 1], b.result_lanes, deferred[i:i + 1], np.array([n], dtype=np.int64))
    else:
        arena[r, :HEADER_LEN] = b.rows[i, :HEADER_LEN]  # the rewritten header into the row it leaves from
        if deferred is not None and deferred[i] >= 0:
            b.materialize(np.array([i], dtype=np.int64))
        sent = att.send_list(arena, [r], [n])
    sw._count_port(p, "tx_ring_full", 1 - sent)
    sw._count_port(p, "tx_packets", sent)
    att.notify()
    return True
