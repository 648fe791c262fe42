"""zero_lanes: a header-only ZERO contribution becomes a packet of `lanes` zero lanes.

A GRAD or ALLREDUCE with the ZERO flag (INT32 only; the classifier checked it is exactly the
32-byte header) stands for a contribution whose lanes are all zero (docs/protocol.md 3.2). Once
the classifier has sent it on (aggregate or fallback), it is rewritten in its own row into the
packet it stands for: lanes zeroed, ZERO cleared, `luwu_len` the full aggregation length. The
slot state machine, the emitted result (a completion or a resend carries the stored lanes) and a
fallback copy toward the node then need nothing of their own, as in the P4 control
(p4/include/zero_lanes.p4), which makes `hdr.lanes` valid with zeros and grows the IPv4/UDP
lengths (the Ethernet deparser here recomputes them from `luwu_len`).

`b.length` stays the received length: ingress counters count the bytes that arrived, as BMv2
counts a packet's ingress length.
"""

from __future__ import annotations

import numpy as np

from ...protocol import DropReason, Flag, aggregation_packet_len
from .classifier import PATH_AGGREGATE, PATH_FALLBACK, PATH_NONE, Classified

ZERO = int(Flag.ZERO)
KEEP = np.uint8(0xFF ^ ZERO)


def apply(b, c: Classified, lanes: int) -> None:
    """Expand the ZERO packets among `c` that go on into full zero-lane packets (rows in place)."""
    if not len(c.idx) or not (c.flags & ZERO).any():
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
    b.luwu_len[rows] = full
    cleared = c.flags[z] & KEEP
    b.hdr["flags"][rows] = cleared
    c.flags[z] = cleared  # c.flags may be a copy of the header column (fallback keeps these flags)
