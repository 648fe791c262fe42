"""Mirrors: dataplane/switch/pipeline.py `Pipeline.run` and dataplane/switch/switch.py
`SoftwareSwitch.emit` for a shared-memory turn of one packet that aggregates nothing: a rank's
heartbeat (dataplane/switch/controls/heartbeat_table.py `apply`) or PULL to the up port, or the
node's heartbeat or PARAM to every worker (dataplane/switch/controls/sender.py `expand`), on
Python ints.

Declines: `eligible` is False unless the turn is one whole shm packet on a switch simulating no
link impairment; `turn` returns False, before touching any state, for drops, aggregation packets
(aggregate_one.py's), a missing or non-shm port, a group without replicas or loss simulated
(details below); the turn then takes `Pipeline.run`.

Most event-loop turns of a training step carry one packet, most of them a heartbeat or a PULL.
Through `Pipeline.run` and `SoftwareSwitch.emit` such a packet costs some twenty microseconds of
per-turn machinery (a `Batch`, the parser's masks, a `Classified` and its arrays, an `Emission`)
for a few dozen bytes moved. This path reads the header once (`struct`), classifies it with the
few-packet classifier's own decision (`classify_few.decision`), runs the heartbeat table on ints
(`heartbeat_table.apply_ints`), rewrites the header fields in the packet's ring row and publishes
that row on the up port's ring -- with the same counters (rx/tx per port, types, sessions,
events), register updates, header rewrites and ring contents as the general path. A multicast
(the node's heartbeat or PARAM) leaves unchanged as `emit_shm.emit_small` sends one packet: to a
group of one port, its row onto that ring; to several, one row of their multicast pool
(`MulticastPools.fill_list`) that each ring references (inline copies when the pool is full).

It takes only what it can finish: one packet, not cut, alive, of a known session and worker, on
the heartbeat, pull or multicast path, going to shared-memory ports only (a group's replicas on
distinct ports), no loss or impairment simulated, no UDP port learning its peer. Anything else
(drops, aggregation, a missing port, a group without replicas) says False before touching any
state, and the turn goes the general way.
tests/switch/test_switch_lone_turns.py compares it with the general path turn by turn.
"""

from __future__ import annotations

import struct

import numpy as np

from ...integrity import header_ok, seal_header
from ...observe import trace
from ...protocol import HEADER_LEN, NODE, Event, NextStep, aggregation_packet_len
from ..attach_shm import MulticastPools, shm_row_bytes
from ..batch import write_results
from ..controls import heartbeat_table
from ..controls.classifier import PATH_HEARTBEAT, PATH_MULTICAST, PATH_PULL
from .classify_few import decision
from .emit_shm import SMALL_EMIT
from .route_few import EPOCH, MCAST_GRP, NEXT_STEP, UP_PORT, UP_WORKER, WORKER_MASK

# the data header's fields (protocol._DATA); a heartbeat's ack and credit lie where slot and tensor do
_HEAD = struct.Struct("!BBHHHIIIIbBHI")
_WORKER = struct.Struct("!H")  # at offset 4
_ACK_CREDIT = struct.Struct("!II")  # at offset 12
ROOT = int(NextStep.ROOT)
HB_ROUND, HB_ABSORBED, UNICAST, MULTICAST = (int(Event.HB_ROUND), int(Event.HB_ABSORBED), int(Event.UNICAST),
                                             int(Event.MULTICAST))


def eligible(sw, rx, att) -> bool:
    """Whether a turn of `rx` (one packet from `att`) may take `turn` at all: a shared-memory turn
    whose row is whole, on a switch simulating no link impairment and no UDP peer learning."""
    return (att.kind == "shm" and rx.filled == 1 and not getattr(rx, "cut", True) and getattr(rx, "arena", None)
            is not None and not sw.links_in and not sw.links_out)


def turn(sw, rx, att) -> bool:
    """Handle the one packet of shm turn `rx` (from attachment `att`) when it is a rank's
    heartbeat or PULL bound for a shared-memory port, or a multicast to shared-memory ports;
    False (nothing done) otherwise."""
    pipe = sw.pipeline
    t = pipe.tables.compiled()
    if t.any_ingress_drop or t.any_egress_drop:
        return False
    n = int(rx.length[0])
    if n < HEADER_LEN:
        return False
    if not header_ok(rx.rows[0, :HEADER_LEN].tobytes()):
        return False  # a corrupted header: the general path drops and counts it (BAD_CHECKSUM)
    head = _HEAD.unpack_from(rx.rows, 0)  # (row 0 of the turn's header buffer, which is C-contiguous)
    vt, flags, session, worker, count = head[:5]
    key = (vt, flags, session, worker, count, head[10], att.port, n, pipe.lanes)
    sc = t.scalar()
    drop, counted, _, bit, _, row, path, pooled = decision(sc, key, aggregation_packet_len(pipe.lanes))
    if drop or pooled:
        return False
    if path == PATH_MULTICAST:
        return _multicast(sw, rx, att, n, head, row, counted, sc.groups.get(row[MCAST_GRP]))
    if path not in (PATH_HEARTBEAT, PATH_PULL):
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
    session = head[2]
    cnt = pipe.counters
    count_rx(sw, att, n, head, counted)
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
        seal_header(dst)
    elif row[NEXT_STEP] != ROOT:  # a PULL through an UPSTREAM switch speaks as its up_worker
        _WORKER.pack_into(dst, 4, row[UP_WORKER])
        seal_header(dst)
    cnt.events[UNICAST, 0] += 1
    cnt.events[UNICAST, 1] += n
    sent = out.send_list(rx.arena.rows, [r], [n])
    sw._count_port(out.port, "tx_ring_full", 1 - sent)
    sw._count_port(out.port, "tx_packets", sent)
    out.notify()


def count_rx(sw, att, n: int, head: tuple, counted: bool) -> None:
    """The receive counters of the turn's packet (port, type, and its session once it passed that check)."""
    cnt = sw.pipeline.counters
    vt, session = head[0], head[2]
    sw._count_port(att.port, "rx_packets", 1)
    cnt.rx_types[vt & 0xF, 0] += 1
    cnt.rx_types[vt & 0xF, 1] += n
    if counted:
        cnt.session_packets[session, 0] += 1
        cnt.session_packets[session, 1] += n


def _multicast(sw, rx, att, n: int, head: tuple, row: tuple, counted: bool, group) -> bool:
    """The turn's packet, on the multicast path, to its group's ports unchanged: False (nothing
    done) unless every replica goes to its own shared-memory port (emit_small's one-run case)."""
    if group is None or not group[0]:
        return False  # no replicas: the general path drops it (NO_ROUTE)
    ports = sorted(group[0])
    outs = [sw.ports.get(p) for p in ports]
    if len(ports) > SMALL_EMIT or len(set(ports)) != len(ports) or any(o is None or o.kind != "shm" or n > o.row_bytes for o in outs):
        return False
    with trace.span("pipeline turn", "switch", packets=1):
        count_rx(sw, att, n, head, counted)
        cnt = sw.pipeline.counters
        cnt.events[MULTICAST, 0] += 1
        cnt.events[MULTICAST, 1] += n
        to_ports(sw, rx.arena.rows, int(rx.prow[0]), n, outs)
    return True


def to_ports(sw, arena: np.ndarray, r: int, n: int, outs: list, reg: int = -1, head: np.ndarray | None = None) -> None:
    """The packet in `arena` row r (n bytes; `reg` >= 0: its lanes are the sum in that lane register)
    to shared-memory ports `outs` as emit_shm.emit_small sends a packet's copies: to one port, its
    row (a sum straight from its register, under `head` when given); to several, one row of their
    multicast pool that each ring references, or, when the pool has no free row, the row itself
    (the sum written into it first: Batch.materialize). Counted per port; the rings are rung."""
    lanes = sw.pipeline.registers.lanes
    pos: list[int] = []
    pid = -1
    if len(outs) > 1:
        pools = sw._pools
        if pools is None:
            pools = sw._pools = MulticastPools(shm_row_bytes(sw.config.lanes))
        pool = pools.pool(tuple(o.port for o in outs))
        if pool is not None:
            pid = pool.id
            pos = MulticastPools.fill_list(pool, [0], arena, [r], [n], None if reg < 0 else [reg], lanes)
        if not pos and reg >= 0:
            payload, flat = sw.pipeline.arena_lanes(arena)
            write_results(lanes, np.array([reg], dtype=np.int64), payload, np.array([r], dtype=np.int64), flat)
    holders = []
    for out in outs:
        if pos:
            sent = out.send_refs(pid, pos, [n])
            holders.append((out, out.tx.published()))
        elif reg >= 0 and len(outs) == 1:
            sent = out.send_results(arena[r:r + 1] if head is None else head, lanes, np.array([reg], dtype=np.int64),
                                    np.array([n], dtype=np.int64))
        else:
            sent = out.send_list(arena, [r], [n])
        sw._count_port(out.port, "tx_ring_full", 1 - sent)
        sw._count_port(out.port, "tx_packets", sent)
    if holders:
        sw._pools.claim({pid: holders})
    for out in outs:
        out.notify()
