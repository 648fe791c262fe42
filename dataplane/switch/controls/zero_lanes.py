"""zero_lanes: a header-only ZERO contribution becomes a packet of zero lanes; a short one is padded.

A GRAD or ALLREDUCE with the ZERO flag (INT32 only; the classifier checked it is exactly the
32-byte header) stands for a contribution whose lanes are all zero (docs/protocol.md 3.2). Once
the classifier has sent it on (aggregate or fallback), it is rewritten in its own row into the
packet it stands for: lanes zeroed, ZERO cleared, `luwu_len` the length of an INT32 packet of its
count (docs/protocol.md 3.3). The
slot state machine, the emitted result (a completion or a resend carries the stored lanes) and a
fallback copy toward the node then need nothing of their own, as in the P4 control
(p4/include/zero_lanes.p4), which makes `hdr.lanes` valid with zeros and grows the IPv4/UDP
lengths (the Ethernet deparser here recomputes them from `luwu_len`).

`b.length` stays the received length: ingress counters count the bytes that arrived, as BMv2
counts a packet's ingress length.
"""

from __future__ import annotations

import numpy as np

from ...integrity import wire_len
from ...protocol import HEADER_LEN, DropReason, Dtype, Flag, aggregation_packet_len
from .classifier import PATH_AGGREGATE, PATH_FALLBACK, PATH_NONE, Classified

ZERO = int(Flag.ZERO)
INT32 = int(Dtype.INT32)
KEEP = np.uint8(0xFF ^ ZERO)


def apply(b, c: Classified, lanes: int) -> None:
    """Expand the ZERO packets among `c` that go on into zero-lane packets of the length their
    count gives, and zero the lanes past the end of short contributions (rows in place)."""
    if not len(c.idx):
        return
    _pad_short(b, c, lanes)
    if not (c.flags & ZERO).any():
        return
    go_on = (c.path == PATH_AGGREGATE) | (c.path == PATH_FALLBACK)
    z = np.flatnonzero(go_on & ((c.flags & ZERO) != 0))
    if not len(z):
        return
    rows = c.idx[z]
    full = aggregation_packet_len(lanes)
    width = (b.rows if b.arena is None else b.arena).shape[1]  # a split batch's lanes lie in its arena (batch.py)
    if width < b.off + full:  # a receive buffer narrower than a packet: never a partial sum
        b.drop[rows] = DropReason.MALFORMED
        c.path[z] = PATH_NONE
        return
    b.payload(lanes)[b.payload_rows(rows)] = 0
    if b.luwu_len is b.length:  # datagram batches share the array: keep the received length intact
        b.luwu_len = b.length.copy()
    b.luwu_len[rows] = wire_len(c.h["count"][z].astype(np.int64), INT32, 0, lanes)  # as a packet of zeros
    cleared = c.flags[z] & KEEP
    b.hdr["flags"][rows] = cleared
    c.flags[z] = cleared  # c.flags may be a copy of the header column (fallback keeps these flags)


def _pad_short(b, c: Classified, lanes: int) -> None:
    """Zero the lanes a contribution shorter than the switch's lanes does not carry (docs/protocol.md
    3.3: its row holds whatever the buffer held there), so the slot registers sum zeros past its
    end, as the P4 programs' registers keep those lanes out of the sum and the result; what leaves
    is cut to the packet's own length again (`luwu_len`)."""
    agg = np.flatnonzero(c.path == PATH_AGGREGATE)
    if not len(agg):
        return
    pk = c.idx[agg]
    got = b.luwu_len[pk]
    full = aggregation_packet_len(lanes)  # 4 bytes a lane, every dtype (FIXED16's too: 5.2)
    short = np.flatnonzero((got < full) & (got > HEADER_LEN))
    if not len(short):
        return
    src = b.rows if b.arena is None else b.arena
    prow = b.payload_rows(pk[short])
    for r, n in zip(np.atleast_1d(prow).tolist(), got[short].tolist()):
        src[r, b.off + n:b.off + full] = 0
