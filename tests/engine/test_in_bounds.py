"""packets.in_bounds, the one bounds check of received data packets (a worker's RESULTs, a node's
AGGs): what it keeps and drops, the `dropped.out_of_bounds` count, and a per-packet model.
End to end (a sealed corrupted offset through the switch): tests/engine/test_header_check.py."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.dataplane.engine.packets import in_bounds
from luwu.dataplane.protocol import DATA_HEADER, Dtype

F16, F32 = int(Dtype.FIXED16), int(Dtype.FIXED32)


def headers(*packets: tuple[int, int, int, int, int]) -> np.ndarray:
    """(tensor, offset, count, numel, dtype) per packet, as gathered headers."""
    h = np.zeros(len(packets), dtype=DATA_HEADER)
    for i, (tensor, offset, count, numel, dtype) in enumerate(packets):
        h[i]["tensor"], h[i]["offset"], h[i]["count"], h[i]["numel"], h[i]["dtype"] = tensor, offset, count, numel, dtype
    return h


def test_drops_and_counts_what_names_no_chunk():
    # tensor 7: 10 elements, 4 per packet, FIXED32; tensor 8 is unknown (left to the caller)
    def chunk_of(t, hs, mine):
        return (4, 10, False) if t == 7 else None

    h = headers(
        (7, 0, 4, 10, F32),  # kept
        (7, 8, 2, 10, F32),  # kept: the short last chunk
        (7, 2, 4, 10, F32),  # offset not a whole chunk
        (7, 12, 4, 10, F32),  # offset past numel
        (7, 4, 5, 10, F32),  # count over a packet
        (7, 4, 4, 11, F32),  # numel not the tensor's
        (7, 4, 4, 10, F16),  # the wrong format
        (8, 0x7FFFFF00, 9, 3, F16),  # unknown tensor: kept
        (7, 4, 4, 10, F32),  # kept
    )
    stats = {"dropped.out_of_bounds": 1}
    idx = np.arange(len(h))
    assert in_bounds(idx, h, stats, chunk_of).tolist() == [0, 1, 7, 8]
    assert stats["dropped.out_of_bounds"] == 1 + 5
    # idx picks rows of h; a batch that all passes is returned as it came, and counts nothing
    sub = np.array([0, 1, 8])
    assert in_bounds(sub, h, stats, chunk_of) is sub
    assert stats["dropped.out_of_bounds"] == 6


def test_either_format_when_the_receiver_says_none():
    h = headers((3, 0, 4, 8, F16), (3, 4, 4, 8, F32))
    stats: dict = {}
    assert in_bounds(np.arange(2), h, stats, lambda t, hs, mine: (4, 8, None)).tolist() == [0, 1]
    assert stats == {}


def test_chunk_of_sees_each_tensor_once_with_its_mask():
    h = headers((1, 0, 4, 8, F32), (2, 0, 4, 8, F32), (1, 4, 4, 8, F32))
    seen = []

    def chunk_of(t, hs, mine):
        seen.append((t, mine.tolist(), hs["offset"][mine].tolist()))
        return 4, 8, False

    assert in_bounds(np.arange(3), h, {}, chunk_of).tolist() == [0, 1, 2]
    assert seen == [(1, [True, False, True], [0, 4]), (2, [False, True, False], [0])]


@settings(max_examples=300, deadline=None)
# small ranges, so that every check decides some packets (a packet is often a real chunk)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12), st.integers(0, 5), st.sampled_from([0, 7, 8]),
                          st.sampled_from([F16, F32])), min_size=1, max_size=12),
       st.dictionaries(st.integers(0, 2), st.tuples(st.sampled_from([2, 3, 4]), st.sampled_from([0, 7, 8]),
                                                    st.sampled_from([True, False, None]))))
def test_matches_a_per_packet_model(packets, known):
    h = headers(*packets)
    stats: dict = {}
    got = in_bounds(np.arange(len(h)), h, stats, lambda t, hs, mine: known.get(t)).tolist()
    want = []
    for i, (tensor, offset, count, numel, dtype) in enumerate(packets):
        if tensor not in known:
            want.append(i)
            continue
        per, n, f16 = known[tensor]
        # the collective's former form: a whole chunk whose index is below the op's chunk count
        chunks = -(-n // per)
        if (offset % per == 0 and offset // per < chunks and count <= per and numel == n
                and (f16 is None or (dtype == F16) == f16)):
            want.append(i)
    assert got == want
    assert stats.get("dropped.out_of_bounds", 0) == len(packets) - len(want)
