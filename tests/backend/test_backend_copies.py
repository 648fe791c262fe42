"""No per-call copy of a whole tensor between dist.all_reduce and the wire (docs/backend.md "Copies").

A contiguous float32 CPU tensor is reduced in its own storage: the embedded engine quantises from
it and decodes the switch's results straight back into it; the engine daemon stages it once in its
shared buffer and copies the result back once. Neither makes a new array of the tensor's size per
call. numpy reports its allocations to tracemalloc, so the peak of traced memory over a few
steady-state calls stays far below one tensor's bytes (before, each call made a result array
the size of the tensor, and the daemon link a second one: the peak was at least one tensor).
"""

from __future__ import annotations

import pytest
from backend_harness import run_ranks

from luwu.dataplane.kernels import numba_available

NUMEL = 1 << 22  # 16 MiB of float32
CALLS = 4


def _steady_state_peak(rank, world):
    import tracemalloc

    import torch
    import torch.distributed as dist

    t = torch.full((NUMEL,), float(rank + 1))
    ptr = t.data_ptr()
    from luwu.dataplane.kernels import wait_loaded

    for _ in range(3):  # warm: the daemon's shared buffer pool, the compiled kernels
        dist.all_reduce(t)
    # an embedded engine loads its kernels on a thread of this process after the first collective:
    # tracemalloc traces every thread, so the measurement starts once that loading is over
    out: dict = {"loaded": wait_loaded(120)}
    dist.all_reduce(t)
    for op in ("sum", "avg"):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i in range(CALLS):
                t.fill_(float(rank + 1 + i))
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG)
            out[op] = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        last = sum(r + 1 + CALLS - 1 for r in range(world))
        out[f"{op}_value"] = (float(t.min()), float(t.max()), float(last if op == "sum" else last / world))
    out["same_storage"] = t.data_ptr() == ptr
    return out


@pytest.mark.skipif(not numba_available(), reason="the reference (numpy) kernels allocate per packet block; "
                                                  "this counts the compiled path's (pip install numba)")
@pytest.mark.parametrize("engine", ["process", "embedded"])
def test_all_reduce_allocates_no_tensor_sized_array_per_call(tmp_path, engine):
    results = run_ranks(_steady_state_peak, 2, tmp_path, env={"LUWU_ENGINE": engine, "LUWU_KERNELS": "numba"})
    nbytes = NUMEL * 4
    for rank, out in enumerate(results):
        assert out["loaded"], f"rank {rank}: the compiled kernels were still loading after 120 s"
        assert out["same_storage"], f"rank {rank}: the tensor's storage moved"
        for op in ("sum", "avg"):
            lo, hi, want = out[f"{op}_value"]
            assert lo == hi == want, f"rank {rank} {op}: got values {lo}..{hi}, want {want}"
            # the rest is per-operation bookkeeping (exponents, a short last chunk): lanes, not elements
            assert out[op] < nbytes // 8, (f"rank {rank} {op}: {out[op]} bytes allocated at peak over {CALLS} calls "
                                           f"of a {nbytes}-byte tensor (a copy of the tensor per call?)")


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_decode_into_narrows_in_place_bit_for_bit_as_decode(dtype_name):
    """bfloat16/float16 results are narrowed straight into the tensor (codec.decode_into), one copy
    fewer than decoding into a new tensor and copying that: the bits must be decode's, NaN payloads
    and signs, infinities, signed zeros and rounding included, and a non-contiguous tensor takes
    the old path."""
    import numpy as np
    import torch

    from luwu.worker.backend.codec import decode, decode_into, reduction_encoding, write

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(5)
    wide = (rng.standard_normal(4099) * 10.0 ** rng.uniform(-6, 6, 4099)).astype(np.float32)
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 65504.0, 1e-40], np.float32)
    nans = np.array([0x7FC00000, 0xFFC00001, 0x7F801234, 0xFFFFFFFF], np.uint32).view(np.float32)
    wide = np.concatenate([wide, special, nans])
    enc = reduction_encoding(dtype, "sum")
    want = torch.empty(wide.size, dtype=dtype)
    write(want, decode(wide, enc))
    got = torch.full((wide.size,), 7.0, dtype=dtype)
    ptr = got.data_ptr()
    decode_into(got, wide, enc)
    assert got.data_ptr() == ptr
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "decode_into's bits differ from decode's"
    strided = torch.zeros(2 * wide.size, dtype=dtype)[::2]
    decode_into(strided, wide, enc)
    assert torch.equal(strided.contiguous().view(torch.int16), want.view(torch.int16))
