"""Mirrors: dataplane/switch/pipeline.py `Pipeline.run` after the slot registers:
dataplane/switch/controls/heartbeat_table.py `apply`, dataplane/switch/controls/next_step_selector.py
`select`, dataplane/switch/controls/sender.py `expand` and the drop and event counters, one packet
at a time on Python ints, for turns of up to `pipeline.SMALL_TURN` packets.

Declines: `eligible(paths)` is False for a turn with a packet on the fallback path, and
`Pipeline.run` keeps Ethernet frames and turns with egress loss simulated on the reference stages.

Most shared-memory turns hold one to sixteen packets: heartbeats, PULLs, the node's PARAMs, one
worker's burst of GRADs. The vectorised stages after the classifier (`pipeline.Pipeline.run`:
`Routes`, `select`, `expand`, the drop and event counters) cost some fifty numpy calls for them
whatever their number. This twin takes the turns whose classified packets are all dropped or on
the aggregation, heartbeat, multicast or pull path (not the fallback path, not Ethernet frames,
no egress loss simulated) and gives the same `Emission`, header rewrites, drop reasons, heartbeat
registers and counters as processing the packets one at a time does (which is what the rounds of
the vectorised path equal); the slot registers are the vectorised path's own (`Pipeline._aggregation`:
the fold, then rounds), whose per-packet outcome (`AggregationResult`) it routes as `select` does.
`Pipeline.run` picks it; tests/switch/test_switch_small_turns.py compares a whole switch's outputs,
registers and counters turn by turn with the vectorised path's.
"""

from __future__ import annotations

import numpy as np

from ...protocol import NODE, DropReason, Event, Flag, MsgType, NextStep
from ..batch import Emission
from ..controls import heartbeat_table
from ..controls.classifier import PATH_AGGREGATE, PATH_HEARTBEAT, PATH_MULTICAST, PATH_NONE, PATH_PULL, Classified
from ..controls.next_step_selector import KEEP_FLAGS, AggregationResult
from ..lookup import SESSION_PARAMS, CompiledTables

ROOT = int(NextStep.ROOT)
NO_ROUTE, DUPLICATE = int(DropReason.NO_ROUTE), int(DropReason.DUPLICATE)
HB_ROUND, HB_ABSORBED = int(Event.HB_ROUND), int(Event.HB_ABSORBED)
MULTICAST, UNICAST = int(Event.MULTICAST), int(Event.UNICAST)
COMPLETED, ABSORBED, RESENT, SATURATED = (int(Event.COMPLETED), int(Event.ABSORBED), int(Event.RESENT),
                                          int(Event.SATURATED))
GRAD, AGG, RESULT = int(MsgType.GRAD), int(MsgType.AGG), int(MsgType.RESULT)
F_SATURATED, F_RETX = int(Flag.SATURATED), int(Flag.RETX)
EPOCH, WORKER_MASK, MCAST_GRP, NEXT_STEP, UP_PORT, UP_WORKER = (
    SESSION_PARAMS.index(f) for f in ("epoch", "worker_mask", "mcast_grp", "next_step", "up_port", "up_worker"))
ROUTED = frozenset((PATH_NONE, PATH_AGGREGATE, PATH_HEARTBEAT, PATH_MULTICAST, PATH_PULL))  # the paths this module takes


_NOTHING = Emission.empty()
for _a in (_NOTHING.pkt, _NOTHING.port, _NOTHING.dst, _NOTHING.session, _NOTHING.l3):
    _a.flags.writeable = False


def eligible(paths: list[int]) -> bool:
    """Whether a small turn whose classified packets took `paths` goes through `route`."""
    return ROUTED.issuperset(paths)


def route(b, c: Classified, paths: list[int], srows: list[tuple], t: CompiledTables, registers, counters,
          agg: AggregationResult | None = None) -> Emission:
    """Heartbeat rounds, routes, multicast expansion and counters of a classified small turn
    whose packets are on `ROUTED` paths only (`paths`: c.path as a list; `srows`: each packet's
    session row, classify_few.classify_rows; `agg`: the slot registers' outcome, needed when a
    packet is on the aggregation path); returns the emission `select` + `expand` give, in the
    same order (packet order, then replica order)."""
    pkt: list[int] = []
    port: list[int] = []
    dst: list[int] = []
    sess: list[int] = []
    ev_n = [0] * len(counters.events)  # events counted here, added to the counters once
    ev_b = [0] * len(counters.events)
    length = b.length.tolist()
    if any(paths):  # (PATH_NONE is 0: a dropped packet)
        idx, session, groups = c.idx.tolist(), c.session.tolist(), t.scalar().groups
        if agg is not None:
            dup, remaining, saturated = agg.dup.tolist(), agg.remaining.tolist(), agg.saturated.tolist()
            rewrite: list[tuple[int, int, int]] = []  # (k, new type, new worker) of emitted aggregation packets

        def multicast(i: int, k: int, n: int, row: tuple) -> None:
            """Packet i (the turn's k-th classified) to its session's multicast group (sender.expand)."""
            ev_n[MULTICAST] += 1
            ev_b[MULTICAST] += n
            group = groups.get(row[MCAST_GRP])
            if group is None:  # a multicast with no replicas: the packet itself is dropped
                b.drop[i] = NO_ROUTE
                return
            count = len(group[0])
            pkt.extend([i] * count)
            port.extend(group[0])
            dst.extend(group[1])
            sess.extend([session[k]] * count)

        def up(i: int, k: int, n: int, row: tuple) -> None:
            """Packet i (the turn's k-th classified) unicast toward the node (its session's up port)."""
            pkt.append(i)
            port.append(row[UP_PORT])
            dst.append(NODE)
            sess.append(session[k])
            ev_n[UNICAST] += 1
            ev_b[UNICAST] += n

        for k, path in enumerate(paths):
            if path == PATH_NONE:
                continue
            i = idx[k]
            n = length[i]
            row = srows[k]
            if path == PATH_AGGREGATE:  # (next_step_selector.select's aggregation part, one packet)
                done = remaining[k] == 0
                code = (RESENT if done else DUPLICATE) if dup[k] else (COMPLETED if done else ABSORBED)
                if code == DUPLICATE:  # a duplicate of an incomplete phase
                    b.drop[i] = DUPLICATE
                    continue
                ev_n[code] += 1
                ev_b[code] += n
                if not done:
                    continue
                if saturated[k]:
                    ev_n[SATURATED] += 1
                    ev_b[SATURATED] += n
                mtype = int(c.mtype[k])
                root = row[NEXT_STEP] == ROOT
                grad = mtype == GRAD
                rewrite.append((k, ((AGG if grad else RESULT) if root else mtype), NODE if root else row[UP_WORKER]))
                if grad or not root:  # toward the node, or the parent switch
                    pkt.append(i)
                    port.append(row[UP_PORT])
                    dst.append(NODE)
                    sess.append(session[k])
                elif dup[k]:  # an ALLREDUCE resent at the root: to its sender only
                    pkt.append(i)
                    port.append(int(c.worker_port[k]))
                    dst.append(int(c.worker[k]))
                    sess.append(session[k])
                else:  # an ALLREDUCE completed at the root: to every worker
                    multicast(i, k, n, row)
                    continue
                ev_n[UNICAST] += 1
                ev_b[UNICAST] += n
            elif path == PATH_HEARTBEAT:
                hb = b.hb[i:i + 1]  # a view: header rewrites go into the packet's row
                full, ack, credit = heartbeat_table.apply_ints(registers, session[k], row[EPOCH], int(c.bit[k]),
                                                               row[WORKER_MASK], int(hb["ack"][0]), int(hb["credit"][0]))
                code = HB_ROUND if full else HB_ABSORBED
                ev_n[code] += 1
                ev_b[code] += n
                if not full:
                    continue
                hb["worker"] = NODE if row[NEXT_STEP] == ROOT else row[UP_WORKER]
                hb["ack"] = ack
                hb["credit"] = credit
                up(i, k, n, row)
            elif path == PATH_MULTICAST:
                multicast(i, k, n, row)
            else:  # PATH_PULL: unicast toward the node; an UPSTREAM switch speaks as its up_worker
                if row[NEXT_STEP] != ROOT:
                    b.hdr["worker"][i] = row[UP_WORKER]
                up(i, k, n, row)
        if agg is not None and rewrite:  # the emitted aggregation headers, all at once (select's rewrites)
            ks = np.array([r[0] for r in rewrite], dtype=np.int64)
            ri = c.idx[ks]
            hdr = b.hdr
            hdr["ver_type"][ri] = (hdr["ver_type"][ri] & 0xF0) | np.array([r[1] for r in rewrite], dtype=np.uint8)
            hdr["worker"][ri] = [r[2] for r in rewrite]
            hdr["exponent"][ri] = agg.exponent[ks]
            hdr["flags"][ri] = ((c.flags[ks] & KEEP_FLAGS) | np.where(agg.saturated[ks], F_SATURATED, 0)
                                | np.where(agg.dup[ks], F_RETX, 0))
    events = counters.events
    for code, count in enumerate(ev_n):
        if count:
            events[code, 0] += count
            events[code, 1] += ev_b[code]
    drop = b.drop.tolist()
    if any(drop):
        in_port = b.port.tolist()
        drops = counters.drops
        for i, code in enumerate(drop):
            if code:
                if code < len(drops):  # (Counters._add counts only codes inside the table)
                    drops[code, 0] += 1
                    drops[code, 1] += length[i]
                counters.port(in_port[i], "rx_dropped", 1)
    m = len(pkt)
    if not m:  # (a heartbeat absorbed, a first worker's GRADs: nothing leaves) one shared, read-only
        return _NOTHING
    return Emission(np.array(pkt, dtype=np.int64), np.array(port, dtype=np.int64), np.array(dst, dtype=np.int64),
                    np.array(sess, dtype=np.int64), np.zeros(m, dtype=bool))
