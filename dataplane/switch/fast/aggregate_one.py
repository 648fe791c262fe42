"""Mirrors: dataplane/switch/pipeline.py `Pipeline.run` and dataplane/switch/switch.py
`SoftwareSwitch.emit` for a shared-memory turn of one aggregation packet (a rank's ALLREDUCE or
GRAD): the slot state machine of dataplane/switch/pipeline.py `Pipeline._aggregate` through the
compiled kernel `aggregate_groups.py` runs, on Python ints and one call of that kernel.

Declines: `turn` returns False with no state changed, and the turn takes `Pipeline.run`, for
kernels off, loss simulated, a drop, a packet off the aggregation path,
a completion that would leave for a port that is not shared memory, a duplicate or a countdown
past zero (details below).

The workers' exponent-agreement rows and many gradient packets arrive one to a turn. Through
`Pipeline.run` and `SoftwareSwitch.emit` such a packet costs some hundred microseconds of per-turn
machinery (a `Batch`, the classifier's arrays, `_AggInputs`, `AggregationResult`, the route's
lists, an `Emission`, the emission's grouping) around the work itself: the slot registers and one
pass over the lanes. This path reads the header once (`struct`), classifies it with the small
classifier's own decision (`classify_few.decision`, `contribution_path`), runs the slot state
machine and the lane fold through the very kernel the general path runs for a one-packet group
(`kernels.switch_lanes.phase_groups`, on one-element arrays), and, when the packet completes its
phase, rewrites its header as `route_few.route` does and sends the sum from its lane register
as `emit_shm.emit_small` does (one copy up: straight into the ring's row; several: one pool row
the rings reference, or inline copies when the pool is full) -- with the same counters, registers,
straggler records, ring entries and pool rows as the general path.

It takes only what it can finish: kernels on, a packet on the aggregation path (any dtype:
FIXED16's lanes are int32 lanes too, docs/protocol.md 5.2; a short packet, 3.3, as the workers'
exponent-agreement rows are: the lanes past its end zeroed in its ring row first, as
zero_lanes._pad_short does; a ZERO one: its row's lanes zeroed, and what leaves is the INT32
packet of zeros it stands for, as zero_lanes.apply makes it), whose completion would
leave for shared-memory ports only (checked before anything is touched),
and that the kernel takes (not a duplicate, the countdown not passing zero: the kernel changes
nothing otherwise). Anything else says False with no state changed, and the turn goes the general way.
tests/switch/test_switch_lone_turns.py runs it side by side with the general path.
"""

from __future__ import annotations

import struct

import numpy as np

from ...integrity import header_ok, seal_header, wire_len
from ...kernels import use_numba
from ...observe import trace
from ...protocol import HEADER_LEN, NODE, Dtype, Event, Flag, MsgType, NextStep, aggregation_packet_len
from ..controls.classifier import PATH_AGGREGATE
from ..controls.next_step_selector import KEEP_FLAGS
from ..lookup import SESSION_PARAMS
from .classify_few import contribution_path, decision
from .emit_shm import SMALL_EMIT
from .forward_one import count_rx, to_ports
from .route_few import EPOCH, MCAST_GRP, NEXT_STEP, UP_PORT, UP_WORKER

_HEAD = struct.Struct("!BBHHHIIIIbBHI")  # the data header (protocol._DATA)
_REWRITE = struct.Struct("!BB")  # ver_type, flags at offset 0
_WORKER = struct.Struct("!H")  # at offset 4
_EXPONENT = struct.Struct("!b")  # at offset 24
ROOT, GRAD, AGG, RESULT = int(NextStep.ROOT), int(MsgType.GRAD), int(MsgType.AGG), int(MsgType.RESULT)
SET, SATURATED, MAX, ZERO = int(Flag.SET), int(Flag.SATURATED), int(Flag.MAX), int(Flag.ZERO)
INT32 = int(Dtype.INT32)
COMPLETED, ABSORBED, SATURATED_EV = int(Event.COMPLETED), int(Event.ABSORBED), int(Event.SATURATED)
UNICAST, MULTICAST = int(Event.UNICAST), int(Event.MULTICAST)
NUM_WORKERS = SESSION_PARAMS.index("num_workers")
_KERNELS: list = []  # kernels.switch_lanes once imported (it imports numba: only when kernels are on)


class Scratch:
    """The kernel's one-packet arguments, made once per switch (the dtypes the general path passes:
    one compiled specialisation) and rewritten in place each turn."""

    def __init__(self):
        i64, u32 = np.int64, np.uint32
        self.order = np.zeros(1, dtype=i64)
        self.slot, self.s, self.other, self.rows = (np.zeros(1, dtype=i64) for _ in range(4))
        self.epoch, self.bit, self.nw = (np.zeros(1, dtype=u32) for _ in range(3))
        self.is_max, self.saturated = np.zeros(1, dtype=bool), np.zeros(1, dtype=bool)
        self.exponent = np.zeros(1, dtype=np.int8)
        self.fast, self.last, self.out_saturated = (np.zeros(1, dtype=bool) for _ in range(3))
        self.remaining = np.zeros(1, dtype=u32)
        self.out_exponent = np.zeros(1, dtype=np.int8)
        self.head = np.zeros((1, HEADER_LEN), dtype=np.uint8)  # a unicast sum's rewritten header


def turn(sw, rx, att) -> bool:
    """Handle the one packet of shm turn `rx` (from attachment `att`, forward_one.eligible) when it is an
    aggregation packet this path takes; False (nothing done) otherwise."""
    pipe = sw.pipeline
    t = pipe.tables.compiled()
    if t.any_ingress_drop or t.any_egress_drop or not use_numba():
        return False
    n = int(rx.length[0])
    full = aggregation_packet_len(pipe.lanes)
    if n > full or n < HEADER_LEN:  # (too long or too short: not a contribution this path takes)
        return False
    if not header_ok(rx.rows[0, :HEADER_LEN].tobytes()):
        return False  # a corrupted header: the general path drops and counts it (BAD_CHECKSUM)
    head = _HEAD.unpack_from(rx.rows, 0)
    vt, flags, session, worker, count = head[:5]
    zero = flags & ZERO
    if zero and rx.arena.rows.shape[1] < full:  # (a row too narrow to widen it into: the general path drops it)
        return False
    sc = t.scalar()
    drop, counted, _, bit, _, row, _, pooled = decision(sc, (vt, flags, session, worker, count, head[10], att.port, n,
                                                             pipe.lanes), full)
    if drop or not pooled or contribution_path(vt, flags, head[6], row) != (PATH_AGGREGATE, 0):
        return False
    root = row[NEXT_STEP] == ROOT
    grad = vt & 0xF == GRAD
    if grad or not root:
        outs = [sw.ports.get(row[UP_PORT])]
    else:  # an ALLREDUCE completed at the root goes to every worker
        group = sc.groups.get(row[MCAST_GRP])
        if group is None or not group[0] or len(group[0]) > SMALL_EMIT or len(set(group[0])) != len(group[0]):
            return False
        outs = [sw.ports.get(p) for p in sorted(group[0])]
    # what leaves: a ZERO contribution as the packet of zero lanes it stands for (zero_lanes.py)
    out_len = wire_len(count, INT32, 0, pipe.lanes) if zero else n
    if any(o is None or o.kind != "shm" or out_len > o.row_bytes for o in outs):
        return False
    flat = pipe.arena_lanes(rx.arena.rows)[1]
    if flat is None:
        return False
    r = int(rx.prow[0])
    if zero:  # its lanes all zero (zero_lanes.apply)
        rx.arena.rows[r, HEADER_LEN:full] = 0
    elif n < full:  # a short packet (3.3): the lanes it does not carry sum as zeros (zero_lanes._pad_short)
        rx.arena.rows[r, n:full] = 0
    regs = pipe.registers
    k = sw.aggregate_one_scratch
    if k is None:
        k = sw.aggregate_one_scratch = Scratch()
    base = regs.slots if flags & SET else 0  # the slot's register index: set * slots + slot
    index = base + head[6]
    k.slot[0], k.s[0], k.other[0], k.rows[0] = head[6], index, regs.slots - base + head[6], r
    k.epoch[0], k.bit[0], k.nw[0] = row[EPOCH], bit, row[NUM_WORKERS]
    k.is_max[0], k.saturated[0], k.exponent[0] = flags & MAX, flags & SATURATED, head[9]
    k.fast[0] = k.last[0] = False
    if not _KERNELS:  # (an import statement per turn costs the import machinery's lookups)
        from ...kernels import switch_lanes

        _KERNELS.append(switch_lanes)
    if not _KERNELS[0].phase_groups(k.order, k.slot, k.s, k.other, k.epoch, k.is_max, k.bit, k.nw, k.exponent, k.saturated,
                        k.rows, regs.slot_owner, regs.bitmap, regs.contributors, regs.exponents, regs.slot_flags,
                        regs.lanes.view(np.uint32), flat[0], flat[1], k.fast, k.remaining, k.out_exponent,
                        k.out_saturated, k.last, False):
        return False  # (a duplicate, or a countdown past zero: the rounds' cases; nothing changed)
    with trace.span("pipeline turn", "switch", packets=1):  # (the span the general path's turn has)
        _count(sw, att, n, head, counted, row, bit, index, int(k.remaining[0]))
        if k.remaining[0] == 0:
            sat = bool(k.out_saturated[0])
            multicast = root and not grad
            arena = rx.arena.rows
            if multicast:  # rewritten in its ring row, which the pool row (or inline copies) copy
                dst = arena[r]
            else:  # sent straight from the register under a rewritten copy of its header (as _emit_one)
                k.head[0] = arena[r, :HEADER_LEN]
                dst = k.head[0]
            _rewrite(dst, vt, flags, root, grad, row, int(k.out_exponent[0]), sat)
            _emit(sw, arena, r, n, index, outs, sat, multicast, k.head, out_len)
    return True


def _count(sw, att, n: int, head: tuple, counted: bool, row: tuple, bit: int, index: int, remaining: int) -> None:
    """The counters and straggler records of the packet the kernel took (before what it emits)."""
    pipe = sw.pipeline
    cnt = pipe.counters
    count_rx(sw, att, n, head, counted)
    code = COMPLETED if remaining == 0 else ABSORBED
    cnt.events[code, 0] += 1
    cnt.events[code, 1] += n
    if pipe.stragglers is not None:  # (Pipeline._observe_small for one packet)
        pipe.stragglers.record_lists([head[2]], [head[3]], [bit], [index], [row[NUM_WORKERS]], [False], [remaining])


def _rewrite(dst: np.ndarray, vt: int, flags: int, root: bool, grad: bool, row: tuple, exponent: int,
             sat: bool) -> None:
    """The emitted header (route_few.route's rewrite of a completed, not duplicate, packet) into `dst`."""
    mtype = (AGG if grad else RESULT) if root else vt & 0xF
    buf = dst.data  # (a C-contiguous row: its memoryview)
    _REWRITE.pack_into(buf, 0, (vt & 0xF0) | mtype, (flags & KEEP_FLAGS) | (SATURATED if sat else 0))
    _WORKER.pack_into(buf, 4, NODE if root else row[UP_WORKER])
    _EXPONENT.pack_into(buf, 24, exponent)
    seal_header(dst)


def _emit(sw, arena: np.ndarray, r: int, n: int, reg: int, outs: list, sat: bool, multicast: bool,
          head: np.ndarray, out_len: int) -> None:
    """The completed sum (lane register `reg`) to ports `outs` (forward_one.to_ports) with its events: a
    multicast under the header in arena row `r`, a unicast under `head`."""
    cnt = sw.pipeline.counters
    if sat:
        cnt.events[SATURATED_EV, 0] += 1
        cnt.events[SATURATED_EV, 1] += n
    code = MULTICAST if multicast else UNICAST
    cnt.events[code, 0] += 1
    cnt.events[code, 1] += n
    to_ports(sw, arena, r, out_len, outs, reg, None if multicast else head)
