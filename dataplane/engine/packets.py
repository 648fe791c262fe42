"""Vectorised construction of luwu packets: a whole buffer becomes a (packets, bytes) array in
a few numpy operations, ready for `BatchSocket.send_rows`.
"""

from __future__ import annotations

import numpy as np

from ..protocol import (
    DATA_HEADER, HEADER_LEN, HEARTBEAT_HEADER, NODE, PULL_REQUEST, Dtype, Flag, MsgType, header_view,
    slot_for, ver_type,
)


class PacketBatch:
    """Rows of packets with their lengths; row i carries sequence number `first_seq + i`."""

    __slots__ = ("rows", "lengths", "first_seq")

    def __init__(self, rows: np.ndarray, lengths: np.ndarray, first_seq: int):
        self.rows = rows
        self.lengths = lengths
        self.first_seq = first_seq

    def __len__(self) -> int:
        return len(self.rows)

    def mark_retransmitted(self, start: int, stop: int) -> None:
        self.rows[start:stop, 1] |= np.uint8(Flag.RETX)


def aggregation_headers(
    *, msg_type: MsgType, session: int, worker: int, first_seq: int, pool_base: int, pool_size: int,
    lanes: int, tensor: int, numel: int, dtype: Dtype, flags: int = 0, exponents: np.ndarray | None = None,
) -> PacketBatch:
    """GRAD/ALLREDUCE packets for a buffer of `numel` elements, headers filled, lanes zero."""
    chunks = -(-numel // lanes)
    rows = np.zeros((chunks, HEADER_LEN + 4 * lanes), dtype=np.uint8)
    h = header_view(rows)
    seqs = (first_seq + np.arange(chunks, dtype=np.int64)) & 0xFFFFFFFF
    slot, set_ = slot_for(seqs, pool_base, pool_size)
    h["ver_type"] = ver_type(msg_type)
    h["flags"] = (flags | (set_ * int(Flag.SET))).astype(np.uint8)
    h["session"] = session
    h["worker"] = worker
    offsets = np.arange(chunks, dtype=np.int64) * lanes
    h["count"] = np.minimum(lanes, numel - offsets)
    h["seq"] = seqs
    h["slot"] = slot
    h["tensor"] = tensor
    h["offset"] = offsets
    if exponents is not None:
        h["exponent"] = exponents
    h["dtype"] = int(dtype)
    h["numel"] = numel
    return PacketBatch(rows, np.full(chunks, rows.shape[1], dtype=np.int64), first_seq)


def fill_lanes(batch: PacketBatch, start: int, values: np.ndarray, saturated: np.ndarray | None = None) -> None:
    """Write int32 lane values (k * lanes, row-major) into rows [start, start + k)."""
    lanes = (batch.rows.shape[1] - HEADER_LEN) // 4
    k = len(values) // lanes
    batch.rows[start:start + k, HEADER_LEN:].view(">i4")[...] = values.reshape(k, lanes)
    if saturated is not None and saturated.any():
        batch.rows[start:start + k, 1] |= np.where(saturated, np.uint8(Flag.SATURATED), np.uint8(0))


def param_packets(
    payload: np.ndarray, *, session: int, first_seq: int, pull_id: int, tensor: int, dtype: Dtype,
    elems_per_packet: int,
) -> PacketBatch:
    """PARAM packets for a flat array already in its wire dtype (big-endian view of fp32/bf16/fp16 bits)."""
    numel = payload.size
    itemsize = payload.dtype.itemsize
    chunks = max(1, -(-numel // elems_per_packet))
    rows = np.zeros((chunks, HEADER_LEN + itemsize * elems_per_packet), dtype=np.uint8)
    h = header_view(rows)
    offsets = np.arange(chunks, dtype=np.int64) * elems_per_packet
    counts = np.clip(numel - offsets, 0, elems_per_packet)
    h["ver_type"] = ver_type(MsgType.PARAM)
    h["session"] = session
    h["worker"] = NODE
    h["count"] = counts
    h["seq"] = (first_seq + np.arange(chunks, dtype=np.int64)) & 0xFFFFFFFF
    h["slot"] = pull_id
    h["tensor"] = tensor
    h["offset"] = offsets
    h["dtype"] = int(dtype)
    h["numel"] = numel
    body = rows[:, HEADER_LEN:]
    flat = np.zeros(chunks * elems_per_packet, dtype=payload.dtype.newbyteorder(">"))
    flat[:numel] = payload
    body[...] = flat.view(np.uint8).reshape(chunks, -1)
    return PacketBatch(rows, HEADER_LEN + counts * itemsize, first_seq)


def heartbeat(session: int, worker: int, seq: int, ack: int, credit: int) -> np.ndarray:
    row = np.zeros((1, HEADER_LEN), dtype=np.uint8)
    h = header_view(row, HEARTBEAT_HEADER)
    h["ver_type"] = ver_type(MsgType.HEARTBEAT)
    h["session"] = session
    h["worker"] = worker
    h["seq"] = seq & 0xFFFFFFFF
    h["ack"] = ack & 0xFFFFFFFF
    h["credit"] = credit & 0xFFFFFFFF
    return row


def pull_request(session: int, worker: int, requests: list[tuple[int, int, int]]) -> np.ndarray:
    """One PULL packet carrying (pull_id, tensor, version) requests."""
    row = np.zeros((1, HEADER_LEN + PULL_REQUEST.itemsize * len(requests)), dtype=np.uint8)
    h = header_view(row, DATA_HEADER)
    h["ver_type"] = ver_type(MsgType.PULL)
    h["session"] = session
    h["worker"] = worker
    h["count"] = len(requests)
    body = row[0, HEADER_LEN:].view(PULL_REQUEST)
    for i, (pull_id, tensor, version) in enumerate(requests):
        body[i] = (pull_id, tensor, version)
    return row


def payload_int32(rows: np.ndarray, lanes: int) -> np.ndarray:
    """The lanes of aggregation packets (K rows) as a (K, lanes) big-endian int32 view."""
    return rows[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4")
