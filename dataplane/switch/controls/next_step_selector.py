"""next_step_selector: what happens to each classified packet after the register controls.

Aggregation (docs/protocol.md 6.3): completion -> emit the result; new contribution -> absorb;
duplicate of a complete phase -> resend the stored result with RETX; duplicate of an
incomplete phase -> drop DUPLICATE. A root emits AGG (GRAD) unicast to the node on up_port or
RESULT (ALLREDUCE) multicast on mcast_grp, and resends an ALLREDUCE result to its sender only;
an UPSTREAM switch sends the same type to its parent on up_port with worker = up_worker. The
emitted header is the triggering packet's with the stored exponent and flags
`(pkt & (SET|MAX)) | stored SATURATED | RETX on resends`.

Heartbeats (6.4), fallback, multicast and pull (6.5) are routed here as well. Header rewrites
go straight into the packet's row.
"""

from __future__ import annotations

import numpy as np

from ...protocol import NODE, DropReason, Event, Flag, MsgType, NextStep
from .classifier import PATH_AGGREGATE, PATH_FALLBACK, PATH_HEARTBEAT, PATH_MULTICAST, PATH_PULL, Classified

ROUTE_NONE = 0
ROUTE_UNICAST = 1  # (port, dst)
ROUTE_MULTICAST = 2  # group
ROUTE_L3 = 3  # (port), frame already rewritten by the forwarder

KEEP_FLAGS = int(Flag.SET | Flag.MAX)
# plain ints: numpy compares an array with an IntEnum member ten times slower than with an int
ROOT, GRAD, AGG, RESULT = int(NextStep.ROOT), int(MsgType.GRAD), int(MsgType.AGG), int(MsgType.RESULT)


class Routes:
    """Per batch packet: route kind, egress port, endpoints dst, multicast group, session."""

    __slots__ = ("dst", "group", "kind", "port", "session")

    def __init__(self, k: int):
        self.kind = np.zeros(k, dtype=np.int64)
        self.port = np.zeros(k, dtype=np.int64)
        self.dst = np.zeros(k, dtype=np.int64)
        self.group = np.zeros(k, dtype=np.int64)
        self.session = np.zeros(k, dtype=np.int64)


class AggregationResult:
    """Register outcome per classified packet (meaningful on the aggregation path)."""

    __slots__ = ("dup", "exponent", "remaining", "saturated")

    def __init__(self, n: int):
        self.dup = np.zeros(n, dtype=bool)
        self.remaining = np.ones(n, dtype=np.uint32)
        self.exponent = np.zeros(n, dtype=np.int8)
        self.saturated = np.zeros(n, dtype=bool)


class HeartbeatResult:
    __slots__ = ("ack", "credit", "full")

    def __init__(self, n: int):
        self.full = np.zeros(n, dtype=bool)
        self.ack = np.zeros(n, dtype=np.uint32)
        self.credit = np.zeros(n, dtype=np.uint32)


def select(b, c: Classified, agg: AggregationResult, hb: HeartbeatResult, routes: Routes) -> tuple[list, list]:
    """Fill `routes` for the classified packets; returns (event codes, drop codes) as lists of
    (code array, packet-index array) for the counters."""
    events: list = []
    drops: list = []
    if len(c.idx) == 0:
        return events, drops
    hdr, hbh = b.hdr, b.hb
    # which paths the batch holds, in one call (a few-packet turn holds one or two of the five)
    paths = np.bincount(c.path, minlength=PATH_PULL + 1).tolist()
    root = c.next_step == ROOT
    up_worker = np.where(root, NODE, c.up_worker)

    def unicast(mask, port, dst):
        ri = c.idx[mask]
        routes.kind[ri] = ROUTE_UNICAST
        routes.port[ri] = port[mask]
        routes.dst[ri] = dst if np.isscalar(dst) else dst[mask]
        routes.session[ri] = c.session[mask]

    def multicast(mask):
        ri = c.idx[mask]
        routes.kind[ri] = ROUTE_MULTICAST
        routes.group[ri] = c.mcast_grp[mask]
        routes.session[ri] = c.session[mask]

    def event(mask, code):
        if mask.any():
            events.append((code, c.idx[mask]))

    # -- aggregation ---------------------------------------------------------------------------
    if paths[PATH_AGGREGATE]:
        a = c.path == PATH_AGGREGATE
        done = agg.remaining == 0
        complete = a & ~agg.dup & done
        resent = a & agg.dup & done
        emit = complete | resent
        event(complete, Event.COMPLETED)
        event(a & ~agg.dup & ~done, Event.ABSORBED)
        event(resent, Event.RESENT)
        event(emit & agg.saturated, Event.SATURATED)
        duplicate = a & agg.dup & ~done
        if duplicate.any():
            drops.append((DropReason.DUPLICATE, c.idx[duplicate]))
        if emit.any():
            grad = c.mtype == GRAD
            to_sender = emit & ~grad & root & resent
            unicast(emit & (grad | ~root) & ~to_sender, c.up_port, NODE)
            unicast(to_sender, c.worker_port, c.worker)
            multicast(emit & ~grad & root & complete)
            ri = c.idx[emit]
            out_type = np.where(root, np.where(grad, AGG, RESULT), c.mtype)
            hdr["ver_type"][ri] = (hdr["ver_type"][ri] & 0xF0) | out_type[emit]
            hdr["worker"][ri] = up_worker[emit]
            hdr["exponent"][ri] = agg.exponent[emit]
            flags = ((c.flags & KEEP_FLAGS) | np.where(agg.saturated, int(Flag.SATURATED), 0)
                     | np.where(resent, int(Flag.RETX), 0))
            hdr["flags"][ri] = flags[emit]
            event(emit & (grad | ~root | to_sender), Event.UNICAST)
            event(emit & ~grad & root & complete, Event.MULTICAST)

    # -- fallback: GRAD toward the node, unaggregated, worker kept so the node can aggregate ---------
    if paths[PATH_FALLBACK]:
        f = c.path == PATH_FALLBACK
        ri = c.idx[f]
        hdr["flags"][ri] = c.flags[f] | int(Flag.FALLBACK)
        unicast(f, c.up_port, NODE)
        event(f, Event.FALLBACK)
        event(f, Event.UNICAST)

    # -- heartbeat rounds ----------------------------------------------------------------------
    if paths[PATH_HEARTBEAT]:
        h = c.path == PATH_HEARTBEAT
        full = h & hb.full
        event(full, Event.HB_ROUND)
        event(h & ~hb.full, Event.HB_ABSORBED)
        if full.any():
            ri = c.idx[full]
            hbh["worker"][ri] = up_worker[full]
            hbh["ack"][ri] = hb.ack[full]
            hbh["credit"][ri] = hb.credit[full]
            unicast(full, c.up_port, NODE)
            event(full, Event.UNICAST)

    # -- multicast and pull --------------------------------------------------------------------
    if paths[PATH_MULTICAST]:
        m = c.path == PATH_MULTICAST
        multicast(m)
        event(m, Event.MULTICAST)
    if paths[PATH_PULL]:
        p = c.path == PATH_PULL
        upstream = p & ~root
        if upstream.any():
            hdr["worker"][c.idx[upstream]] = c.up_worker[upstream]
        unicast(p, c.up_port, NODE)
        event(p, Event.UNICAST)
    return events, drops
