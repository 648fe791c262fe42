"""Shared setup for the switch tests: a small multi-session runtime and packet builders."""

from __future__ import annotations

import numpy as np

from luwu.dataplane.integrity import trailer
from luwu.dataplane.protocol import NODE, Flag, MsgType, NextStep, Packet, slot_for

LANES = 8
SLOTS = 32
NODE_PORT = 4
PARENT_PORT = 5
UP_WORKER = 7

# session id -> (pool_base, pool_size, workers, epoch, next_step, up_port, mcast_grp)
SESSIONS = {
    1: (0, 4, (0, 1, 2), 11, NextStep.ROOT, 0, 1),  # collective at a root
    2: (4, 4, (0, 1, 2), 22, NextStep.ROOT, NODE_PORT, 2),  # node session at a root
    3: (8, 8, (0, 1), 33, NextStep.UPSTREAM, PARENT_PORT, 3),  # a ToR: completions go to the parent
    4: (16, 2, (2,), 44, NextStep.ROOT, NODE_PORT, 4),  # N = 1, and multicast group 4 has no replicas
    5: (0, 4, (0, 1), 55, NextStep.ROOT, NODE_PORT, 1),  # reuses session 1's slots with another epoch
    6: (20, 0, (0, 1, 2), 66, NextStep.ROOT, NODE_PORT, 2),  # no slots here: every GRAD falls back
}


def worker_port(rank: int) -> int:
    return rank + 1


def runtime(sessions: dict = SESSIONS, endpoints: bool = True) -> dict:
    entries, groups = [], []
    for sid, (base, size, ranks, epoch, step, up_port, grp) in sessions.items():
        mask = 0
        for i, r in enumerate(ranks):
            mask |= 1 << i
            entries.append({"table": "LuwuIngress.classifier.workers", "match": {"hdr.luwu.session": sid, "worker": r},
                            "action_name": "set_worker", "action_params": {"worker_bit": 1 << i, "port": worker_port(r)}})
            if endpoints:
                entries.append(endpoint(sid, r))
        if endpoints:
            entries.append(endpoint(sid, NODE))
        entries.append({"table": "sessions", "match": {"session": sid}, "action_name": "LuwuIngress.set_session",
                        "action_params": {"pool_base": base, "pool_size": size, "num_workers": len(ranks),
                                          "worker_mask": mask, "epoch": epoch, "mcast_grp": grp,
                                          "next_step": int(step), "up_port": up_port, "up_worker": UP_WORKER}})
        if grp != 4 and not any(g["multicast_group_id"] == grp for g in groups):
            groups.append({"multicast_group_id": grp,
                           "replicas": [{"egress_port": worker_port(r), "instance": r} for r in ranks]})
    return {"target": "test", "table_entries": entries, "multicast_group_entries": groups}


def endpoint(session: int, dst: int) -> dict:
    """Deterministic fake addresses: MAC 02:00:00:00:ss:dd, IP 10.s.d-ish, UDP 20000 + dst."""
    d = dst & 0xFF
    return {"table": "endpoints", "match": {"session": session, "dst": dst}, "action_name": "set_endpoint",
            "action_params": {"dst_mac": 0x020000000000 | (session << 8) | d, "dst_ip": f"10.{session}.0.{d}",
                              "dst_udp": 20000 + d}}


def agg_packet(session: int, worker: int, seq: int, values, *, mtype: int = MsgType.ALLREDUCE, flags: int = 0,
               exponent: int = 0, lanes: int = LANES, slot: int | None = None, set_: int | None = None,
               count: int | None = None, tensor: int = 9, numel: int = 1000, dtype: int = 4) -> bytes:
    base, size = SESSIONS[session][:2] if session in SESSIONS else (0, 4)
    s, st = slot_for(seq, base, size) if size else (base + seq, 0)
    if slot is not None:
        s = slot
    if set_ is not None:
        st = set_
    v = np.zeros(lanes, dtype=">i4")
    vals = np.atleast_1d(np.asarray(values, dtype=np.int64))
    v[:min(lanes, len(vals))] = vals[:lanes].astype(np.int32) if len(vals) else []
    return Packet(mtype, session, worker, flags | (Flag.SET if st else 0), lanes if count is None else count,
                  seq, s, tensor, seq * lanes, exponent, dtype, numel, payload=v.tobytes()).pack()


def heartbeat(session: int, worker: int, ack: int, credit: int, seq: int = 0) -> bytes:
    return Packet(MsgType.HEARTBEAT, session, worker, seq=seq, ack=ack & 0xFFFFFFFF,
                  credit=credit & 0xFFFFFFFF).pack()


def param(session: int, count: int = 3, dtype: int = 1, worker: int = NODE, pull_id: int = 1) -> bytes:
    item = {0: 4, 1: 4, 2: 2, 3: 2, 4: 4, 5: 4}.get(dtype, 4)
    body = bytes(range(count * item))
    return Packet(MsgType.PARAM, session, worker, count=count, slot=pull_id, dtype=dtype,
                  payload=body + trailer(body)).pack()  # the trailer (docs/protocol.md 3.7)


def pull(session: int, worker: int, requests=((1, 2, 3),)) -> bytes:
    body = b"".join(a.to_bytes(4, "big") + b.to_bytes(4, "big") + c.to_bytes(4, "big") for a, b, c in requests)
    return Packet(MsgType.PULL, session, worker, count=len(requests), payload=body + trailer(body)).pack()


def lanes_of(data: bytes) -> list[int]:
    return Packet.unpack(data).lanes().tolist()
