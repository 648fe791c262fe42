"""classifier (the receiver): validate luwu packets and look up `sessions` and `workers`.

Checks, in this order, each failure dropping the packet with its reason: version
(BAD_VERSION), type (BAD_TYPE), length for the type (MALFORMED: aggregation packets are exactly
32 + 4 * the whole chunks of lanes their count needs (4-byte lanes for every dtype, a FIXED16
count being int16 values two a lane: integrity.wire_len, docs/protocol.md 3.3, 5.2) with
count <= lanes (FIXED16: 2 * lanes), or 32 bytes with the ZERO flag for an INT32 GRAD or ALLREDUCE; PARAM 32 + count * itemsize(dtype) + 4; PULL 32 + 12 * count + 4, the 4 being the CRC-32 trailer; HEARTBEAT 32), `sessions` hit (UNKNOWN_SESSION), `workers` hit for every packet whose
worker is not NODE (UNKNOWN_WORKER; a GRAD marked FALLBACK passes through, from a `child_ports`
port only), the sender's port (SPOOFED: a rank off its entry's port, NODE off the session's
up_port, a passing GRAD off a child switch's port), then direction (BAD_DIRECTION) and pool
(FOREIGN_SLOT).
Each surviving packet gets a path: aggregate, fallback, heartbeat round, multicast or pull.

Hot code: constants are plain ints (numpy arithmetic with enum members is several times
slower), and per-type work runs only for the types present in the batch.
"""

from __future__ import annotations

import numpy as np

from ...integrity import wire_len
from ...protocol import (
    DTYPE_ITEMSIZE,
    HEADER_LEN,
    NODE,
    PULL_REQUEST,
    TRAILER_LEN,
    VERSION,
    DropReason,
    Dtype,
    Flag,
    MsgType,
    NextStep,
)
from ..lookup import CompiledTables

PATH_NONE = 0  # dropped
PATH_AGGREGATE = 1  # GRAD/ALLREDUCE inside the pool: slot state machine
PATH_FALLBACK = 2  # GRAD outside the pool or already FALLBACK: toward the node unaggregated
PATH_HEARTBEAT = 3  # a worker's HEARTBEAT: heartbeat round
PATH_MULTICAST = 4  # PARAM or HEARTBEAT from the node, RESULT from the parent
PATH_PULL = 5  # PULL: unicast toward the node

GRAD, AGG, ALLREDUCE, RESULT = int(MsgType.GRAD), int(MsgType.AGG), int(MsgType.ALLREDUCE), int(MsgType.RESULT)
PARAM, HEARTBEAT, PULL = int(MsgType.PARAM), int(MsgType.HEARTBEAT), int(MsgType.PULL)
TYPE_CODES = 16
FALLBACK = int(Flag.FALLBACK)
ZERO = int(Flag.ZERO)
INT32 = int(Dtype.INT32)
FIXED16 = int(Dtype.FIXED16)
UPSTREAM = int(NextStep.UPSTREAM)
D_BAD_VERSION, D_BAD_TYPE, D_MALFORMED = int(DropReason.BAD_VERSION), int(DropReason.BAD_TYPE), int(DropReason.MALFORMED)
D_UNKNOWN_SESSION, D_UNKNOWN_WORKER = int(DropReason.UNKNOWN_SESSION), int(DropReason.UNKNOWN_WORKER)
D_BAD_DIRECTION, D_FOREIGN_SLOT = int(DropReason.BAD_DIRECTION), int(DropReason.FOREIGN_SLOT)
D_SPOOFED = int(DropReason.SPOOFED)

_ITEMSIZE = np.zeros(256, dtype=np.int64)  # 0 = unknown dtype
for _d, _size in DTYPE_ITEMSIZE.items():
    _ITEMSIZE[int(_d)] = _size
_VALID_TYPE = np.zeros(TYPE_CODES, dtype=bool)
_VALID_TYPE[[int(t) for t in MsgType]] = True


class Classified:
    """Per-packet fields of the luwu packets that reached the classifier (`idx` into the batch)."""

    __slots__ = (
        "bit",
        "epoch",
        "flags",
        "from_node",
        "h",
        "idx",
        "mcast_grp",
        "mtype",
        "nbytes",
        "next_step",
        "num_workers",
        "path",
        "pool_base",
        "session",
        "types",
        "up_port",
        "up_worker",
        "worker",
        "worker_mask",
        "worker_port",
    )
    # every field is one entry per classified packet (`types`: packets per type code)
    bit: np.ndarray
    epoch: np.ndarray
    flags: np.ndarray
    from_node: np.ndarray
    h: np.ndarray
    idx: np.ndarray
    mcast_grp: np.ndarray
    mtype: np.ndarray
    nbytes: np.ndarray
    next_step: np.ndarray
    num_workers: np.ndarray
    path: np.ndarray
    pool_base: np.ndarray
    session: np.ndarray
    types: np.ndarray
    up_port: np.ndarray
    up_worker: np.ndarray
    worker: np.ndarray
    worker_mask: np.ndarray
    worker_port: np.ndarray


SESSION_FIELDS = ("pool_base", "num_workers", "worker_mask", "epoch", "mcast_grp", "next_step", "up_port", "up_worker")


def take_session_fields(c: Classified, s: dict[str, np.ndarray], sid: np.ndarray) -> None:
    """Each packet's session parameters (the session table `s` at rows `sid`) onto `c`."""
    for field in SESSION_FIELDS:
        setattr(c, field, s[field][sid])


def alive_headers(b) -> tuple[np.ndarray, np.ndarray]:
    """The positions and headers of the batch's luwu packets that no earlier control dropped."""
    alive = b.luwu & (b.drop == 0)
    if alive.all():
        return np.arange(len(b)), b.hdr
    idx = np.flatnonzero(alive)
    return idx, b.hdr[idx]


def classify(b, t: CompiledTables, lanes: int, counters) -> Classified:
    c = Classified()
    c.idx, c.h = idx, h = alive_headers(b)
    n_pk = len(idx)
    vt = h["ver_type"]
    c.mtype = mtype = vt & 0xF
    c.flags = h["flags"]
    n = b.luwu_len[idx]
    c.nbytes = b.length[idx]
    types = np.bincount(mtype, minlength=TYPE_CODES)
    drop = np.where((vt >> 4) != VERSION, D_BAD_VERSION, 0)
    if types[0] or types[PULL + 1:].any():
        drop[(drop == 0) & ~_VALID_TYPE[mtype]] = D_BAD_TYPE

    # length for the type (count <= lanes for aggregation types; FIXED16: <= 2 * lanes, its int16 values)
    count = h["count"]
    n_agg = types[GRAD:RESULT + 1].sum()
    zero = (c.flags & ZERO) != 0 if n_agg else None
    if zero is not None and not zero.any():
        zero = None
    f16 = (h["dtype"] == FIXED16) if n_agg else None
    if f16 is not None and not f16.any():
        f16 = None
    if n_agg == n_pk and zero is None and f16 is None:  # one value a lane: the length is the count's alone
        bad_len = (n != wire_len(count.astype(np.int64), INT32, 0, lanes)) | (count > lanes)
    else:
        expect = np.full(n_pk, -1, dtype=np.int64)
        agg_type = (mtype >= GRAD) & (mtype <= RESULT)
        if n_agg:  # whole chunks for the count (docs/protocol.md 3.3); FIXED16: two values a lane (5.2)
            expect[agg_type] = wire_len(count[agg_type].astype(np.int64), h["dtype"][agg_type], c.flags[agg_type],
                                        lanes)
        if zero is not None:
            # header-only ZERO contribution: GRAD/ALLREDUCE with an exact (INT32) sum only
            # (docs/protocol.md 3.2); any other ZERO packet has no valid length
            zero &= agg_type
            ok_zero = zero & ((mtype == GRAD) | (mtype == ALLREDUCE)) & (h["dtype"] == INT32)
            expect[zero] = np.where(ok_zero[zero], HEADER_LEN, -1)
        if types[PARAM]:
            is_param = mtype == PARAM
            item = _ITEMSIZE[h["dtype"][is_param]]
            expect[is_param] = np.where(item > 0, HEADER_LEN + count[is_param].astype(np.int64) * item + TRAILER_LEN,
                                        -1)
        if types[HEARTBEAT]:
            expect[mtype == HEARTBEAT] = HEADER_LEN
        if types[PULL]:
            is_pull = mtype == PULL
            expect[is_pull] = HEADER_LEN + PULL_REQUEST.itemsize * count[is_pull].astype(np.int64) + TRAILER_LEN
        most = lanes if f16 is None else np.where(f16, 2 * lanes, lanes)  # FIXED16: two values a lane
        bad_len = (n != expect) | (agg_type & (count > most))
    drop[(drop == 0) & bad_len] = D_MALFORMED

    c.session = session = h["session"].astype(np.int64)
    s_hit = t.session_hit(session)
    drop[(drop == 0) & ~s_hit] = D_UNKNOWN_SESSION
    if counters is not None:
        ok = drop == 0
        counters.session(session[ok], c.nbytes[ok])

    c.worker = worker = h["worker"].astype(np.int64)
    c.from_node = from_node = worker == NODE
    w_hit, w_row = t.workers.find(session, worker)
    # a GRAD already marked FALLBACK was aggregated nowhere on its way: its worker is a rank of a
    # switch below, not of this one, and it only passes through toward the node (protocol.md 6.3)
    passing = (mtype == GRAD) & ((c.flags & FALLBACK) != 0)
    drop[(drop == 0) & ~from_node & ~w_hit & ~passing] = D_UNKNOWN_WORKER
    # ... but only from a port of one of the session's child switches (`child_ports`): a rank's own
    # port never carries another switch's traffic (protocol.md 6.8)
    through = (drop == 0) & ~from_node & ~w_hit & passing
    if through.any():
        below, _ = t.child_ports.find(session, b.port[idx])
        drop[through & ~below] = D_SPOOFED
    if len(t.workers.keys):
        c.bit = t.workers.params["worker_bit"][w_row]
        c.worker_port = t.workers.params["port"][w_row]
    else:
        c.bit = c.worker_port = np.zeros(n_pk, dtype=np.int64)

    sid = np.where(s_hit, session, 0)
    s = t.s
    # source guard: a rank speaks only on the port its `workers` entry binds it to, the node (or
    # the parent switch) only on the session's up_port; anything else is a forgery (SPOOFED)
    in_port = b.port[idx]
    spoofed = np.where(from_node, s["up_port"][sid] != in_port, w_hit & (c.worker_port != in_port))
    drop[(drop == 0) & spoofed] = D_SPOOFED
    take_session_fields(c, s, sid)

    alive = drop == 0
    path = np.zeros(n_pk, dtype=np.int64)
    is_grad = mtype == GRAD
    is_allreduce = mtype == ALLREDUCE
    contributes = is_grad | is_allreduce
    bad_dir = contributes & from_node
    if types[AGG] or types[RESULT] or types[PARAM] or types[PULL]:
        bad_dir |= ((mtype == AGG)
                    | (((mtype == PARAM) | (mtype == RESULT)) & ~from_node)
                    | ((mtype == RESULT) & (c.next_step != UPSTREAM))
                    | ((mtype == PULL) & from_node))
    bad_dir &= alive
    drop[bad_dir] = D_BAD_DIRECTION
    alive &= ~bad_dir
    if n_agg:
        in_pool = ((h["slot"].astype(np.int64) - c.pool_base) & 0xFFFFFFFF) < s["pool_size"][sid]
        fallback = (c.flags & FALLBACK) != 0
        aggregate = alive & contributes & in_pool & ~(is_grad & fallback)
        path[aggregate] = PATH_AGGREGATE
        if types[GRAD]:
            path[alive & is_grad & (~in_pool | fallback)] = PATH_FALLBACK
        if types[ALLREDUCE]:
            foreign = alive & is_allreduce & ~in_pool
            drop[foreign] = D_FOREIGN_SLOT
    if types[HEARTBEAT]:
        hb = alive & (mtype == HEARTBEAT)
        path[hb & ~from_node] = PATH_HEARTBEAT
        path[hb & from_node] = PATH_MULTICAST
    if types[PARAM] or types[RESULT]:
        path[alive & ((mtype == PARAM) | (mtype == RESULT))] = PATH_MULTICAST
    if types[PULL]:
        path[alive & (mtype == PULL)] = PATH_PULL
    c.path = path
    c.types = types
    b.drop[idx] = drop
    return c
