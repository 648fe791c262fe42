"""Conformance vectors of the slot state machine (docs/protocol.md 4, 5, 6.3).

Every branch: first / middle / last contributor, duplicate before completion (DUPLICATE) and
after it (RESENT: GRAD to the node, ALLREDUCE at a root to the sender only, at an UPSTREAM
switch to the parent), the exponent maximum (signed), SATURATED OR, MAX lanes, shadow-set
reuse across phases, an epoch change on reused slots, N = 1, fallback and foreign slots.
Sums are int64 sums wrapped to int32, written here from the inputs.
"""

from __future__ import annotations

import numpy as np
from conformance_frames import lanes_bytes, wrap32
from conformance_topology import CHILD, DATA, LANES, META, NODE_S, ONE, OUTSIDER, REUSE, TOR, WORKERS
from conformance_vectors import Script, Vector, agg, keep_flags, result, to_group, to_host, to_up

from luwu.dataplane.integrity import trailer
from luwu.dataplane.protocol import NODE, DropReason, Dtype, Event, Flag, MsgType

W0, W1, W2, W3 = WORKERS


def values(rank: int, seed: int) -> list[int]:
    """A worker's lanes: random int32 plus edge lanes (overflowing sum, INT32_MIN, small values)."""
    v = np.random.default_rng(1000 * seed + rank).integers(-2**31, 2**31, size=LANES)
    v[0] = 2**31 - 1  # four of these wrap around
    v[1] = -2**31
    v[2] = rank
    v[3] = -(rank + 1) * 1000
    return [int(x) for x in v]


def total(*vals: list[int]) -> list[int]:
    return wrap32(np.sum(np.asarray(vals, dtype=np.int64), axis=0))


def allreduce_complete() -> Vector:
    """First, middle and last contributor of an ALLREDUCE at a root; exponent max over int8."""
    s = Script()
    exps = {W2: -1, W0: 5, W3: -128, W1: 3}
    pk = {h: agg(MsgType.ALLREDUCE, DATA, h, 5, values(h.rank, 1), exponent=e, dtype=Dtype.FIXED32)
          for h, e in exps.items()}
    order = [W2, W0, W3, W1]
    for h in order[:3]:
        s.send(h, pk[h].layer, pk[h].payload, note="absorbed (first, then middle contributors)")
    last = pk[W1]
    out = result(last, mtype=MsgType.RESULT, worker=NODE, exponent=5, flags=keep_flags(last.layer.flags))
    s.send(W1, last.layer, last.payload, to_group(DATA, W1, out, lanes_bytes(total(*(p.values for p in pk.values())))),
           note="last contributor: RESULT multicast with the wrapped sum and exponent 5")
    return Vector("allreduce_complete", "6.3", ("first", "middle", "last", "exponent_max", "allreduce_root",
                                                "wraparound_sum"), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


def allreduce_saturated() -> Vector:
    """SATURATED ORs over contributors (set 1 of the slot); a resend carries it too."""
    s = Script()
    seq = 300  # slot 16 + 44, set 1
    pk = [agg(MsgType.ALLREDUCE, DATA, h, seq, values(h.rank, 2), exponent=-7, dtype=Dtype.FIXED32,
              flags=Flag.SATURATED if h is W1 else 0) for h in WORKERS]
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload)
    flags = int(Flag.SET | Flag.SATURATED)
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=-7, flags=flags)
    payload = lanes_bytes(total(*(p.values for p in pk)))
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, payload), note="result: SET | SATURATED")
    retx = agg(MsgType.ALLREDUCE, DATA, W0, seq, values(0, 2), exponent=-7, dtype=Dtype.FIXED32, flags=Flag.RETX)
    again = result(retx, mtype=MsgType.RESULT, worker=NODE, exponent=-7, flags=flags | Flag.RETX)
    s.send(W0, retx.layer, retx.payload, to_host(W0, W0, again, payload), note="resend to w0: RETX + SATURATED")
    return Vector("allreduce_saturated", "3.2, 6.3", ("saturated_or", "shadow_set_1", "resent_allreduce_root"),
                  s.steps, events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1, Event.RESENT: 1,
                                   Event.UNICAST: 1, Event.SATURATED: 2})


def allreduce_max() -> Vector:
    """MAX: lanes combine with signed 32-bit max; the result keeps MAX."""
    s = Script()
    seq = 77
    pk = [agg(MsgType.ALLREDUCE, DATA, h, seq, values(h.rank, 3), flags=Flag.MAX, dtype=Dtype.ORDERED32)
          for h in WORKERS]
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload)
    expect = [int(x) for x in np.max(np.asarray([p.values for p in pk], dtype=np.int64), axis=0)]
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=int(Flag.MAX))
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, lanes_bytes(expect)))
    return Vector("allreduce_max", "3.2, 6.3", ("max_op",), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


def shadow_sets() -> Vector:
    """Slot 3 of a 16-slot pool through phases seq 3 (set 0), 19 (set 1), 35 (set 0 again).

    Between them, w1 retransmits seq 3 after w0 has moved to seq 19: w1's bit is still in set 0
    (only w0 cleared its own), so the switch resends phase 3's sum to w1. Phase 35 finds set 0
    emptied by the phase-19 packets and overwrites instead of adding.
    """
    s = Script()
    sums = {}
    for phase, seq in enumerate((3, 19)):
        pk = [agg(MsgType.ALLREDUCE, META, h, seq, values(h.rank, 10 + phase), exponent=-phase - 1,
                  dtype=Dtype.FIXED32) for h in WORKERS]
        sums[seq] = lanes_bytes(total(*(p.values for p in pk)))
        if seq == 19:
            s.send(W0, pk[0].layer, pk[0].payload, note="w0 moves on to seq 19 (set 1): first of its phase")
            retx = agg(MsgType.ALLREDUCE, META, W1, 3, values(1, 10), exponent=-1, dtype=Dtype.FIXED32,
                       flags=Flag.RETX)
            again = result(retx, mtype=MsgType.RESULT, worker=NODE, exponent=-1, flags=int(Flag.RETX))
            s.send(W1, retx.layer, retx.payload, to_host(W1, W1, again, sums[3]), note="late RETX of seq 3")
            rest = pk[1:]
        else:
            rest = pk
        for p in rest[:-1]:
            s.send(p.src, p.layer, p.payload)
        last = rest[-1]
        out = result(last, mtype=MsgType.RESULT, worker=NODE, exponent=-phase - 1, flags=keep_flags(last.layer.flags))
        s.send(last.src, last.layer, last.payload, to_group(META, last.src, out, sums[seq]))
    pk = [agg(MsgType.ALLREDUCE, META, h, 35, values(h.rank, 12), exponent=-20, dtype=Dtype.FIXED32)
          for h in WORKERS]
    for p in pk[:-1]:
        s.send(p.src, p.layer, p.payload)
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=-20, flags=0)
    s.send(W3, pk[3].layer, pk[3].payload,
           to_group(META, W3, out, lanes_bytes(total(*(p.values for p in pk)))), note="set 0 reused: no residue")
    return Vector("shadow_sets", "4, 6.3", ("shadow_set_reuse", "shadow_set_1", "resent_allreduce_root"), s.steps,
                  events={Event.ABSORBED: 9, Event.COMPLETED: 3, Event.MULTICAST: 3, Event.RESENT: 1,
                          Event.UNICAST: 1})


def duplicate_before_completion() -> Vector:
    """A copy of a contribution before the phase completes is dropped and not added twice."""
    s = Script()
    pk = [agg(MsgType.ALLREDUCE, DATA, h, 9, values(h.rank, 4)) for h in WORKERS]
    s.send(W0, pk[0].layer, pk[0].payload)
    dup = agg(MsgType.ALLREDUCE, DATA, W0, 9, values(0, 4), flags=Flag.RETX)
    s.send(W0, dup.layer, dup.payload, note="duplicate, phase incomplete: DUPLICATE")
    for p in pk[1:3]:
        s.send(p.src, p.layer, p.payload)
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=0)
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, lanes_bytes(total(*(p.values for p in pk)))))
    return Vector("duplicate_before_completion", "6.3", ("dup_incomplete",), s.steps,
                  drops={DropReason.DUPLICATE: 1},
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


def grad_root() -> Vector:
    """GRAD at a root: AGG unicast to the node; a duplicate after completion resends the AGG."""
    s = Script()
    seq = 130  # slot 402, set 0
    pk = [agg(MsgType.GRAD, NODE_S, h, seq, values(h.rank, 5), exponent=e, dtype=Dtype.FIXED32)
          for h, e in zip(WORKERS, (2, 9, -4, 0))]
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload)
    summed = lanes_bytes(total(*(p.values for p in pk)))
    out = result(pk[3], mtype=MsgType.AGG, worker=NODE, exponent=9, flags=0)
    s.send(W3, pk[3].layer, pk[3].payload, to_up(NODE_S, W3, out, summed), note="AGG to the node")
    retx = agg(MsgType.GRAD, NODE_S, W1, seq, values(1, 5), exponent=9, dtype=Dtype.FIXED32, flags=Flag.RETX)
    again = result(retx, mtype=MsgType.AGG, worker=NODE, exponent=9, flags=int(Flag.RETX))
    s.send(W1, retx.layer, retx.payload, to_up(NODE_S, W1, again, summed), note="stored AGG resent to the node")
    return Vector("grad_root", "6.3", ("grad_root", "resent_grad_root", "last"), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.RESENT: 1, Event.UNICAST: 2})


def upstream_allreduce() -> Vector:
    """At an UPSTREAM switch a completed ALLREDUCE goes to the parent as ALLREDUCE, worker = up_worker."""
    s = Script()
    seq = 10  # slot 602, set 1 (pool of 8)
    pk = [agg(MsgType.ALLREDUCE, TOR, h, seq, values(h.rank, 6), exponent=1 - h.rank, dtype=Dtype.FIXED32)
          for h in (W0, W1)]
    s.send(W0, pk[0].layer, pk[0].payload)
    summed = lanes_bytes(total(pk[0].values, pk[1].values))
    out = result(pk[1], mtype=MsgType.ALLREDUCE, worker=TOR.up_worker, exponent=1, flags=int(Flag.SET))
    s.send(W1, pk[1].layer, pk[1].payload, to_up(TOR, W1, out, summed), note="partial sum to the parent")
    retx = agg(MsgType.ALLREDUCE, TOR, W0, seq, values(0, 6), exponent=1, dtype=Dtype.FIXED32, flags=Flag.RETX)
    again = result(retx, mtype=MsgType.ALLREDUCE, worker=TOR.up_worker, exponent=1, flags=int(Flag.SET | Flag.RETX))
    s.send(W0, retx.layer, retx.payload, to_up(TOR, W0, again, summed), note="resent to the parent, not multicast")
    return Vector("upstream_allreduce", "6.1, 6.3", ("upstream_result", "resent_upstream"), s.steps,
                  events={Event.ABSORBED: 1, Event.COMPLETED: 1, Event.RESENT: 1, Event.UNICAST: 2})


def upstream_grad() -> Vector:
    s = Script()
    pk = [agg(MsgType.GRAD, TOR, h, 3, values(h.rank, 7)) for h in (W1, W0)]
    s.send(W1, pk[0].layer, pk[0].payload)
    out = result(pk[1], mtype=MsgType.GRAD, worker=TOR.up_worker, exponent=0, flags=0)
    s.send(W0, pk[1].layer, pk[1].payload, to_up(TOR, W0, out, lanes_bytes(total(pk[0].values, pk[1].values))))
    return Vector("upstream_grad", "6.1, 6.3", ("upstream_grad",), s.steps,
                  events={Event.ABSORBED: 1, Event.COMPLETED: 1, Event.UNICAST: 1})


def epoch_change() -> Vector:
    """A new session on reused slots (new epoch) starts from empty state: no stale bit, sum,
    exponent or SATURATED of the old session leaks in."""
    s = Script()
    old = agg(MsgType.ALLREDUCE, DATA, W0, 0, values(0, 8), exponent=100, dtype=Dtype.FIXED32, flags=Flag.SATURATED)
    s.send(W0, old.layer, old.payload, note="DATA (epoch 2) leaves w0's bit, sum and exponent in slot 16")
    pk = [agg(MsgType.ALLREDUCE, REUSE, h, 0, values(h.rank, 9), exponent=h.rank, dtype=Dtype.FIXED32)
          for h in (W1, W0, W2, W3)]
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload, note="REUSE (epoch 6): fresh, w0 is not a duplicate")
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=3, flags=0)
    s.send(W3, pk[3].layer, pk[3].payload, to_group(REUSE, W3, out, lanes_bytes(total(*(p.values for p in pk)))))
    return Vector("epoch_change", "6.2, 6.3, 8", ("epoch_change",), s.steps,
                  events={Event.ABSORBED: 4, Event.COMPLETED: 1, Event.MULTICAST: 1})


def single_worker() -> Vector:
    """N = 1: the only contribution completes at once; its duplicate is resent to it."""
    s = Script()
    pk = agg(MsgType.ALLREDUCE, ONE, W0, 1, values(0, 11), exponent=-3, dtype=Dtype.FIXED32)
    out = result(pk, mtype=MsgType.RESULT, worker=NODE, exponent=-3, flags=0)
    s.send(W0, pk.layer, pk.payload, to_group(ONE, W0, out, pk.payload))
    retx = agg(MsgType.ALLREDUCE, ONE, W0, 1, values(0, 11), exponent=-3, dtype=Dtype.FIXED32, flags=Flag.RETX)
    again = result(retx, mtype=MsgType.RESULT, worker=NODE, exponent=-3, flags=int(Flag.RETX))
    s.send(W0, retx.layer, retx.payload, to_host(W0, W0, again, pk.payload))
    return Vector("single_worker", "6.3", ("n1", "resent_allreduce_root"), s.steps,
                  events={Event.COMPLETED: 1, Event.MULTICAST: 1, Event.RESENT: 1, Event.UNICAST: 1})


def fallback() -> Vector:
    """GRAD outside the pool, or with FALLBACK already set, goes to the node unaggregated."""
    s = Script()
    outside = agg(MsgType.GRAD, NODE_S, W2, 1, values(2, 12), slot=5, set_=0, exponent=4, dtype=Dtype.FIXED32)
    fwd = result(outside, mtype=MsgType.GRAD, worker=W2.rank, exponent=4, flags=int(Flag.FALLBACK))
    s.send(W2, outside.layer, outside.payload, to_up(NODE_S, W2, fwd, outside.payload), note="slot 5 not in [272, 528)")
    flagged = agg(MsgType.GRAD, NODE_S, W1, 4, values(1, 12), flags=Flag.FALLBACK)
    fwd2 = result(flagged, mtype=MsgType.GRAD, worker=W1.rank, exponent=0, flags=int(Flag.FALLBACK))
    s.send(W1, flagged.layer, flagged.payload, to_up(NODE_S, W1, fwd2, flagged.payload), note="FALLBACK already set")
    below = agg(MsgType.GRAD, NODE_S, CHILD, 4, values(3, 12), flags=Flag.FALLBACK)
    fwd3 = result(below, mtype=MsgType.GRAD, worker=CHILD.rank, exponent=0, flags=int(Flag.FALLBACK))
    s.send(CHILD, below.layer, below.payload, to_up(NODE_S, CHILD, fwd3, below.payload),
           note="FALLBACK from a rank of a switch below (no workers entry here), on the child's port: passes")
    forged = agg(MsgType.GRAD, NODE_S, OUTSIDER, 5, values(3, 12), flags=Flag.FALLBACK)
    s.send(OUTSIDER, forged.layer, forged.payload,
           note="the same from a port that is no child switch's: SPOOFED (protocol.md 6.8)")
    forged_rank = agg(MsgType.GRAD, NODE_S, W3, 6, values(3, 12), flags=Flag.FALLBACK)
    forged_rank.layer.worker = 12
    s.send(W3, forged_rank.layer, forged_rank.payload,
           note="a worker posing as a rank below another switch: SPOOFED")
    return Vector("fallback", "6.3, 6.8, 7.4", ("fallback_outside", "fallback_flag", "fallback_passes_through",
                                                 "fallback_pass_needs_child_port"), s.steps,
                  events={Event.FALLBACK: 3, Event.UNICAST: 3}, drops={DropReason.SPOOFED: 2})


def foreign_slot() -> Vector:
    s = Script()
    p = agg(MsgType.ALLREDUCE, DATA, W0, 1, values(0, 13), slot=600, set_=0)
    s.send(W0, p.layer, p.payload, note="ALLREDUCE outside its pool: FOREIGN_SLOT")
    return Vector("foreign_slot", "6.3", ("foreign_slot",), s.steps, drops={DropReason.FOREIGN_SLOT: 1})


def spoofed() -> Vector:
    """Source guard (protocol.md 6.7): a rank's id from another rank's port, and the node's id from a
    worker's port, are SPOOFED and change no slot: the real contributions then complete the sum
    as if the forgeries had never been sent."""
    from conformance_frames import luwu_layer
    from conformance_vectors_messages import hb

    from luwu.dataplane.protocol import Dtype as D

    s = Script()
    seq = 7
    pk = {h: agg(MsgType.ALLREDUCE, DATA, h, seq, values(h.rank, 9), dtype=Dtype.FIXED32) for h in WORKERS}
    for victim, liar in ((W1, W0), (W2, W0), (W3, W2)):
        forged = agg(MsgType.ALLREDUCE, DATA, liar, seq, [2**30] * LANES, dtype=Dtype.FIXED32)
        forged.layer.worker = victim.rank
        s.send(liar, forged.layer, forged.payload, note=f"rank {victim.rank}'s id from rank {liar.rank}'s port")
    s.send(W0, luwu_layer(MsgType.PARAM, NODE_S.id, NODE, count=1, dtype=int(D.FP32)), bytes(4) + trailer(bytes(4)),
           note="PARAM claiming the node from a worker's port")
    s.send(W1, hb(NODE_S, W1, 1, 0, 0, worker=NODE), note="HEARTBEAT claiming the node from a worker's port")
    s.send(W2, hb(NODE_S, W2, 1, 0, 0, worker=W3.rank), note="HEARTBEAT with rank 3's id from rank 2's port")
    order = [W0, W1, W2, W3]
    for h in order[:3]:
        s.send(h, pk[h].layer, pk[h].payload, note="a real contribution: absorbed")
    last = pk[W3]
    out = result(last, mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=keep_flags(last.layer.flags))
    s.send(W3, last.layer, last.payload, to_group(DATA, W3, out, lanes_bytes(total(*(p.values for p in pk.values())))),
           note="the last real contribution completes the true sum")
    return Vector("spoofed", "6.7", ("source_guard",), s.steps, drops={DropReason.SPOOFED: 6},
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


VECTORS = [allreduce_complete, allreduce_saturated, allreduce_max, shadow_sets, duplicate_before_completion, grad_root,
           upstream_allreduce, upstream_grad, epoch_change, single_worker, fallback, foreign_slot, spoofed]
