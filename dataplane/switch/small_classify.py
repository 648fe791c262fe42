"""The classifier for turns of a few packets: `controls/classifier.py`'s checks, one packet at a time.

On shared-memory ports most event-loop turns hold one to four packets (heartbeats, PULLs, one
endpoint's GRADs), and the vectorised classifier's sixty-odd numpy calls (1-2 us each, whatever
the batch size) were a third of such a turn's CPU. This twin runs the same checks, in the same
order, on Python ints per packet and returns the same `Classified` (same fields, dtypes and
values, including the table rows the vectorised lookups read for packets that miss), the same
drop reasons in `b.drop` and the same session counters. `pipeline.SMALL_TURN` picks it;
tests/switch/test_switch_small_turns.py checks it equals the vectorised classifier on random
small batches of every type, malformed ones included.
"""

from __future__ import annotations

import numpy as np

from ..protocol import HEADER_LEN, MAX_SESSIONS, NODE, PULL_REQUEST, VERSION, aggregation_packet_len
from .controls.classifier import (
    _ITEMSIZE,
    AGG,
    ALLREDUCE,
    D_BAD_DIRECTION,
    D_BAD_TYPE,
    D_BAD_VERSION,
    D_FOREIGN_SLOT,
    D_MALFORMED,
    D_SPOOFED,
    D_UNKNOWN_SESSION,
    D_UNKNOWN_WORKER,
    FALLBACK,
    GRAD,
    HEARTBEAT,
    INT32,
    PARAM,
    PATH_AGGREGATE,
    PATH_FALLBACK,
    PATH_HEARTBEAT,
    PATH_MULTICAST,
    PATH_PULL,
    PULL,
    RESULT,
    TYPE_CODES,
    UPSTREAM,
    ZERO,
    Classified,
    alive_headers,
    take_session_fields,
)
from .lookup import CompiledTables

_ITEM = _ITEMSIZE.tolist()
_PULL_ITEM = PULL_REQUEST.itemsize


def _pair_row(table, a: int, b: int) -> tuple[bool, int]:
    """`ExactPairs.find` for one key: (hit, row), the row clamped as the vectorised lookup's."""
    keys = table.keys
    n = len(keys)
    if n == 0:
        return False, 0
    q = (a << 16) | b
    i = min(int(keys.searchsorted(q)), n - 1)
    return int(keys[i]) == q, i


def classify_small(b, t: CompiledTables, lanes: int, counters) -> Classified:
    """`classifier.classify` for a batch of a few packets (same result, fewer numpy calls)."""
    c = Classified()
    c.idx, c.h = idx, h = alive_headers(b)
    n_pk = len(idx)
    c.mtype = h["ver_type"] & 0xF
    c.flags = h["flags"]
    c.nbytes = nbytes = b.length[idx]
    c.session = h["session"].astype(np.int64)
    c.worker = h["worker"].astype(np.int64)
    c.from_node = c.worker == NODE
    agg_len = aggregation_packet_len(lanes)
    s_valid, s = t.s_valid, t.s
    wparams = t.workers.params if len(t.workers.keys) else None
    types = [0] * TYPE_CODES
    drops, paths, sids, bits, wports = [], [], [], [], []
    in_ports = b.port[idx].tolist()
    lengths = b.luwu_len[idx].tolist()
    nbytes_l = nbytes.tolist()
    names = h.dtype.names or ()  # a header batch always has its fields: for the type checker
    i_vt, i_fl, i_se, i_wo, i_co = (names.index(f) for f in ("ver_type", "flags", "session", "worker", "count"))
    i_sl, i_dt = names.index("slot"), names.index("dtype")
    for k, row in enumerate(h.tolist()):
        vt, flags, session, worker, count = row[i_vt], row[i_fl], row[i_se], row[i_wo], row[i_co]
        slot, dtype = row[i_sl], row[i_dt]
        mtype = vt & 0xF
        types[mtype] += 1
        drop = D_BAD_VERSION if (vt >> 4) != VERSION else 0
        if not drop and not 1 <= mtype <= PULL:
            drop = D_BAD_TYPE
        agg_type = GRAD <= mtype <= RESULT
        if agg_type:
            expect = agg_len
            if flags & ZERO:  # header-only ZERO contribution: INT32 GRAD/ALLREDUCE only (protocol.md 3.2)
                expect = HEADER_LEN if mtype in (GRAD, ALLREDUCE) and dtype == INT32 else -1
        elif mtype == PARAM:
            item = _ITEM[dtype]
            expect = HEADER_LEN + count * item if item > 0 else -1
        elif mtype == HEARTBEAT:
            expect = HEADER_LEN
        elif mtype == PULL:
            expect = HEADER_LEN + _PULL_ITEM * count
        else:
            expect = -1
        if not drop and (lengths[k] != expect or (agg_type and count > lanes)):
            drop = D_MALFORMED
        s_hit = session < MAX_SESSIONS and bool(s_valid[session])
        if not drop and not s_hit:
            drop = D_UNKNOWN_SESSION
        if not drop and counters is not None:
            counters.session_packets[session, 0] += 1
            counters.session_packets[session, 1] += nbytes_l[k]
        from_node = worker == NODE
        w_hit, w_row = _pair_row(t.workers, session, worker)
        passing = mtype == GRAD and bool(flags & FALLBACK)
        if not drop and not from_node and not w_hit:
            if not passing:
                drop = D_UNKNOWN_WORKER
            elif not _pair_row(t.child_ports, session, in_ports[k])[0]:  # passes only from a child switch's port
                drop = D_SPOOFED
        bit = int(wparams["worker_bit"][w_row]) if wparams is not None else 0
        wport = int(wparams["port"][w_row]) if wparams is not None else 0
        sid = session if s_hit else 0
        spoofed = (int(s["up_port"][sid]) != in_ports[k]) if from_node else (w_hit and wport != in_ports[k])
        if not drop and spoofed:
            drop = D_SPOOFED
        path = 0
        if not drop:
            contributes = mtype in (GRAD, ALLREDUCE)
            if ((contributes and from_node) or mtype == AGG or (mtype in (PARAM, RESULT) and not from_node)
                    or (mtype == RESULT and int(s["next_step"][sid]) != UPSTREAM) or (mtype == PULL and from_node)):
                drop = D_BAD_DIRECTION
            elif contributes:
                in_pool = ((slot - int(s["pool_base"][sid])) & 0xFFFFFFFF) < int(s["pool_size"][sid])
                fallback = bool(flags & FALLBACK)
                if mtype == GRAD:
                    path = PATH_FALLBACK if (not in_pool or fallback) else PATH_AGGREGATE
                elif in_pool:
                    path = PATH_AGGREGATE
                else:
                    drop = D_FOREIGN_SLOT
            elif mtype == HEARTBEAT:
                path = PATH_MULTICAST if from_node else PATH_HEARTBEAT
            elif mtype in (PARAM, RESULT):
                path = PATH_MULTICAST
            elif mtype == PULL:
                path = PATH_PULL
        drops.append(drop)
        paths.append(path)
        sids.append(sid)
        bits.append(bit)
        wports.append(wport)
    sid_a = np.array(sids, dtype=np.int64)
    c.bit = np.array(bits, dtype=np.int64)
    c.worker_port = np.array(wports, dtype=np.int64)
    take_session_fields(c, s, sid_a)
    c.path = np.array(paths, dtype=np.int64)
    c.types = np.array(types, dtype=np.int64)
    b.drop[idx] = np.array(drops, dtype=np.int64) if n_pk else 0
    return c
