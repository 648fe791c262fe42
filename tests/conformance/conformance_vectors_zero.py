"""Conformance vectors of header-only ZERO contributions (docs/protocol.md 3.2, 6.3).

A GRAD or ALLREDUCE with the ZERO flag and an INT32 dtype is the 32-byte header alone and
stands for `lanes` zero lanes: the switch aggregates it as zeros, and whatever it triggers (a
completion, a resend, a fallback toward the node) leaves full-sized with the stored lanes. ZERO
first, in the middle and last; its retransmission after completion (RESENT, full lanes) and its
duplicate before it (DUPLICATE); a fallback GRAD; and the ZERO packets a switch refuses
(MALFORMED): a float or fixed-point dtype, lanes attached, a type other than GRAD/ALLREDUCE.
"""

from __future__ import annotations

from conformance_frames import lanes_bytes
from conformance_topology import DATA, LANES, NODE_S, WORKERS
from conformance_vectors import Script, Vector, agg, keep_flags, result, to_group, to_host, to_up
from conformance_vectors_slots import total, values

from luwu.dataplane.protocol import NODE, DropReason, Dtype, Event, Flag, MsgType

W0, W1, W2, W3 = WORKERS
ZEROS = [0] * LANES


def zero(mtype: MsgType, s, h, seq: int, *, flags: int = 0, dtype: Dtype = Dtype.INT32, **kw):
    """A worker's header-only ZERO packet (its Agg's values: the zeros it stands for)."""
    return agg(mtype, s, h, seq, ZEROS, flags=int(flags) | int(Flag.ZERO), dtype=dtype, **kw)


def zero_allreduce() -> Vector:
    """ZERO first, in the middle and last of an ALLREDUCE: the RESULT carries the full sum of
    the one real contribution, with full lanes; a ZERO retransmission after completion gets
    the stored result back, full-sized, to its sender only."""
    s = Script()
    seq = 21
    first, middle = zero(MsgType.ALLREDUCE, DATA, W0, seq), zero(MsgType.ALLREDUCE, DATA, W2, seq)
    real = agg(MsgType.ALLREDUCE, DATA, W1, seq, values(1, 21))
    last = zero(MsgType.ALLREDUCE, DATA, W3, seq)
    s.send(W0, first.layer, note="ZERO first: absorbed as zeros")
    s.send(W1, real.layer, real.payload, note="a real contribution: absorbed")
    s.send(W2, middle.layer, note="ZERO in the middle: absorbed")
    summed = lanes_bytes(total(real.values, ZEROS))
    out = result(last, mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=keep_flags(last.layer.flags))
    s.send(W3, last.layer, b"", to_group(DATA, W3, out, summed),
           note="ZERO last: RESULT multicast with every lane, lengths and checksum of a full packet")
    retx = zero(MsgType.ALLREDUCE, DATA, W2, seq, flags=Flag.RETX)
    again = result(retx, mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=keep_flags(retx.layer.flags) | Flag.RETX)
    s.send(W2, retx.layer, b"", to_host(W2, W2, again, summed), note="ZERO retransmission: stored RESULT resent")
    return Vector("zero_allreduce", "3.2, 6.3", ("zero_first", "zero_middle", "zero_last", "zero_resent"), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1, Event.RESENT: 1,
                          Event.UNICAST: 1})


def zero_grad() -> Vector:
    """GRAD at a root: a ZERO duplicate before completion is dropped (not counted twice), ZERO
    completes the phase (AGG to the node with full lanes), and a ZERO GRAD outside the pool goes
    to the node full-sized with FALLBACK (ZERO cleared: the node never sees a header-only GRAD)."""
    s = Script()
    seq = 131  # slot 403, set 0
    pk = {h: agg(MsgType.GRAD, NODE_S, h, seq, values(h.rank, 22)) for h in (W0, W1)}
    z2, z3 = zero(MsgType.GRAD, NODE_S, W2, seq), zero(MsgType.GRAD, NODE_S, W3, seq)
    s.send(W2, z2.layer, note="ZERO first: absorbed")
    dup = zero(MsgType.GRAD, NODE_S, W2, seq, flags=Flag.RETX)
    s.send(W2, dup.layer, note="ZERO duplicate, phase incomplete: DUPLICATE")
    for h in (W0, W1):
        s.send(h, pk[h].layer, pk[h].payload)
    out = result(z3, mtype=MsgType.AGG, worker=NODE, exponent=0, flags=keep_flags(z3.layer.flags))
    s.send(W3, z3.layer, b"", to_up(NODE_S, W3, out, lanes_bytes(total(pk[W0].values, pk[W1].values))),
           note="ZERO last: AGG to the node with the full sum")
    outside = zero(MsgType.GRAD, NODE_S, W1, 1, slot=5, set_=0)
    fwd = result(outside, mtype=MsgType.GRAD, worker=W1.rank, exponent=0, flags=int(Flag.FALLBACK))
    s.send(W1, outside.layer, b"", to_up(NODE_S, W1, fwd, lanes_bytes(ZEROS)),
           note="ZERO GRAD outside the pool: FALLBACK to the node with its zero lanes")
    return Vector("zero_grad", "3.2, 6.3", ("zero_duplicate", "zero_grad_root", "zero_fallback"), s.steps,
                  drops={DropReason.DUPLICATE: 1},
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.UNICAST: 2, Event.FALLBACK: 1})


def zero_refused() -> Vector:
    """ZERO only with INT32 sums on GRAD/ALLREDUCE, header only: a fixed-point or float dtype
    (its exponent and the hosts' rescaling are not defined for a packet without lanes), lanes
    attached, or a RESULT with ZERO are MALFORMED and change no slot (the phase then completes
    with its real contributions)."""
    s = Script()
    seq = 23
    for dtype in (Dtype.FIXED32, Dtype.FP32, Dtype.ORDERED32):
        bad = zero(MsgType.ALLREDUCE, DATA, W0, seq, dtype=dtype)
        s.send(W0, bad.layer, note=f"ZERO with dtype {dtype.name}: MALFORMED")
    padded = zero(MsgType.ALLREDUCE, DATA, W1, seq)
    s.send(W1, padded.layer, lanes_bytes(ZEROS), note="ZERO with lanes attached: MALFORMED")
    res = zero(MsgType.RESULT, DATA, W2, seq)
    s.send(W2, res.layer, note="ZERO on a RESULT: MALFORMED")
    pk = [agg(MsgType.ALLREDUCE, DATA, h, seq, values(h.rank, 23)) for h in WORKERS]
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload, note="real contributions: absorbed")
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=keep_flags(pk[3].layer.flags))
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, lanes_bytes(total(*(p.values for p in pk)))),
           note="the refused ZERO packets changed nothing")
    return Vector("zero_refused", "3.2, 6.7", ("zero_float_dropped", "zero_with_lanes_dropped"), s.steps,
                  drops={DropReason.MALFORMED: 5}, session_packets={DATA.id: 4},
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


VECTORS = [zero_allreduce, zero_grad, zero_refused]
