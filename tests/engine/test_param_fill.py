"""The PARAM packets of one pull as `param_fill` writes them into a send ring: every header
field, the values in wire (big-endian) order, zeros past a last partial packet, the lengths;
whole pulls and blocks of a pull (a send stream asks for rows [i0, i1) at a time)."""

from __future__ import annotations

import numpy as np
import pytest

from luwu.dataplane.engine.packets import param_fill
from luwu.dataplane.integrity import TRAILER_LEN, headers_ok, trailer, trailers_ok
from luwu.dataplane.protocol import HEADER_LEN, NODE, Dtype, MsgType, header_view, ver_type

LANES = 64  # a row carries 4 * LANES payload bytes


@pytest.mark.parametrize("dtype,np_dtype", [(Dtype.BF16, np.uint16), (Dtype.FP32, np.float32)])
@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 5 * 128 + 3])
def test_param_rows_carry_the_pull(dtype, np_dtype, numel):
    epp = (4 * LANES - TRAILER_LEN) // np.dtype(np_dtype).itemsize  # room for the trailer (protocol.md 3.7)
    rng = np.random.default_rng(numel)
    data = rng.integers(0, 1 << 16, numel).astype(np_dtype) if np_dtype == np.uint16 else \
        rng.standard_normal(numel).astype(np_dtype)
    chunks = max(1, -(-numel // epp))
    fill = param_fill(seg_start=0xFFFFFFFE, session=9, pull_id=77, tensor=5, data=data, dtype=dtype,
                      elems_per_packet=epp)
    rows = np.full((chunks, HEADER_LEN + 4 * LANES), 0xAB, dtype=np.uint8)  # garbage the fill must overwrite
    lens = np.zeros(chunks, dtype=np.int64)
    for i0, i1 in ((0, 1), (1, chunks)) if chunks > 1 else ((0, 1),):
        fill(i0, i1, rows[i0:i1], lens[i0:i1])
    h = header_view(rows)
    counts = np.clip(numel - np.arange(chunks) * epp, 0, epp)
    assert (h["ver_type"] == ver_type(MsgType.PARAM)).all() and (h["flags"] == 0).all()
    assert (h["session"] == 9).all() and (h["worker"] == NODE).all() and (h["slot"] == 77).all()
    assert (h["tensor"] == 5).all() and (h["dtype"] == int(dtype)).all() and (h["numel"] == numel).all()
    assert (h["exponent"] == 0).all() and headers_ok(rows).all()
    assert h["count"].tolist() == counts.tolist()
    assert h["seq"].tolist() == [(0xFFFFFFFE + i) & 0xFFFFFFFF for i in range(chunks)]  # wraps
    assert h["offset"].tolist() == [i * epp for i in range(chunks)]
    assert lens.tolist() == (HEADER_LEN + counts * data.itemsize + TRAILER_LEN).tolist()
    assert trailers_ok(rows, np.arange(chunks), lens).all()
    wire = rows[:, HEADER_LEN:].view(np.dtype(np_dtype).newbyteorder(">"))
    for i in range(chunks):
        got = wire[i, :counts[i]].astype(np_dtype)
        assert np.array_equal(got.view(np.uint8), data[i * epp: i * epp + counts[i]].view(np.uint8))
        end = HEADER_LEN + counts[i] * data.itemsize  # the trailer right after the values, then zeros
        assert rows[i, end:end + TRAILER_LEN].tobytes() == trailer(rows[i, HEADER_LEN:end])
        assert not rows[i, end + TRAILER_LEN:HEADER_LEN + epp * data.itemsize].any()  # never stale bytes
