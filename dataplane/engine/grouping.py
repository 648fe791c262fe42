"""How the engine splits a received batch that mixes sessions or packet types (a PARAM and a
HEARTBEAT, an AGG and a PULL) into one group per (session, type), in (session, type) order.

`groups_reference` is the vectorised reference; `groups_scalar` does the same on the Python ints
of the headers' first words, for the small batches the engine mostly gets (a dozen numpy calls
and `np.unique` cost ~14 us for three packets, the loop ~3 us); tests/engine/test_scalar_paths.py
checks both give the same groups and the same count of bad packets.
"""

from __future__ import annotations

import numpy as np

from ..protocol import HEADER_LEN, VERSION

SCALAR_BATCH = 16  # batches of up to this many packets are grouped by `groups_scalar`
_WORD = np.dtype(">u4")  # a header's first word: ver_type, flags, session (big-endian)

Groups = list[tuple[int, int, np.ndarray]]  # (session, message type, packet indices), in that order


def groups_reference(h: np.ndarray, lens: np.ndarray) -> tuple[Groups, int]:
    """The (session, type, indices) groups of a batch's good packets (`h`: their DATA_HEADER
    records, `lens`: their lengths), and how many were bad (another version, or shorter than a header)."""
    vt = h["ver_type"].astype(np.int64)
    ok = ((vt >> 4) == VERSION) & (lens >= HEADER_LEN)
    key = (h["session"].astype(np.int64) << 4) | (vt & 0xF)
    key[~ok] = -1
    out = [(int(kv) >> 4, int(kv) & 0xF, np.flatnonzero(key == kv)) for kv in np.unique(key[ok])]
    return out, int((~ok).sum())


def groups_scalar(hb: np.ndarray, lens: np.ndarray) -> tuple[Groups, int]:
    """`groups_reference` from the (k, 32) uint8 headers `hb`, a packet at a time in Python."""
    groups: dict[int, list[int]] = {}
    bad = 0
    words = hb[:, :4].copy().view(_WORD)[:, 0].tolist()
    for i, (w, n) in enumerate(zip(words, lens.tolist())):
        if w >> 28 != VERSION or n < HEADER_LEN:
            bad += 1
            continue
        key = ((w & 0xFFFF) << 4) | ((w >> 24) & 0xF)
        at = groups.get(key)
        if at is None:
            groups[key] = [i]
        else:
            at.append(i)
    return [(kv >> 4, kv & 0xF, np.array(groups[kv], dtype=np.int64)) for kv in sorted(groups)], bad
