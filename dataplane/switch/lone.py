"""A shared-memory turn of one packet that aggregates nothing and leaves as one copy: a rank's
heartbeat or PULL, straight from its ring header to the up port's ring on Python ints.

Most event-loop turns of a training step carry one packet, most of them a heartbeat or a PULL.
Through `Pipeline.run` and `SoftwareSwitch.emit` such a packet costs some twenty microseconds of
per-turn machinery (a `Batch`, the parser's masks, a `Classified` and its arrays, an `Emission`)
for a few dozen bytes moved. This path reads the header once (`struct`), classifies it with the
small classifier's own decision (`small_classify.decision`), runs the heartbeat table on ints
(`heartbeat_table.apply_ints`), rewrites the header fields in the packet's ring row and publishes
that row on the up port's ring -- with the same counters (rx/tx per port, types, sessions,
events), register updates, header rewrites and ring contents as the general path.

It takes only what it can finish: one packet, not cut, alive, of a known session and worker, on
the heartbeat or pull path, going to a shared-memory port, no loss or impairment simulated, no
UDP port learning its peer. Anything else (drops, multicasts, aggregation, a missing port) says
False before touching any state, and the turn goes the general way.
tests/switch/test_switch_small_turns.py compares it with the general path turn by turn.
"""

from __future__ import annotations

import struct

from .. import trace
from ..protocol import HEADER_LEN, NODE, Event, NextStep, aggregation_packet_len
from .controls import heartbeat_table
from .controls.classifier import PATH_HEARTBEAT, PATH_PULL
from .small_classify import decision
from .small_route import EPOCH, NEXT_STEP, UP_PORT, UP_WORKER, WORKER_MASK

# the data header's fields (protocol._DATA); a heartbeat's ack and credit lie where slot and tensor do
_HEAD = struct.Struct("!BBHHHIIIIbBHI")
_WORKER = struct.Struct("!H")  # at offset 4
_ACK_CREDIT = struct.Struct("!II")  # at offset 12
ROOT = int(NextStep.ROOT)
HB_ROUND, HB_ABSORBED, UNICAST = int(Event.HB_ROUND), int(Event.HB_ABSORBED), int(Event.UNICAST)


def eligible(sw, rx, att) -> bool:
    """Whether a turn of `rx` (one packet from `att`) may take `turn` at all: a shared-memory turn
    whose row is whole, on a switch simulating no link impairment and no UDP peer learning."""
    return (att.kind == "shm" and rx.filled == 1 and not getattr(rx, "cut", True) and getattr(rx, "arena", None)
            is not None and not sw.links_in and not sw.links_out)


def turn(sw, rx, att) -> bool:
    """Handle the one packet of shm turn `rx` (from attachment `att`) when it is a rank's
    heartbeat or PULL bound for a shared-memory port; False (nothing done) otherwise."""
    pipe = sw.pipeline
    t = pipe.tables.compiled()
    if t.any_ingress_drop or t.any_egress_drop:
        return False
    n = int(rx.length[0])
    if n < HEADER_LEN:
        return False
    head = _HEAD.unpack_from(rx.rows, 0)  # (row 0 of the turn's header buffer, which is C-contiguous)
    vt, flags, session, worker, count = head[:5]
    key = (vt, flags, session, worker, count, head[10], att.port, n, pipe.lanes)
    sc = t.scalar()
    drop, counted, _, bit, _, row, path, pooled = decision(sc, key, aggregation_packet_len(pipe.lanes))
    if drop or pooled or path not in (PATH_HEARTBEAT, PATH_PULL):
        return False
    out = sw.ports.get(row[UP_PORT])
    if out is None or out.kind != "shm" or out.peer is None or n > out.row_bytes:
        return False
    with trace.span("pipeline turn", "switch", packets=1):  # (the span the general path's turn has)
        _forward(sw, rx, att, n, head, bit, row, counted, path == PATH_HEARTBEAT, out)
    return True


def _forward(sw, rx, att, n: int, head: tuple, bit: int, row: tuple, counted: bool, heartbeat: bool, out) -> None:
    """`turn`'s packet, which it claimed, through the heartbeat table and out: the counters,
    registers and header rewrites the general path makes."""
    pipe = sw.pipeline
    vt, session = head[0], head[2]
    cnt = pipe.counters
    sw._count_port(att.port, "rx_packets", 1)
    cnt.rx_types[vt & 0xF, 0] += 1
    cnt.rx_types[vt & 0xF, 1] += n
    if counted:
        cnt.session_packets[session, 0] += 1
        cnt.session_packets[session, 1] += n
    r = int(rx.prow[0])
    dst = rx.arena.rows[r]  # the packet's own ring row: it leaves from there (header rewritten in place)
    if heartbeat:
        full, ack, credit = heartbeat_table.apply_ints(pipe.registers, session, row[EPOCH], bit, row[WORKER_MASK],
                                                       head[6], head[7])
        code = HB_ROUND if full else HB_ABSORBED
        cnt.events[code, 0] += 1
        cnt.events[code, 1] += n
        if not full:
            return
        _WORKER.pack_into(dst, 4, NODE if row[NEXT_STEP] == ROOT else row[UP_WORKER])
        _ACK_CREDIT.pack_into(dst, 12, ack, credit)
    elif row[NEXT_STEP] != ROOT:  # a PULL through an UPSTREAM switch speaks as its up_worker
        _WORKER.pack_into(dst, 4, row[UP_WORKER])
    cnt.events[UNICAST, 0] += 1
    cnt.events[UNICAST, 1] += n
    sent = out.send_list(rx.arena.rows, [r], [n])
    sw._count_port(out.port, "tx_ring_full", 1 - sent)
    sw._count_port(out.port, "tx_packets", sent)
    out.notify()
