"""Mirrors: dataplane/switch/controls/classifier.py `classify` (its checks, in its order, with its
`Classified`, drop reasons and session counters), one packet at a time on Python ints, for turns
of up to `pipeline.SMALL_TURN` packets.

Declines: nothing it is given: `Pipeline.run` (dataplane/switch/pipeline.py) picks it by the turn's
size alone and it classifies every packet, malformed ones included; larger turns take `classify`.

On shared-memory ports most event-loop turns hold one to four packets (heartbeats, PULLs, one
endpoint's GRADs), and the vectorised classifier's sixty-odd numpy calls (1-2 us each, whatever
the batch size) were a third of such a turn's CPU. This twin runs the same checks, in the same
order, on Python ints per packet and returns the same `Classified` (same fields, dtypes and
values, including the table rows the vectorised lookups read for packets that miss), the same
drop reasons in `b.drop` and the same session counters. `pipeline.SMALL_TURN` picks it;
tests/switch/test_switch_small_turns.py checks it equals the vectorised classifier on random
small batches of every type, malformed ones included. A turn whose packets all passed the parser
and none contributes (no path read off a slot) has per-packet arrays that follow from the packets'
header keys alone: they are made once per tables version (`ScalarTables.turns`, read-only, so a
stage that wrote into one would fail loudly instead of changing later turns).
"""

from __future__ import annotations

import numpy as np

from ...integrity import wire_len
from ...protocol import DATA_HEADER, HEADER_LEN, NODE, PULL_REQUEST, TRAILER_LEN, VERSION, aggregation_packet_len
from ..controls.classifier import (
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
    FIXED16,
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
    SESSION_FIELDS,
    TYPE_CODES,
    UPSTREAM,
    ZERO,
    Classified,
    take_session_fields,
)
from ..lookup import SESSION_PARAMS, CompiledTables, ScalarTables

DECIDED = 4096  # classifications kept per tables version (ScalarTables.decided)
TURNS = 1024  # turns' arrays kept per tables version (ScalarTables.turns)

POOL_BASE, POOL_SIZE, NEXT_STEP, UP_PORT = (SESSION_PARAMS.index(f) for f in ("pool_base", "pool_size", "next_step",
                                                                              "up_port"))

_ITEM = _ITEMSIZE.tolist()
_NAMES = DATA_HEADER.names
_SESSION_COLUMN = {name: SESSION_PARAMS.index(name) for name in SESSION_FIELDS}


def _fields(names) -> tuple[int, ...]:
    """Positions of the header fields the classifier reads in a header row (`h.tolist()`)."""
    names = names or ()  # a header batch always has its fields: for the type checker
    return tuple(names.index(f) for f in ("ver_type", "flags", "session", "worker", "count", "slot", "dtype"))


_FIELDS = _fields(_NAMES)
_PULL_ITEM = PULL_REQUEST.itemsize


def classify_small(b, t: CompiledTables, lanes: int, counters) -> Classified:
    """`classifier.classify` for a batch of a few packets (same result, fewer numpy calls)."""
    return classify_rows(b, t, lanes, counters)[0]


def classify_rows(b, t: CompiledTables, lanes: int, counters) -> tuple[Classified, list[tuple]]:
    """`classify_small`, and each classified packet's session row (`ScalarTables.sessions`, the
    zeros row for a miss) for the later small-turn stages (route_few.py)."""
    sc = t.scalar()
    c = Classified()
    c.idx, c.h = idx, h = _alive_headers(b)
    c.flags = h["flags"]  # (a view: zero_lanes rewrites the header's flags through it)
    c.nbytes = nbytes = b.length.copy() if h is b.hdr else b.length[idx]  # (every packet: no gather)
    agg_len = aggregation_packet_len(lanes)
    s = t.s
    types = [0] * TYPE_CODES
    drops, paths, sids, bits, wports, srows = [], [], [], [], [], []
    every = h is b.hdr  # every packet alive (alive_headers): no gathers needed
    in_ports = (b.port if every else b.port[idx]).tolist()
    lengths = (b.luwu_len if every else b.luwu_len[idx]).tolist()
    nbytes_l = nbytes.tolist()
    i_vt, i_fl, i_se, i_wo, i_co, i_sl, i_dt = _FIELDS if h.dtype.names == _NAMES else _fields(h.dtype.names)
    decided = sc.decided
    session_packets = counters.session_packets if counters is not None else None
    keys = []
    for k, row in enumerate(h.tolist()):
        vt, flags, session, worker, count = row[i_vt], row[i_fl], row[i_se], row[i_wo], row[i_co]
        slot, dtype = row[i_sl], row[i_dt]
        # every check but the pool's depends on these fields alone: decided once per tables version
        key = (vt, flags, session, worker, count, dtype, in_ports[k], lengths[k], lanes)
        keys.append(key)
        got = decided.get(key)
        if got is None:
            got = decision(sc, key, agg_len)
        drop, counted, sid, bit, wport, srow, path, pooled = got
        types[vt & 0xF] += 1
        if counted and session_packets is not None:  # passed the session check
            session_packets[session, 0] += 1
            session_packets[session, 1] += nbytes_l[k]
        if pooled:  # a contribution alive so far: its slot decides its path
            path, drop = contribution_path(vt, flags, slot, srow)
        drops.append(drop)
        paths.append(path)
        sids.append(sid)
        bits.append(bit)
        wports.append(wport)
        srows.append(srow)
    # a turn whose packets all passed the parser and none contributes (no path read off a slot)
    # has arrays that depend on the packets' keys alone: made once per tables version, read-only
    memo = every and PATH_AGGREGATE not in paths and PATH_FALLBACK not in paths
    got = sc.turns.get(tuple(keys)) if memo else None
    if got is None:
        got = _turn_arrays(h, s, bits, wports, srows, sids, paths, types)
        if memo and len(sc.turns) < TURNS:
            for a in got:
                a.flags.writeable = False
            sc.turns[tuple(keys)] = got
    c.mtype, c.session, c.worker, c.from_node, c.bit, c.worker_port, c.path, c.types = got[:8]
    for name, a in zip(SESSION_FIELDS, got[8:]):
        setattr(c, name, a)
    if any(drops):  # (the packets classified were alive: their drop is 0 already)
        b.drop[idx] = np.array(drops, dtype=np.int64)
    return c, srows


def contribution_path(vt: int, flags: int, slot: int, srow: tuple) -> tuple[int, int]:
    """(path, drop) of a contribution `decision` left `pooled`: its slot inside its session's pool
    (row `srow`) or not decides it."""
    in_pool = ((slot - srow[POOL_BASE]) & 0xFFFFFFFF) < srow[POOL_SIZE]
    if vt & 0xF == GRAD:
        return (PATH_FALLBACK if (not in_pool or flags & FALLBACK) else PATH_AGGREGATE), 0
    return (PATH_AGGREGATE, 0) if in_pool else (0, D_FOREIGN_SLOT)


# a packet's classification key: (vt, flags, session, worker, count, dtype, in_port, length, lanes)
DecisionKey = tuple[int, int, int, int, int, int, int, int, int]


def decision(sc: ScalarTables, key: DecisionKey, agg_len: int) -> tuple:
    """The classification of a packet of `key` (vt, flags, session, worker, count, dtype, in_port,
    length, lanes): `_decide`'s tuple, kept in `sc.decided` for the next packets of that key."""
    got = sc.decided.get(key)
    if got is None:
        got = _decide(sc, *key, agg_len)
        if len(sc.decided) < DECIDED:  # (keys senders chose: bounded)
            sc.decided[key] = got
    return got


def _alive_headers(b) -> tuple[np.ndarray, np.ndarray]:
    """`classifier.alive_headers` of a few packets (the same positions and headers), decided on
    Python lists instead of three array calls."""
    luwu, drop = b.luwu.tolist(), b.drop.tolist()
    if all(luwu) and not any(drop):
        return np.arange(len(luwu)), b.hdr
    idx = np.array([k for k, (ok, d) in enumerate(zip(luwu, drop)) if ok and not d], dtype=np.int64)
    return idx, b.hdr[idx]


def _turn_arrays(h: np.ndarray, s, bits: list, wports: list, srows: list, sids: list, paths: list,
                 types: list) -> tuple[np.ndarray, ...]:
    """A classified turn's per-packet arrays: (mtype, session, worker, from_node, bit, worker_port,
    path, types, then the session fields in SESSION_FIELDS order)."""
    worker = h["worker"].astype(np.int64)
    out = [h["ver_type"] & 0xF, h["session"].astype(np.int64), worker, worker == NODE,
           np.array(bits, dtype=np.int64), np.array(wports, dtype=np.int64), np.array(paths, dtype=np.int64),
           np.array(types, dtype=np.int64)]
    if srows:  # every session field from the rows at once (as take_session_fields gathers them)
        fields = np.array(srows, dtype=np.int64).T.copy()  # (one contiguous row per field)
        out += [fields[_SESSION_COLUMN[name]] for name in SESSION_FIELDS]
    else:
        c = Classified()
        take_session_fields(c, s, np.array(sids, dtype=np.int64))
        out += [getattr(c, name) for name in SESSION_FIELDS]
    return tuple(out)


def _decide(sc: ScalarTables, vt: int, flags: int, session: int, worker: int, count: int, dtype: int, in_port: int,
            length: int, lanes: int, agg_len: int) -> tuple:
    """One packet's classification from its header fields, port and length, all but the pool check
    (which reads its slot): (drop, counted in its session, sid, bit, worker port, session row, path,
    pooled), `pooled` meaning a contribution still alive whose slot decides (`classify_rows`)."""
    mtype = vt & 0xF
    drop = D_BAD_VERSION if (vt >> 4) != VERSION else 0
    if not drop and not 1 <= mtype <= PULL:
        drop = D_BAD_TYPE
    agg_type = GRAD <= mtype <= RESULT
    if agg_type:
        expect = wire_len(count, dtype, flags, lanes)  # whole chunks for the count (3.3), 4 bytes a lane
        if flags & ZERO:  # header-only ZERO contribution: INT32 GRAD/ALLREDUCE only (protocol.md 3.2)
            expect = HEADER_LEN if mtype in (GRAD, ALLREDUCE) and dtype == INT32 else -1
    elif mtype == PARAM:
        item = _ITEM[dtype]
        expect = HEADER_LEN + count * item + TRAILER_LEN if item > 0 else -1
    elif mtype == HEARTBEAT:
        expect = HEADER_LEN
    elif mtype == PULL:
        expect = HEADER_LEN + _PULL_ITEM * count + TRAILER_LEN
    else:
        expect = -1
    if not drop and (length != expect or (agg_type and count > (2 * lanes if dtype == FIXED16 else lanes))):
        drop = D_MALFORMED
    srow = sc.sessions.get(session)  # (every valid session id is below MAX_SESSIONS)
    s_hit = srow is not None
    if not drop and not s_hit:
        drop = D_UNKNOWN_SESSION
    counted = not drop
    from_node = worker == NODE
    w_hit, w_row = sc.pair_row(session, worker)
    passing = mtype == GRAD and bool(flags & FALLBACK)
    if not drop and not from_node and not w_hit:
        if not passing:
            drop = D_UNKNOWN_WORKER
        elif ((session << 16) | in_port) not in sc.child_keys:  # passes only from a child switch's port
            drop = D_SPOOFED
    has_workers = bool(sc.workers_keys)
    bit = sc.workers_bit[w_row] if has_workers else 0
    wport = sc.workers_port[w_row] if has_workers else 0
    sid = session if s_hit else 0
    if srow is None:
        srow = sc.zeros
    spoofed = (srow[UP_PORT] != in_port) if from_node else (w_hit and wport != in_port)
    if not drop and spoofed:
        drop = D_SPOOFED
    path = 0
    pooled = False
    if not drop:
        contributes = mtype in (GRAD, ALLREDUCE)
        if ((contributes and from_node) or mtype == AGG or (mtype in (PARAM, RESULT) and not from_node)
                or (mtype == RESULT and srow[NEXT_STEP] != UPSTREAM) or (mtype == PULL and from_node)):
            drop = D_BAD_DIRECTION
        elif contributes:
            pooled = True
        elif mtype == HEARTBEAT:
            path = PATH_MULTICAST if from_node else PATH_HEARTBEAT
        elif mtype in (PARAM, RESULT):
            path = PATH_MULTICAST
        elif mtype == PULL:
            path = PATH_PULL
    return drop, counted, sid, bit, wport, srow, path, pooled
