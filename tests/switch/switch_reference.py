"""An independent, one-packet-at-a-time model of docs/protocol.md section 6 in plain Python.

Written from the spec, sharing nothing with the switch but the protocol constants: the
property tests check the vectorised switch against it (datagram semantics, no drop simulator).
"""

from __future__ import annotations

from collections import defaultdict

from luwu.dataplane.integrity import TRAILER_LEN, header_ok
from luwu.dataplane.protocol import (
    DTYPE_ITEMSIZE,
    HEADER_LEN,
    NODE,
    VERSION,
    DropReason,
    Dtype,
    Event,
    Flag,
    MsgType,
    NextStep,
    Packet,
    serial_min,
)


def wrap32(v: int) -> int:
    return ((v + 2**31) % 2**32) - 2**31


class ReferenceSwitch:
    def __init__(self, lanes: int, slots: int):
        self.lanes, self.slots = lanes, slots
        self.sessions: dict[int, dict] = {}
        self.workers: dict[tuple[int, int], tuple[int, int]] = {}
        self.child_ports: set[tuple[int, int]] = set()  # (session, port of a child switch)
        self.groups: dict[int, list[tuple[int, int]]] = {}
        self.slot_owner = defaultdict(int)
        self.bitmap = [defaultdict(int), defaultdict(int)]
        self.contributors = defaultdict(int)
        self.exponents = defaultdict(int)
        self.slot_flags = defaultdict(int)
        self.lane_regs: dict[int, list[int]] = defaultdict(lambda: [0] * lanes)
        self.hb_owner, self.hb_bitmap = defaultdict(int), defaultdict(int)
        self.hb_ack, self.hb_credit = defaultdict(int), defaultdict(int)
        self.drops = defaultdict(lambda: [0, 0])
        self.events = defaultdict(lambda: [0, 0])
        self.rx_types = defaultdict(lambda: [0, 0])
        self.session_packets = defaultdict(lambda: [0, 0])

    def load(self, runtime: dict) -> None:
        for e in runtime["table_entries"]:
            t, p = e["table"].rsplit(".", 1)[-1], e["action_params"]
            m = {k.rsplit(".", 1)[-1]: v for k, v in e["match"].items()}
            if t == "sessions":
                self.sessions[m["session"]] = dict(p)
            elif t == "workers":
                self.workers[(m["session"], m["worker"])] = (p["worker_bit"], p["port"])
            elif t == "child_ports":
                self.child_ports.add((m["session"], m["port"]))
        for g in runtime.get("multicast_group_entries", []):
            self.groups[g["multicast_group_id"]] = [(r["egress_port"], r["instance"]) for r in g["replicas"]]

    def counters(self) -> dict:
        def rows(d, keys):
            return {k: tuple(d[k]) for k in keys}
        return {"drops": rows(self.drops, [int(r) for r in DropReason]),
                "events": rows(self.events, [int(e) for e in Event]),
                "rx_types": rows(self.rx_types, range(16)),
                "session_packets": {k: tuple(v) for k, v in sorted(self.session_packets.items()) if v[0]}}

    def _count(self, table, code, n):
        table[code][0] += 1
        table[code][1] += n

    def process(self, port: int, data: bytes) -> list[tuple[int, bytes]]:
        n = len(data)
        if n < HEADER_LEN:
            self._count(self.drops, DropReason.MALFORMED, n)
            return []
        pkt = Packet.unpack(data, verify=False)
        self._count(self.rx_types, pkt.type, n)
        drop = DropReason.BAD_CHECKSUM if not header_ok(data) else self._validate(pkt, n)
        if drop:
            self._count(self.drops, drop, n)
            return []
        s = self.sessions[pkt.session]
        self._count(self.session_packets, pkt.session, n)
        from_node = pkt.worker == NODE
        passing = pkt.type == MsgType.GRAD and pkt.flags & Flag.FALLBACK  # a rank of a switch below
        if not from_node and (pkt.session, pkt.worker) not in self.workers and not passing:
            self._count(self.drops, DropReason.UNKNOWN_WORKER, n)
            return []
        bit, wport = self.workers.get((pkt.session, pkt.worker), (0, 0))
        known = (pkt.session, pkt.worker) in self.workers
        if ((from_node and port != s["up_port"]) or (not from_node and known and port != wport)
                or (not from_node and not known and (pkt.session, port) not in self.child_ports)):
            self._count(self.drops, DropReason.SPOOFED, n)  # source guard: an id off its bound port
            return []
        root = s["next_step"] == NextStep.ROOT
        t = pkt.type
        bad_dir = (t == MsgType.AGG or (t in (MsgType.GRAD, MsgType.ALLREDUCE, MsgType.PULL) and from_node)
                   or (t in (MsgType.PARAM, MsgType.RESULT) and not from_node) or (t == MsgType.RESULT and root))
        if bad_dir:
            self._count(self.drops, DropReason.BAD_DIRECTION, n)
            return []
        up = (s["up_port"], NODE)
        if pkt.flags & Flag.ZERO and t in (MsgType.GRAD, MsgType.ALLREDUCE):
            # stands for `lanes` zero lanes from here on (aggregate or fallback: zero_lanes.p4); other
            # types keep the flag, which means nothing to them, and go on as they came
            pkt.flags &= ~Flag.ZERO & 0xFF
            pkt.payload = bytes(4 * self.lanes)
        if t in (MsgType.GRAD, MsgType.ALLREDUCE):
            in_pool = ((pkt.slot - s["pool_base"]) & 0xFFFFFFFF) < s["pool_size"]
            if t == MsgType.GRAD and (not in_pool or pkt.flags & Flag.FALLBACK):
                pkt.flags |= Flag.FALLBACK
                self._count(self.events, Event.FALLBACK, n)
                return self._unicast(pkt, up, n)
            if not in_pool:
                self._count(self.drops, DropReason.FOREIGN_SLOT, n)
                return []
            return self._aggregate(pkt, s, bit, wport, root, n)
        if t == MsgType.HEARTBEAT and not from_node:
            return self._heartbeat(pkt, s, bit, root, n)
        if t == MsgType.PULL:
            if not root:
                pkt.worker = s["up_worker"]
            return self._unicast(pkt, up, n)
        self._count(self.events, Event.MULTICAST, n)  # PARAM, node HEARTBEAT, RESULT from the parent
        return self._multicast(pkt, s, n)

    def _validate(self, pkt: Packet, n: int) -> int:
        if pkt.version != VERSION:
            return DropReason.BAD_VERSION
        if not 1 <= pkt.type <= 7:
            return DropReason.BAD_TYPE
        if pkt.type in (MsgType.GRAD, MsgType.AGG, MsgType.ALLREDUCE, MsgType.RESULT) and pkt.flags & Flag.ZERO:
            # header-only ZERO contribution: INT32 GRAD/ALLREDUCE only (protocol.md 3.2)
            ok = (n == HEADER_LEN and pkt.count <= self.lanes and pkt.dtype == Dtype.INT32
                  and pkt.type in (MsgType.GRAD, MsgType.ALLREDUCE))
        elif pkt.type in (MsgType.GRAD, MsgType.AGG, MsgType.ALLREDUCE, MsgType.RESULT):
            most = 2 * self.lanes if pkt.dtype == Dtype.FIXED16 else self.lanes  # FIXED16: two int16 values a lane
            ok = n == HEADER_LEN + 4 * self.lanes and pkt.count <= most  # 4-byte lanes, every dtype
        elif pkt.type == MsgType.PARAM:
            ok = pkt.dtype in DTYPE_ITEMSIZE and n == HEADER_LEN + pkt.count * DTYPE_ITEMSIZE[pkt.dtype] + TRAILER_LEN
        elif pkt.type == MsgType.HEARTBEAT:
            ok = n == HEADER_LEN
        else:
            ok = n == HEADER_LEN + 12 * pkt.count + TRAILER_LEN
        if not ok:
            return DropReason.MALFORMED
        if pkt.session not in self.sessions:
            return DropReason.UNKNOWN_SESSION
        return 0

    def _unicast(self, pkt, dest, n):
        self._count(self.events, Event.UNICAST, n)
        return [(dest[0], pkt.pack())]

    def _multicast(self, pkt, s, n):
        reps = self.groups.get(s["mcast_grp"], [])
        if not reps:
            self._count(self.drops, DropReason.NO_ROUTE, n)
        data = pkt.pack()
        return [(p, data) for p, _ in reps]

    def _aggregate(self, pkt, s, bit, wport, root, n):
        st = pkt.flags & Flag.SET
        slot = pkt.slot
        i = st * self.slots + slot
        fresh = self.slot_owner[i] != s["epoch"]
        self.slot_owner[i] = s["epoch"]
        before = 0 if fresh else self.bitmap[st][slot]
        self.bitmap[st][slot] = before | bit
        self.bitmap[1 - st][slot] &= ~bit & 0xFFFFFFFF
        dup, first = bool(before & bit), before == 0
        x = [int(v) for v in pkt.lanes()]
        if first:
            rem = s["num_workers"] - 1
            self.exponents[i], self.slot_flags[i] = pkt.exponent, pkt.flags & Flag.SATURATED
            self.lane_regs[i] = x
        elif dup:
            rem = self.contributors[i]
        else:
            rem = (self.contributors[i] - 1) & 0xFFFFFFFF
            self.exponents[i] = max(self.exponents[i], pkt.exponent)
            self.slot_flags[i] |= pkt.flags & Flag.SATURATED
            old = self.lane_regs[i]
            if pkt.flags & Flag.MAX:
                self.lane_regs[i] = [max(a, b) for a, b in zip(old, x)]
            else:
                self.lane_regs[i] = [wrap32(a + b) for a, b in zip(old, x)]
        self.contributors[i] = rem
        if rem != 0:
            if dup:
                self._count(self.drops, DropReason.DUPLICATE, n)
            else:
                self._count(self.events, Event.ABSORBED, n)
            return []
        self._count(self.events, Event.RESENT if dup else Event.COMPLETED, n)
        if self.slot_flags[i]:
            self._count(self.events, Event.SATURATED, n)
        grad = pkt.type == MsgType.GRAD
        sender = pkt.worker
        if root:
            pkt.type = MsgType.AGG if grad else MsgType.RESULT
        pkt.worker = NODE if root else s["up_worker"]
        pkt.exponent = self.exponents[i]
        pkt.flags = (pkt.flags & (Flag.SET | Flag.MAX)) | self.slot_flags[i] | (Flag.RETX if dup else 0)
        pkt.payload = b"".join(v.to_bytes(4, "big", signed=True) for v in self.lane_regs[i])
        if grad or not root:
            return self._unicast(pkt, (s["up_port"], NODE), n)
        if dup:
            return self._unicast(pkt, (wport, sender), n)
        self._count(self.events, Event.MULTICAST, n)
        return self._multicast(pkt, s, n)

    def _heartbeat(self, pkt, s, bit, root, n):
        sid = pkt.session
        fresh = self.hb_owner[sid] != s["epoch"]
        self.hb_owner[sid] = s["epoch"]
        before = 0 if fresh else self.hb_bitmap[sid]
        after = before | bit
        full = after == s["worker_mask"]
        self.hb_bitmap[sid] = 0 if full else after
        if before == 0:
            self.hb_ack[sid], self.hb_credit[sid] = pkt.ack, pkt.credit
        else:
            self.hb_ack[sid] = serial_min(self.hb_ack[sid], pkt.ack)
            self.hb_credit[sid] = serial_min(self.hb_credit[sid], pkt.credit)
        if not full:
            self._count(self.events, Event.HB_ABSORBED, n)
            return []
        self._count(self.events, Event.HB_ROUND, n)
        pkt.worker = NODE if root else s["up_worker"]
        pkt.ack, pkt.credit = self.hb_ack[sid], self.hb_credit[sid]
        return self._unicast(pkt, (s["up_port"], NODE), n)
