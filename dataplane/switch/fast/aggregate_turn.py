"""Mirrors: dataplane/switch/pipeline.py `Pipeline.run` for a shared-memory turn of two or more
packets (`pipeline.AGGREGATE_TURN`), every one a contribution that aggregates: the parser
(dataplane/switch/controls/parser.py `parse`), dataplane/switch/controls/classifier.py `classify`,
dataplane/switch/controls/zero_lanes.py `apply` (short packets padded, ZERO ones expanded),
dataplane/switch/pipeline.py
`Pipeline._aggregation` (every slot's group folded in one pass by the kernel of fast/aggregate_groups.py
`fold`), dataplane/switch/controls/next_step_selector.py `select`,
dataplane/switch/controls/sender.py `expand` (called as it is; completions all to one multicast
group get its copies built directly) and dataplane/switch/pipeline.py `reseal`.

Declines: `run` returns None with nothing changed, and the turn takes `Pipeline.run`, for kernels
off, loss simulated, straggler records kept, an Ethernet or whole (not split) batch, a packet
dropped before the pipeline, a runt, a ZERO contribution whose row cannot hold its lanes, a
header check that fails, a packet the classifier drops or does not send down the aggregation path
(heartbeats, PULLs, PARAMs, FALLBACK GRADs, foreign slots...), a completion for a multicast group
without replicas, or a slot whose contributions the one-pass fold does not take (a duplicate, a
countdown past zero, mixed epochs or operations: the rounds' cases; kernels.switch_lanes
`groups_qualify` asks the fold's own test before anything is written).

On shared-memory ports a 4-worker 16 MiB allreduce is some sixteen turns of 64 to 192
contributions per call, and a few of 2-16 (the meta session's rows). Through `Pipeline.run` each such turn pays some 0.6 ms of numpy calls
(the classifier's sixty-odd arrays, `_AggInputs`, the selector's masks, the counters' bincounts)
around 0.3 ms of lane arithmetic. The packets of such a turn share a handful of header keys (one
endpoint sends one session's packets, differing only in slot, SET and exponent): this path
checks the headers and finds their keys in one kernel (kernels.switch_lanes `scan_turn`),
classifies each distinct key once (fast/classify_few.py `decision`, the small classifier's own),
gathers the slot state machine's inputs and checks every slot against its pool in another
(`turn_inputs`), asks the fold's test (`groups_qualify`), then runs the very kernel the general path
runs, counts on Python ints per key, and routes the completions through the reference `expand` (all to
one multicast group, the most common turn: the same copies built in five calls).
tests/switch/test_switch_aggregate_turns.py runs it side by side with the general path.
"""

from __future__ import annotations

import numpy as np

from ...integrity import seal_rows, wire_len
from ...kernels import use_numba
from ...protocol import (
    DATA_HEADER,
    HCHECK_OFFSET,
    HCHECK_TABLES,
    HEADER_LEN,
    NODE,
    Dtype,
    Event,
    Flag,
    MsgType,
    NextStep,
    aggregation_packet_len,
)
from ..batch import Batch, Emission
from ..controls.next_step_selector import KEEP_FLAGS, ROUTE_MULTICAST, ROUTE_UNICAST, Routes
from ..controls.sender import expand
from ..lookup import SESSION_PARAMS, CompiledTables
from .classify_few import decision

SET, SATURATED, MAX, ZERO, FALLBACK = (int(f) for f in (Flag.SET, Flag.SATURATED, Flag.MAX, Flag.ZERO, Flag.FALLBACK))
GRAD, ALLREDUCE, AGG, RESULT = (int(m) for m in (MsgType.GRAD, MsgType.ALLREDUCE, MsgType.AGG, MsgType.RESULT))
ROOT = int(NextStep.ROOT)
INT32 = int(Dtype.INT32)
KEEP_UNZERO = 0xFF ^ ZERO  # a ZERO contribution's flags once it stands as its zero lanes
COMPLETED, ABSORBED, SATURATED_EV = int(Event.COMPLETED), int(Event.ABSORBED), int(Event.SATURATED)
UNICAST, MULTICAST = int(Event.UNICAST), int(Event.MULTICAST)
POOL_BASE, POOL_SIZE, NUM_WORKERS, EPOCH, MCAST_GRP, NEXT_STEP, UP_PORT, UP_WORKER = (
    SESSION_PARAMS.index(f) for f in ("pool_base", "pool_size", "num_workers", "epoch", "mcast_grp", "next_step",
                                      "up_port", "up_worker"))

_HCHECK = np.array(HCHECK_TABLES, dtype=np.uint16)  # kernels.switch_lanes.headers_all_ok's tables
_AT = {name: int(field[1]) for name, field in (DATA_HEADER.fields or {}).items()}  # header byte offsets
_DTYPE_AT, _SLOT_AT, _EXPONENT_AT = _AT["dtype"], _AT["slot"], _AT["exponent"]
MAX_KEYS = 64  # distinct header keys a turn may have (ports x sets x sessions x lengths; more: the general path)
# the key's first int is header bytes 0-7 read big-endian: ver_type, flags, session, worker, count
if [_AT[f] for f in ("ver_type", "flags", "session", "worker", "count", "seq")] != [0, 1, 2, 4, 6, 8]:
    raise AssertionError("aggregate_turn reads header bytes 0-7 as ver_type, flags, session, worker, count")
_KERNELS: list = []  # kernels.switch_lanes, once imported (it imports numba: only when kernels are on)


def _kernels():
    if not _KERNELS:
        from ...kernels import switch_lanes

        _KERNELS.append(switch_lanes)
    return _KERNELS[0]


def run(pipe, b: Batch, t: CompiledTables) -> Emission | None:
    """`pipe.run(b)` (pipeline.Pipeline) for a split turn of contributions that all fold in one
    pass, with `t` its compiled tables; None (nothing done) for any other turn."""
    h = b.hdr  # (a split turn's header views come with it: ShmTurn.headers)
    if (h is None or b.framed or b.prow is None or b.arena is None or pipe.stragglers is not None or t.any_ingress_drop
            or t.any_egress_drop or not use_numba() or b.drop.any()):
        return None
    n = len(b)
    lanes = pipe.lanes
    full = aggregation_packet_len(lanes)
    lens = b.length.tolist()
    if min(lens) < HEADER_LEN:  # (a runt: MALFORMED, the general path)
        return None
    k = _kernels()
    # every header's check, then what the classifier reads of it: bytes 0-7 (ver_type, flags,
    # session, worker, count) as one word and the dtype byte; with the port and the length a
    # packet's key (classify_few.decision), of which a turn has a few (one endpoint, one session)
    kid, found, per_turn = np.empty(n, dtype=np.int64), np.empty((MAX_KEYS, 4), dtype=np.uint64), np.empty(MAX_KEYS, np.int64)
    m = k.scan_turn(b.rows, _HCHECK, HCHECK_OFFSET, _DTYPE_AT, b.port, b.length, kid, found, per_turn)
    if m < 0:  # (a header check that fails: BAD_CHECKSUM drops, the general path; or many keys)
        return None
    sc = t.scalar()
    keys = []  # the distinct keys' decision keys, in arrival order
    rows = []  # per key: bit, epoch, workers, pool base, pool size, at the root, session, up port, up worker, group, multicast
    for w, dtype, port, length in found[:m].tolist():
        key = (w >> 56, (w >> 48) & 0xFF, (w >> 32) & 0xFFFF, (w >> 16) & 0xFFFF, w & 0xFFFF, dtype, port, length,
               lanes)
        drop, _, _, bit, _, srow, _, pooled = decision(sc, key, full)
        if drop or not pooled or key[1] & FALLBACK:  # (a FALLBACK GRAD passes through unaggregated)
            return None
        # a header-only ZERO contribution (INT32: `decision` checked it) grows into its row: one too
        # narrow for the lanes is dropped MALFORMED by zero_lanes.apply (the general path)
        if key[1] & ZERO and b.arena.shape[1] < b.off + full:
            return None
        multicast = srow[NEXT_STEP] == ROOT and key[0] & 0xF != GRAD  # completions go to every worker
        if multicast and not t.g_len[srow[MCAST_GRP]]:  # (the group's NO_ROUTE drop: the general path)
            return None
        keys.append(key)
        rows.append((bit, srow[EPOCH], srow[NUM_WORKERS], srow[POOL_BASE], srow[POOL_SIZE], srow[NEXT_STEP] == ROOT,
                     key[2], srow[UP_PORT], srow[UP_WORKER], srow[MCAST_GRP], multicast))
    per_key = np.array(rows, dtype=np.int64)
    regs = pipe.registers
    i64, u32 = (np.empty(n, dtype=np.int64) for _ in range(3)), (np.empty(n, dtype=np.uint32) for _ in range(3))
    slot, s, other = i64
    epoch, bit, nw = u32
    is_max, saturated, exponent = np.empty(n, dtype=bool), np.empty(n, dtype=bool), np.empty(n, dtype=np.int8)
    # (pipeline._AggInputs: the register index set * slots + slot, and the other set's)
    if not k.turn_inputs(b.rows, _SLOT_AT, _EXPONENT_AT, kid, per_key, regs.slots, SET, MAX, SATURATED, slot, s, other,
                         epoch, bit, nw, is_max, saturated, exponent):
        return None  # (a slot outside its pool: FALLBACK or FOREIGN_SLOT, the general path)
    prow = np.ascontiguousarray(b.prow)
    order = np.argsort(slot, kind="stable")
    flat = pipe.arena_lanes(b.arena)[1]
    if flat is None or not k.groups_qualify(order, slot, s, epoch, is_max, bit, nw, regs.slot_owner, regs.bitmap,
                                          regs.contributors):
        return None
    # -- taken: from here on, what Pipeline.run does ----------------------------------------------------
    b.luwu_len = b.length  # the parser's
    if any(key[1] & ZERO for key in keys):  # zero_lanes.apply: the INT32 packet of zero lanes it stands for
        zero = np.flatnonzero(h["flags"] & ZERO)
        b.luwu_len = b.length.copy()  # (the received length stays what the counters count)
        b.luwu_len[zero] = wire_len(h["count"][zero].astype(np.int64), INT32, 0, lanes)
        h["flags"][zero] &= KEEP_UNZERO
    b.luwu = np.ones(n, dtype=bool)
    b.ipv4 = np.zeros(n, dtype=bool)
    cnt = pipe.counters
    for key, many in zip(keys, per_turn[:m].tolist()):  # received types and sessions (all passed the session check)
        cnt.rx_types[key[0] & 0xF, 0] += many
        cnt.rx_types[key[0] & 0xF, 1] += many * key[7]
        cnt.session_packets[key[2], 0] += many
        cnt.session_packets[key[2], 1] += many * key[7]
    # short contributions (protocol.md 3.3): their rows' lanes past the end sum as zeros (a ZERO
    # contribution's are all zeros, whatever its row held)
    if min(lens) < full:
        for r, got in zip(prow.tolist(), lens):
            if got < full:
                b.arena[r, b.off + got:b.off + full] = 0
    fast, last = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    remaining, out_exponent, out_saturated = np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.int8), np.zeros(n, dtype=bool)
    handled = k.phase_groups(order, slot, s, other, epoch, is_max, bit, nw, exponent, saturated, prow, regs.slot_owner,
                           regs.bitmap, regs.contributors, regs.exponents, regs.slot_flags, regs.lanes.view(np.uint32),
                           flat[0], flat[1], fast, remaining, out_exponent, out_saturated, last, False)
    if handled != n:
        raise AssertionError(f"phase_groups took {handled} of {n} packets that groups_qualify passed")
    done = np.flatnonzero(remaining == 0)  # completions: only a group's last packet can complete
    total = sum(lens)
    if not len(done):
        cnt.events[ABSORBED, 0] += n
        cnt.events[ABSORBED, 1] += total
        return Emission.empty()
    # the sums stay in their lane registers until emission writes them where they leave (Batch.results)
    b.results = np.full(n, -1, dtype=np.int64)
    b.results[done] = s[done]
    b.result_lanes = regs.lanes
    # next_step_selector: events, routes and the emitted headers of the completions
    n_done = len(done)
    sat = out_saturated[done]
    per = per_key[kid[done]].T  # the completions' key rows, one row per field
    mc = per[10] != 0
    n_sat, n_mc = int(np.count_nonzero(sat)), int(np.count_nonzero(mc))
    sizes = b.length[done]
    done_bytes = int(sizes.sum())
    mc_bytes = done_bytes if n_mc == n_done else int(sizes[mc].sum())
    ev = cnt.events
    for code, many, nbytes in ((COMPLETED, n_done, done_bytes), (ABSORBED, n - n_done, total - done_bytes),
                               (SATURATED_EV, n_sat, int(sizes[sat].sum()) if n_sat else 0),
                               (MULTICAST, n_mc, mc_bytes), (UNICAST, n_done - n_mc, done_bytes - mc_bytes)):
        ev[code, 0] += many
        ev[code, 1] += nbytes
    group = per[9]
    if n_mc == n_done and bool((group == group[0]).all()):
        # every completion to one multicast group: `expand`'s copies, packet by packet in group order
        g = int(group[0])
        a, r = int(t.g_start[g]), int(t.g_len[g])
        em = Emission(np.repeat(done, r), np.tile(t.rep_port[a:a + r], n_done), np.tile(t.rep_instance[a:a + r], n_done),
                      np.repeat(per[6], r), np.zeros(n_done * r, dtype=bool))
    else:
        routes = Routes(n)
        routes.kind[done] = np.where(mc, ROUTE_MULTICAST, ROUTE_UNICAST)
        routes.port[done] = np.where(mc, 0, per[7])
        routes.dst[done] = np.where(mc, 0, NODE)
        routes.group[done] = np.where(mc, group, 0)
        routes.session[done] = per[6]
        drops: list = []
        em = expand(routes, t, drops)
        if drops:  # (groups were checked to have replicas)
            raise AssertionError(f"expand dropped completions the turn's check let through: {drops}")
    root = per[5] != 0
    vt_d = h["ver_type"][done]
    mtype = vt_d & 0xF
    h["ver_type"][done] = (vt_d & 0xF0) | np.where(root, np.where(mtype == GRAD, AGG, RESULT), mtype)
    h["worker"][done] = np.where(root, NODE, per[8])
    h["exponent"][done] = out_exponent[done]
    h["flags"][done] = (h["flags"][done] & KEEP_FLAGS) | np.where(sat, SATURATED, 0)
    seal_rows(b.rows, done, b.off)  # pipeline.reseal: every emitted packet is a completion
    return em
