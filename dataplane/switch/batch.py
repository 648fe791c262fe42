"""A batch of received packets as the pipeline sees it, and the packets it decides to emit.

Rows are the receive buffer itself (or, for `process_*`, an array built from the caller's
bytes): the pipeline rewrites emitted packets in place, so a UDP port sends a result straight
from the row that triggered it, and a multicast sends that one row to every replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import use_numba
from ..protocol import ETH_IP_UDP_LEN, HEADER_LEN


class Batch:
    """K packets: `rows[i, :length[i]]` arrived on switch port `port[i]`.

    `framed`: rows are Ethernet frames (luwu at offset ETH_IP_UDP_LEN) rather than luwu datagrams.
    `drop[i]`: the drop reason decided so far (0 while the packet is alive); attachments may
    preset it (UNKNOWN_PORT) before the pipeline runs.

    Split batches (shared-memory turns, shm_arena.py): `rows` holds only the headers and packet
    i's bytes lie in row `prow[i]` of `arena` (a datagram at offset 0), where the lane controls
    read and write its payload; `payload()` is then the arena's, indexed by `prow`.

    Deferred results (split batches): `results[i]` >= 0 says packet i completed a phase whose
    sum is still only in lane register `results[i]` of `result_lanes` (fast/aggregate_groups.py `fold` with
    `write_out` False): emission writes it once where the packet leaves from (a multicast pool
    row: `write_results`), or into its own row first (`materialize`, which `whole()` calls)
    wherever the packet's bytes are read from that row.
    """

    __slots__ = ("arena", "drop", "framed", "hb", "hdr", "ipv4", "length", "luwu", "luwu_len", "off", "port",
                 "prow", "result_lanes", "results", "rows")

    def __init__(self, rows: np.ndarray, length: np.ndarray, port: np.ndarray, framed: bool,
                 drop: np.ndarray | None = None):
        self.rows = rows
        self.length = np.asarray(length, dtype=np.int64)
        self.port = np.asarray(port, dtype=np.int64)
        self.framed = framed
        self.drop = np.zeros(len(rows), dtype=np.int64) if drop is None else drop
        self.off = ETH_IP_UDP_LEN if framed else 0
        self.arena: np.ndarray | None = None
        self.prow: np.ndarray | None = None
        self.results: np.ndarray | None = None  # lane register per packet, -1: its row is complete
        self.result_lanes: np.ndarray | None = None
        # filled by the parser
        self.luwu = self.ipv4 = self.luwu_len = self.hdr = self.hb = None

    def __len__(self) -> int:
        return len(self.rows)

    def payload(self, lanes: int) -> np.ndarray:
        """(K, lanes) big-endian int32 view of every row's lanes (meaningful for aggregation
        packets); of a split batch, the arena's rows (packet i's lanes are row `prow[i]`)."""
        start = self.off + HEADER_LEN
        rows = self.rows if self.arena is None else self.arena
        return rows[:, start:start + 4 * lanes].view(">i4")

    def payload_rows(self, idx):
        """The `payload()` rows of packets `idx`."""
        return idx if self.prow is None else self.prow[idx]

    def materialize(self, idx: np.ndarray | None = None) -> None:
        """Write the deferred results of packets `idx` (None: all) into their own rows."""
        if self.results is None or (idx is not None and not len(idx)):
            return
        pkt = np.flatnonzero(self.results >= 0) if idx is None else np.unique(idx[self.results[idx] >= 0])
        if len(pkt):
            write_results(self.result_lanes, self.results[pkt], self.payload(self.result_lanes.shape[1]),
                          self.payload_rows(pkt))
            self.results[pkt] = -1

    def write_back(self, idx: np.ndarray) -> None:
        """Split batch: put the (rewritten) headers of packets `idx` into their arena rows."""
        if self.prow is not None and len(idx):
            self.arena[self.prow[idx], :HEADER_LEN] = self.rows[idx, :HEADER_LEN]

    def whole(self) -> Batch:
        """This batch with every packet's bytes in its own row (a split batch's rows gathered,
        headers as the pipeline left them); a batch that is not split is returned as it is."""
        if self.prow is None:
            return self
        self.materialize()
        rows = self.arena[self.prow]
        rows[:, :HEADER_LEN] = self.rows[:, :HEADER_LEN]
        b = Batch(rows, self.length, self.port, self.framed, self.drop)
        b.luwu, b.ipv4, b.luwu_len = self.luwu, self.ipv4, self.luwu_len
        if self.hdr is not None:
            view = rows[:, b.off:b.off + HEADER_LEN]
            b.hdr, b.hb = view.view(self.hdr.dtype)[:, 0], view.view(self.hb.dtype)[:, 0]
        return b

    @classmethod
    def from_bytes(cls, items: list[tuple[int, bytes]], framed: bool, min_width: int) -> Batch:
        """Copy (port, bytes) pairs into rows at least `min_width` wide (zero padded)."""
        width = max([min_width] + [len(b) for _, b in items])
        width = -(-width // 4) * 4  # rows a whole number of words apart: the lane kernels stride over them
        rows = np.zeros((len(items), width), dtype=np.uint8)
        for i, (_, data) in enumerate(items):
            rows[i, :len(data)] = np.frombuffer(bytes(data), dtype=np.uint8)
        return cls(rows, [len(b) for _, b in items], [p for p, _ in items], framed)


_KERNELS: list = []  # kernels.switch_lanes once imported (it imports numba: only when kernels are on)


def write_results(lanes: np.ndarray, reg: np.ndarray, payload: np.ndarray, rows: np.ndarray,
                  flat: tuple[np.ndarray, int] | None = None) -> None:
    """payload[rows[i]] = lane register reg[i] of `lanes`, big-endian (`payload` a (K, lanes)
    big-endian int32 view: a batch's, or a multicast pool's rows, `flat` its `lane_rows` if the
    caller keeps them): aggregation_lanes' emission of the stored lanes, one write per result.
    Compiled when kernels are on (`put_rows`)."""
    if use_numba():
        if not _KERNELS:  # (an import statement per call costs the import machinery's lookups)
            from ..kernels import switch_lanes

            _KERNELS.append(switch_lanes)
        k = _KERNELS[0]
        flat = flat or k.lane_rows(payload.view(np.uint32))
        if flat is not None:
            k.put_rows(lanes.view(np.uint32), flat[0], flat[1], np.asarray(reg, dtype=np.int64),
                       np.asarray(rows, dtype=np.int64))
            return
    payload[rows] = lanes[reg]


@dataclass
class Emission:
    """Packets to send, in the order the pipeline decided them (the triggering packet's arrival
    order, then replica order): row `pkt[i]` of the batch leaves on `port[i]`.

    `dst[i]` is the endpoints key (replica instance, unicast rank or 0xFFFF); `l3[i]` marks
    L3-forwarded frames (already rewritten, no endpoints lookup)."""

    pkt: np.ndarray
    port: np.ndarray
    dst: np.ndarray
    session: np.ndarray
    l3: np.ndarray

    def __len__(self) -> int:
        return len(self.pkt)

    def select(self, keep: np.ndarray) -> Emission:
        return Emission(self.pkt[keep], self.port[keep], self.dst[keep], self.session[keep], self.l3[keep])

    @classmethod
    def empty(cls) -> Emission:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, np.zeros(0, dtype=bool))
