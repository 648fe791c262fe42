"""The pipeline: one batch of packets through the controls, with exact per-packet P4 semantics.

parser -> ingress drop simulator -> classifier -> zero lanes (header-only ZERO contributions) -> register controls (slot owner, worker bitmap,
contributor counter, exponent max, aggregation lanes; heartbeat table) -> next step selector
-> forwarder (non-luwu IPv4) -> sender (multicast expansion) -> egress drop simulator.

Register controls run in rounds: a packet's round is the number of earlier packets in the
batch that touch the same register index (the slot, for aggregation: both sets share the
bitmaps; the session, for heartbeats). Within a round every index appears at most once, so
fancy-indexed read-modify-write is exact, and rounds run in arrival order, so a batch has the
same effect as processing its packets one at a time. Emitted copies come out in the order of
the packets that triggered them (then replica order) -- the order a sequential run produces.

The slot state machine (a slot's owner epoch, worker bitmap, contributor countdown, exponent and
lanes; docs/protocol.md section 6) is `Pipeline._aggregate`: one round of controls/slot_owner.py,
worker_bitmap.py, contributor_counter.py, exponent_max.py and aggregation_lanes.py, whose outcome
controls/next_step_selector.py `select` routes. This module and controls/ are the reference; the
fast paths that mirror parts of it live in fast/ (fast/__init__.py lists them and what each mirrors).

A shared-memory turn of contributions that all fold in one pass (most of an allreduce's packets)
takes fast/aggregate_turn.py first, which declines any other turn.

Turns of up to SMALL_TURN packets (most shared-memory turns) take the same stages on Python ints
where that is cheaper: the classifier (fast/classify_few.py), the stages after the slot registers
(fast/route_few.py); the slot registers are always this module's fold (fast/aggregate_groups.py)
and rounds (`_aggregate`).
"""

from __future__ import annotations

import itertools

import numpy as np

from ..integrity import seal_rows
from ..kernels import use_numba
from ..protocol import HEADER_LEN, DropReason, Flag, MsgType
from . import stragglers
from .batch import Batch, Emission
from .config import SwitchConfig
from .controls import (
    aggregation_lanes,
    contributor_counter,
    drop_simulator,
    exponent_max,
    heartbeat_table,
    slot_owner,
    worker_bitmap,
    zero_lanes,
)
from .controls.classifier import PATH_AGGREGATE, PATH_HEARTBEAT, Classified, classify
from .controls.drop_simulator import Random32
from .controls.forwarder import forward
from .controls.next_step_selector import AggregationResult, HeartbeatResult, Routes, select
from .controls.parser import parse
from .controls.sender import FrameTemplate, deparse_frames, expand
from .counters import Counters
from .fast import aggregate_groups, aggregate_turn, route_few
from .fast.classify_few import classify_rows
from .registers import Registers
from .stragglers import Stragglers
from .tables import Tables

INGRESS, EGRESS, LINK_IN, LINK_OUT = range(4)  # random streams spawned from the seed
SET, SATURATED, MAX = int(Flag.SET), int(Flag.SATURATED), int(Flag.MAX)
HEARTBEAT = int(MsgType.HEARTBEAT)
# turns of up to this many packets are classified one packet at a time (fast/classify_few.py: the
# vectorised classifier's numpy calls cost the same for one packet as for hundreds); 0: never
SMALL_TURN = 16
AGGREGATE_TURN = 2  # shared-memory turns of this many packets or more try fast/aggregate_turn.py first
CONTRIBUTIONS = (int(MsgType.GRAD), int(MsgType.ALLREDUCE))


def reseal(b: Batch, pkt: np.ndarray) -> None:
    """The header check of every luwu packet among `pkt` (a batch's emitted copies) written again
    over its rewritten header (docs/protocol.md 3.5: the switch recomputes it on all it emits)."""
    if not len(pkt):
        return
    if len(pkt) <= 4:
        luwu = b.luwu
        seal_rows(b.rows, [p for p in dict.fromkeys(pkt.tolist()) if luwu[p]], b.off)
        return
    u = np.unique(pkt)
    seal_rows(b.rows, u[b.luwu[u]], b.off)


def round_numbers(keys: np.ndarray) -> np.ndarray:
    """For each key, how many earlier entries carry the same key."""
    n = len(keys)
    if n <= 8:  # a small turn: a count per key in Python instead of a sort's half-dozen numpy calls
        seen: dict = {}
        out = []
        for k in keys.tolist():
            out.append(seen.get(k, 0))
            seen[k] = out[-1] + 1
        return np.array(out, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    start = np.ones(n, dtype=bool)
    start[1:] = sk[1:] != sk[:-1]
    pos = np.arange(n)
    group_start = np.maximum.accumulate(np.where(start, pos, 0))
    rounds = np.empty(n, dtype=np.int64)
    rounds[order] = pos - group_start
    return rounds


def _as_slice(a: np.ndarray) -> slice | None:
    """`a` as a slice when it is an ascending run of consecutive integers."""
    n = len(a)
    if n == 0:
        return None
    lo = int(a[0])
    if int(a[-1]) - lo == n - 1 and (n < 3 or bool((a[1:] - a[:-1] == 1).all())):
        return slice(lo, lo + n)
    return None


class _AggInputs:
    """Per-packet inputs of the aggregation path, gathered once per batch (rounds index them)."""

    __slots__ = (
        "ai",
        "bit",
        "epoch",
        "exponent",
        "is_max",
        "nw",
        "other",
        "other_slice",
        "rows",
        "rows_slice",
        "s",
        "s_slice",
        "saturated",
    )

    def __init__(self, c: Classified, ai: np.ndarray, slot: np.ndarray, slots: int, b: Batch):
        self.ai = ai
        self.rows = b.payload_rows(c.idx[ai])  # rows of b.payload(): a split batch's arena rows
        flags = c.flags[ai]
        set_ = (flags & SET).astype(np.int64)
        self.s = set_ * slots + slot
        self.other = (1 - set_) * slots + slot
        self.bit = c.bit[ai].astype(np.uint32)
        self.nw = c.num_workers[ai].astype(np.uint32)
        self.epoch = c.epoch[ai].astype(np.uint32)
        self.exponent = c.h["exponent"][ai]
        self.saturated = (flags & SATURATED) != 0
        self.is_max = (flags & MAX) != 0
        self.s_slice = self.other_slice = self.rows_slice = None  # made by `slices` (the rounds' path only)

    def slices(self) -> tuple:
        """(s, other, rows), each as a slice where consecutive: views instead of gathers."""
        if self.s_slice is None:
            self.s_slice = _as_slice(self.s) or self.s
            self.other_slice = _as_slice(self.other) or self.other
            self.rows_slice = _as_slice(self.rows) or self.rows
        return self.s_slice, self.other_slice, self.rows_slice


class Pipeline:
    def __init__(self, config: SwitchConfig, tables: Tables, registers: Registers, counters: Counters):
        self.config = config
        self.tables = tables
        self.registers = registers
        self.counters = counters
        self.lanes = config.lanes
        streams = np.random.SeedSequence(config.seed).spawn(2)
        self.rng_ingress = Random32(streams[INGRESS])
        self.rng_egress = Random32(streams[EGRESS])
        self.template = FrameTemplate(config.service_mac, config.service_ip, config.udp_port)
        # host-side bookkeeping, not part of the P4 twin; None when not asked for (config.stragglers)
        self.stragglers = Stragglers(config.slots) if config.stragglers else None
        self._arena_lanes: tuple | None = None  # (arena, its payload view, lane_rows): _payload

    def link_stream(self, port: int, direction: int) -> Random32:
        """An independent seeded stream for one direction of one port's link impairments."""
        return Random32(np.random.SeedSequence(self.config.seed, spawn_key=(direction, port)))

    # -- one batch ---------------------------------------------------------------------------
    def run(self, b: Batch) -> Emission:
        t = self.tables.compiled()
        # a shared-memory turn of contributions (fast/aggregate_turn.py); a small one only when it
        # starts with one (most small turns of heartbeats and PULLs are not worth its look)
        if b.prow is not None and len(b) >= AGGREGATE_TURN and (
                len(b) > SMALL_TURN or int(b.rows[0, b.off]) & 0xF in CONTRIBUTIONS):
            em = aggregate_turn.run(self, b, t)
            if em is not None:
                return em
        cnt = self.counters
        parse(b, self.config.udp_port)
        if len(b) <= SMALL_TURN:  # a few packets: counted on Python ints (no fancy-indexed temporaries)
            seen: dict[int, list[int]] = {}  # type -> [packets, bytes]: one counter update per type (turns hold one or two)
            for vt, n in itertools.compress(zip(b.hdr["ver_type"].tolist(), b.length.tolist()), b.luwu.tolist()):
                got = seen.get(vt & 0xF)
                if got is None:
                    seen[vt & 0xF] = [1, n]
                else:
                    got[0] += 1
                    got[1] += n
            rx_types = cnt.rx_types
            for code, (k, n) in seen.items():
                rx_types[code, 0] += k
                rx_types[code, 1] += n
        elif b.luwu.any():
            cnt.rx_type((b.hdr["ver_type"][b.luwu] & 0xF).astype(np.int64), b.length[b.luwu])
        if t.any_ingress_drop:
            lost = drop_simulator.simulate(b.port, b.drop == 0, t.ingress_threshold, self.rng_ingress)
            b.drop[lost] = DropReason.SIMULATED_LOSS
        if len(b) <= SMALL_TURN:
            c, srows = classify_rows(b, t, self.lanes, cnt)
            if not b.framed and not t.any_egress_drop:
                paths = c.path.tolist()
                if route_few.eligible(paths):  # the stages after the slot registers on Python ints
                    agg = None
                    if PATH_AGGREGATE in paths:
                        zero_lanes.apply(b, c, self.lanes)
                        paths = c.path.tolist()  # (a ZERO packet the buffer cannot widen is dropped)
                        agg = AggregationResult(len(paths))
                        self._aggregation(b, c, agg)
                        self._observe_small(c, agg, paths)
                    em = route_few.route(b, c, paths, srows, t, self.registers, cnt, agg)
                    reseal(b, em.pkt)
                    return em
        else:
            c = classify(b, t, self.lanes, cnt)
        zero_lanes.apply(b, c, self.lanes)
        n = len(c.idx)
        agg, hb = AggregationResult(n), HeartbeatResult(n)
        self._registers(b, c, agg, hb)
        self._observe(c, agg)
        routes = Routes(len(b))
        events, drops = select(b, c, agg, hb, routes)
        for code, idx in drops:
            b.drop[idx] = code
        if b.framed:
            forward(b, t, routes, events)
        copy_drops: list = []
        em = expand(routes, t, copy_drops)
        for code, idx in copy_drops:  # a multicast with no replicas: the packet itself is dropped
            b.drop[idx] = code
        if t.any_egress_drop and len(em):
            lost = drop_simulator.simulate(em.port, np.ones(len(em), dtype=bool), t.egress_threshold, self.rng_egress)
            if lost.any():
                self.count_copy_drops(b, DropReason.SIMULATED_LOSS, em.pkt[lost])
                cnt.ports_add(em.port[lost], "tx_sim_lost")
                em = em.select(~lost)
        dropped = b.drop != 0
        if dropped.any():
            cnt.drop(b.drop[dropped], b.length[dropped])
            cnt.ports_add(b.port[dropped], "rx_dropped")
        if events:
            codes = np.concatenate([np.full(len(i), int(code), dtype=np.int64) for code, i in events])
            idx = np.concatenate([i for _, i in events])
            cnt.event(codes, b.length[idx])
        reseal(b, em.pkt)
        return em

    def valid(self, b: Batch) -> np.ndarray:
        """Which packets would pass the parser and classifier (no side effects): a UDP port learns
        its peer from the first of them."""
        probe = Batch(b.rows, b.length, b.port, b.framed, b.drop.copy())
        parse(probe, self.config.udp_port)
        c = classify(probe, self.tables.compiled(), self.lanes, None)
        ok = np.zeros(len(b), dtype=bool)
        ok[c.idx[probe.drop[c.idx] == 0]] = True
        return ok

    def count_copy_drops(self, b: Batch, code: int, pkt: np.ndarray) -> None:
        self.counters.drop(np.full(len(pkt), int(code), dtype=np.int64), b.length[pkt])

    def frames(self, b: Batch, em: Emission) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ethernet frames for emitted copies (endpoints rewrite); (frames, lengths, kept mask)."""
        drops: list = []
        out = deparse_frames(b, em, self.tables.compiled(), self.template, drops)
        for code, idx in drops:
            self.count_copy_drops(b, code, idx)
        return out

    def _observe(self, c: Classified, agg: AggregationResult) -> None:
        """Hand the batch's aggregation outcome to the straggler bookkeeping (stragglers.py)."""
        if self.stragglers is None:
            return
        ai = np.flatnonzero(c.path == PATH_AGGREGATE)
        if len(ai):
            index = (c.flags[ai] & SET).astype(np.int64) * self.registers.slots + c.h["slot"][ai].astype(np.int64)
            self.stragglers.record(c.session[ai], c.worker[ai], c.bit[ai], index, c.num_workers[ai], agg.dup[ai],
                                   agg.remaining[ai])

    def _observe_small(self, c: Classified, agg: AggregationResult, paths: list[int]) -> None:
        """`_observe` for a small turn (`paths`: c.path as a list), on Python lists."""
        if self.stragglers is None:
            return
        ai = [k for k, p in enumerate(paths) if p == PATH_AGGREGATE]
        if len(ai) > stragglers.SMALL:
            self._observe(c, agg)
            return
        slots = self.registers.slots
        flags, slot = c.flags.tolist(), c.h["slot"].tolist()
        cols = [x.tolist() for x in (c.session, c.worker, c.bit, c.num_workers, agg.dup, agg.remaining)]
        session, worker, bit, nw, dup, remaining = ([col[k] for k in ai] for col in cols)
        index = [(flags[k] & SET) * slots + slot[k] for k in ai]
        self.stragglers.record_lists(session, worker, bit, index, nw, dup, remaining)

    # -- register controls, in rounds -----------------------------------------------------------
    def _registers(self, b: Batch, c: Classified, agg: AggregationResult, hb: HeartbeatResult) -> None:
        self._aggregation(b, c, agg)
        hi = np.flatnonzero(c.path == PATH_HEARTBEAT) if c.types[HEARTBEAT] else ()
        if len(hi):
            rounds = round_numbers(c.session[hi])
            n_rounds = int(rounds.max()) + 1
            for r in range(n_rounds):
                self._heartbeat(b, c, hi if n_rounds == 1 else hi[rounds == r], hb)

    def _payload(self, b: Batch) -> tuple[np.ndarray, tuple | None]:
        """`b.payload()` and its `lane_rows` (None: fold makes it), kept while a split batch's arena
        stays the same array (the event loop's arena lives until ports change: shm_arena.py)."""
        if b.arena is None or not use_numba():
            return b.payload(self.lanes), None
        return self.arena_lanes(b.arena)

    def arena_lanes(self, arena: np.ndarray) -> tuple[np.ndarray, tuple | None]:
        """The lanes of a shared-memory turn's `arena` rows (a split batch's `payload()`: datagrams
        at offset 0) and their `lane_rows` (kernels on), made once per arena array."""
        kept = self._arena_lanes
        if kept is None or kept[0] is not arena:
            from ..kernels.switch_lanes import lane_rows

            payload = arena[:, HEADER_LEN:HEADER_LEN + 4 * self.lanes].view(">i4")
            kept = self._arena_lanes = (arena, payload, lane_rows(payload.view(np.uint32)))
        return kept[1], kept[2]

    def _aggregation(self, b: Batch, c: Classified, agg: AggregationResult) -> None:
        """The slot registers (fast/aggregate_groups.py's fold, the rest in rounds) for the aggregation packets."""
        ai = np.flatnonzero(c.path == PATH_AGGREGATE)
        if len(ai):
            slot = c.h["slot"][ai].astype(np.int64)
            a = _AggInputs(c, ai, slot, self.registers.slots, b)
            payload, flat = self._payload(b)
            rest = None
            # the contributions to each slot: fold the qualifying groups in one pass (None: no
            # slot has a qualifying group, nothing changed), the rest go through the rounds
            # shared-memory turns (split batches) leave the fast path's sums in the registers:
            # emission writes each once where it leaves from, a multicast pool row (Batch.results)
            split = b.prow is not None
            fast = aggregate_groups.fold(slot, a, self.registers, payload, agg, write_out=not split, flat=flat)
            if fast is not None:
                if split:
                    done = np.flatnonzero(fast & (agg.remaining[ai] == 0))
                    if len(done):
                        b.results = np.full(len(b), -1, dtype=np.int64)
                        b.results[c.idx[ai[done]]] = a.s[done]
                        b.result_lanes = self.registers.lanes
                rest = np.flatnonzero(~fast)
                rounds = round_numbers(slot[rest]) if len(rest) else rest
            else:
                rounds = round_numbers(slot)
            n_rounds = int(rounds.max()) + 1 if len(rounds) else 0
            for r in range(n_rounds):
                if n_rounds == 1:
                    sel = rest  # None: every aggregation packet
                else:
                    sel = np.flatnonzero(rounds == r)
                    sel = sel if rest is None else rest[sel]
                self._aggregate(a, sel, payload, agg)

    def _aggregate(self, a: _AggInputs, sel, payload: np.ndarray, agg: AggregationResult) -> None:
        """One round of the slot state machine over aggregation packets `sel` (None: all): the reference
        that fast/aggregate_groups.py and fast/aggregate_one.py mirror."""
        regs = self.registers
        if sel is None:
            (s, other, rows), bit, nw = a.slices(), a.bit, a.nw
            epoch, exp_in, sat_in, is_max, out = a.epoch, a.exponent, a.saturated, a.is_max, a.ai
        else:
            s, other, rows, bit, nw = a.s[sel], a.other[sel], a.rows[sel], a.bit[sel], a.nw[sel]
            epoch, exp_in, sat_in, is_max, out = a.epoch[sel], a.exponent[sel], a.saturated[sel], a.is_max[sel], a.ai[sel]
            s, other, rows = _as_slice(s) or s, _as_slice(other) or other, _as_slice(rows) or rows
        fresh = slot_owner.apply(regs.slot_owner, s, epoch)
        before = worker_bitmap.apply(regs.bitmap, s, other, bit, fresh)
        dup = (before & bit) != 0
        first = before == 0
        all_first = bool(first.all())
        plain = not all_first and not (first.any() or dup.any())
        remaining = contributor_counter.apply(regs.contributors, s, first, dup, nw, all_first, plain)
        exponent, sat = exponent_max.apply(regs.exponents, regs.slot_flags, s, first, dup, exp_in, sat_in,
                                           all_first, plain)
        aggregation_lanes.apply(regs.lanes, payload, rows, s, first, dup, is_max, remaining == 0, all_first, plain)
        agg.dup[out] = dup
        agg.remaining[out] = remaining
        agg.exponent[out] = exponent
        agg.saturated[out] = sat

    def _heartbeat(self, b: Batch, c: Classified, sel: np.ndarray, hb: HeartbeatResult) -> None:
        h = b.hb[c.idx[sel]]
        full, ack, credit = heartbeat_table.apply(self.registers, c.session[sel], c.epoch[sel], c.bit[sel],
                                                  c.worker_mask[sel], h["ack"], h["credit"])
        hb.full[sel] = full
        hb.ack[sel] = ack
        hb.credit[sel] = credit
