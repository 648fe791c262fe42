"""heartbeat_table: min-aggregation of the workers' heartbeats into one per round (registers
hb_owner, hb_bitmap, hb_ack, hb_credit indexed by session).

A round collects one or more heartbeats from every worker of the session's mask; its ack and
credit are the serial-arithmetic minimum over them, so the node's acknowledgement load does not
grow with the number of workers. An epoch change starts a new round."""

from __future__ import annotations

import numpy as np

M32 = 0xFFFFFFFF


def _serial_min_one(a: int, b: int) -> int:
    """`serial_min` of two uint32 ints."""
    return a if (a - b) & 0x80000000 else b


def _apply_one(regs, s: int, epoch: int, bit: int, mask: int, ack: int, credit: int):
    """`apply` for one packet (its uint32 arithmetic on ints masked to 32 bits)."""
    full, a, c = apply_ints(regs, s, epoch, bit, mask, ack, credit)
    return np.array([full]), np.array([a], dtype=np.uint32), np.array([c], dtype=np.uint32)


def apply_ints(regs, s: int, epoch: int, bit: int, mask: int, ack: int, credit: int) -> tuple[bool, int, int]:
    """One heartbeat of session `s` on Python ints (masked to 32 bits here): (full, ack, credit)
    of its round after it, as `apply` gives for a one-packet round."""
    epoch, bit, mask, ack, credit = epoch & M32, bit & M32, mask & M32, ack & M32, credit & M32
    before = 0 if int(regs.hb_owner[s]) != epoch else int(regs.hb_bitmap[s])
    regs.hb_owner[s] = epoch
    after = before | bit
    full = after == mask
    regs.hb_bitmap[s] = 0 if full else after
    if before == 0:
        a, c = ack, credit
    else:
        a, c = _serial_min_one(int(regs.hb_ack[s]), ack), _serial_min_one(int(regs.hb_credit[s]), credit)
    regs.hb_ack[s] = a
    regs.hb_credit[s] = c
    return full, a, c


def serial_min(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RFC 1982 minimum of uint32 arrays: a if (int32)(a - b) < 0 else b."""
    return np.where((a - b).astype(np.uint32).view(np.int32) < 0, a, b).astype(np.uint32)


def apply(regs, session: np.ndarray, epoch: np.ndarray, bit: np.ndarray, worker_mask: np.ndarray,
          ack: np.ndarray, credit: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sessions unique within a round. Returns (full, ack, credit) of the round after each packet."""
    if len(session) == 1:  # one heartbeat (the usual turn): the same steps on Python ints
        return _apply_one(regs, int(session[0]), int(epoch[0]) & M32, int(bit[0]) & M32, int(worker_mask[0]) & M32,
                          int(ack[0]) & M32, int(credit[0]) & M32)
    epoch = epoch.astype(np.uint32)
    bit = bit.astype(np.uint32)
    ack = ack.astype(np.uint32)
    credit = credit.astype(np.uint32)
    fresh = regs.hb_owner[session] != epoch
    regs.hb_owner[session] = epoch
    before = np.where(fresh, np.uint32(0), regs.hb_bitmap[session])
    after = before | bit
    full = after == worker_mask.astype(np.uint32)
    regs.hb_bitmap[session] = np.where(full, np.uint32(0), after)
    restart = before == 0
    a = np.where(restart, ack, serial_min(regs.hb_ack[session], ack))
    c = np.where(restart, credit, serial_min(regs.hb_credit[session], credit))
    regs.hb_ack[session] = a
    regs.hb_credit[session] = c
    return full, a, c
