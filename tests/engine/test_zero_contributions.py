"""Header-only ZERO contributions (docs/protocol.md 3.2) through the engine and the software
switch: an exact (INT32) chunk whose lanes are all zero leaves a rank as the 32-byte header
alone, so an all_gather-shaped buffer (each rank owns one segment, zeros elsewhere) costs each
rank's upstream about its own bytes instead of the whole buffer, and the result stays
bit-identical -- also under loss, where ZERO rows are retransmitted from the ring."""

from __future__ import annotations

import numpy as np
import pytest

from luwu.dataplane.engine.packets import aggregation_fill, payload_int32, slice_lanes
from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.loopback import local_star as star
from luwu.dataplane.protocol import (
    HEADER_LEN,
    Dtype,
    Flag,
    MsgType,
    aggregation_packet_len,
    header_view,
    lanes_for_mode,
)


def gather_buffers(world: int, per_rank: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Each rank's int32 buffer (its own segment filled, the rest zero) and the gathered whole."""
    rng = np.random.default_rng(seed)
    own = [rng.integers(-(2**31), 2**31, per_rank, dtype=np.int64).astype(np.int32) for _ in range(world)]
    bufs = []
    for r in range(world):
        b = np.zeros(world * per_rank, dtype=np.int32)
        b[r * per_rank:(r + 1) * per_rank] = own[r]
        bufs.append(b)
    return bufs, np.concatenate(own)


def test_all_gather_upstream_is_about_one_world_th_over_udp():
    world, per_rank = 4, (1 << 20) // 4  # 1 MiB of int32 per rank
    bufs, whole = gather_buffers(world, per_rank, seed=13)
    mode = "jumbo"
    with star(world, mode=mode, transport="udp") as (_, sw, engines):
        before = sw.counters()["rx_types"].get(int(MsgType.ALLREDUCE), (0, 0))
        results = [h.wait(120) for h in [e.allreduce(b) for e, b in zip(engines, bufs)]]
        after = sw.counters()["rx_types"].get(int(MsgType.ALLREDUCE), (0, 0))
    for r in results:
        np.testing.assert_array_equal(r, whole)  # every rank gets every byte, bit-identical
    packets, upstream = after[0] - before[0], after[1] - before[1]
    lanes = data_lanes(lanes_for_mode(mode), Dtype.INT32)  # elements per packet (its last lanes: check words)
    chunks = -(-world * per_rank // lanes)
    full = aggregation_packet_len(lanes_for_mode(mode))
    assert packets >= world * chunks  # one packet per chunk per rank (plus any retransmission)
    resent = packets - world * chunks  # a loaded machine may time out; count each as a full packet
    padded = world * chunks * full  # what the ranks sent before ZERO packets
    # each rank sends its own chunks in full (a segment boundary inside a chunk costs one more)
    # and a 32-byte header for each of the others
    own = -(-per_rank // lanes) + 1
    most = world * (own * full + (chunks - own + 1) * HEADER_LEN) + resent * full
    least = world * per_rank * 4
    assert least <= upstream <= most, (upstream, least, most)
    assert upstream - resent * full < padded / world * 1.05, f"upstream {upstream} B is not about 1/{world} of {padded} B"


@pytest.mark.parametrize("transport", ["udp", "shm"])
def test_zero_rows_survive_loss_duplication_and_reordering(transport):
    world, per_rank = 4, 37 * 64 + 5  # tofino mode: many small packets, segment edges inside chunks
    bufs, whole = gather_buffers(world, per_rank, seed=17)
    drop = {"ingress": 0.05, "egress": 0.05, "duplicate": 0.02, "reorder": 0.02}
    with star(world, mode="tofino", drop=drop, seed=5, data_pool=32, transport=transport) as (_, _, engines):
        results = [h.wait(120) for h in [e.allreduce(b) for e, b in zip(engines, bufs)]]
        stats = [e.session_stats() for e in engines]
    for r in results:
        np.testing.assert_array_equal(r, whole)
    resent = sum(s["session 2"]["send_stream"]["retransmitted"] for s in stats)
    assert resent > 0, "nothing was retransmitted: the ZERO rows' resend path went untested"


@pytest.mark.parametrize("dtype", [Dtype.INT32, Dtype.FIXED32, Dtype.ORDERED32])
def test_fill_marks_all_zero_int32_chunks_only(dtype):
    """aggregation_fill: an INT32 chunk with every lane zero is a 32-byte ZERO row; a chunk with
    any non-zero lane (the first or only the last) and every other dtype stay full packets."""
    lanes, chunks = 8, 6
    values = np.zeros(chunks * lanes, dtype=np.int32)
    values[1 * lanes] = 5  # chunk 1: first lane only
    values[3 * lanes + lanes - 1] = -1  # chunk 3: last lane only
    values[5 * lanes:] = np.arange(1, lanes + 1)  # chunk 5: dense
    fill = aggregation_fill(seg_start=0, msg_type=MsgType.ALLREDUCE, session=2, worker=1, pool_base=0, pool_size=8,
                            lanes=lanes, tensor=3, numel=chunks * lanes, dtype=dtype,
                            lanes_of=slice_lanes(values, lanes))
    rows = np.full((chunks, aggregation_packet_len(lanes)), 0xAB, dtype=np.uint8)
    lens = np.zeros(chunks, dtype=np.int64)
    fill(0, chunks, rows, lens)
    h = header_view(rows)
    zero = (h["flags"] & int(Flag.ZERO)) != 0
    want_zero = np.array([True, False, True, False, True, False]) if dtype == Dtype.INT32 else np.zeros(chunks, bool)
    np.testing.assert_array_equal(zero, want_zero)
    np.testing.assert_array_equal(lens, np.where(want_zero, HEADER_LEN, aggregation_packet_len(lanes)))
    full = ~want_zero
    np.testing.assert_array_equal(payload_int32(rows[full], lanes).astype(np.int32),
                                  values.reshape(chunks, lanes)[full])
    assert (h["count"] == lanes).all()  # a ZERO row still says how many lanes it stands for
