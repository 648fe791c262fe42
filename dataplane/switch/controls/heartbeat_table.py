"""heartbeat_table: min-aggregation of the workers' heartbeats into one per round (registers
hb_owner, hb_bitmap, hb_ack, hb_credit indexed by session).

A round collects one or more heartbeats from every worker of the session's mask; its ack and
credit are the serial-arithmetic minimum over them, so the node's acknowledgement load does not
grow with the number of workers. An epoch change starts a new round."""

from __future__ import annotations

import numpy as np


def serial_min(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RFC 1982 minimum of uint32 arrays: a if (int32)(a - b) < 0 else b."""
    return np.where((a - b).astype(np.uint32).view(np.int32) < 0, a, b).astype(np.uint32)


def apply(regs, session: np.ndarray, epoch: np.ndarray, bit: np.ndarray, worker_mask: np.ndarray,
          ack: np.ndarray, credit: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sessions unique within a round. Returns (full, ack, credit) of the round after each packet."""
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
