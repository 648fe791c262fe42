"""Tensors on other devices go through host buffers (worker/backend/staging.py): the collective
runs on host copies, outputs are copied back before the Work completes, inputs are never
written back. On a machine with CUDA the two-rank test runs the real thing against Gloo's CPU
result; here the staging itself is exercised on CPU tensors routed through it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from backend_harness import run_ranks

from luwu.worker.backend.staging import staged
from luwu.worker.backend.work import LuwuWork


class _SlowGroup:
    """A stand-in group: doubles its first argument's tensors on another thread, 50 ms later."""

    def __init__(self):
        self.seen = []

    @staged(outputs=(0,), needs=lambda t: True)  # every tensor staged, as CUDA ones are
    def allgather(self, outputs, inputs):
        self.seen = [t.data_ptr() for t in outputs + inputs]
        work = LuwuWork("double", outputs)

        def later():
            time.sleep(0.05)
            for o, i in zip(outputs, inputs):
                o.copy_(i * 2)
                i.zero_()  # a collective never writes its inputs; the staging must not copy this back
            work._complete()

        threading.Thread(target=later, daemon=True).start()
        return work


def test_outputs_come_back_when_the_work_completes_and_inputs_stay():
    g = _SlowGroup()
    out, inp = [torch.zeros(3)], [torch.tensor([1.0, 2.0, 3.0])]
    work = g.allgather(out, inp)
    assert set(g.seen).isdisjoint({out[0].data_ptr(), inp[0].data_ptr()})  # ran on host copies
    assert out[0].tolist() == [0.0, 0.0, 0.0]  # not before completion
    assert work.wait(timeout=10)
    assert out[0].tolist() == [2.0, 4.0, 6.0]
    assert inp[0].tolist() == [1.0, 2.0, 3.0]
    assert work.get_future().value()[0] is out[0]


def _cuda_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    x = torch.arange(5, dtype=torch.float32, device=dev) + rank
    dist.all_reduce(x)
    g = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(g, torch.full((2,), rank, dtype=torch.int64, device=dev))
    b = torch.full((3,), float(rank), device=dev, dtype=torch.bfloat16)
    dist.broadcast(b, src=1)
    return {"allreduce": x.cpu().tolist(), "all_gather": [t.cpu().tolist() for t in g], "broadcast": b.float().cpu().tolist(),
            "device": str(x.device)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensors_through_the_backend(tmp_path):
    world = 2
    results = run_ranks(_cuda_ranks, world, tmp_path)
    for r in range(world):
        got = results[r]
        assert got["device"].startswith("cuda")
        assert got["allreduce"] == [float(2 * i + 1) for i in range(5)]
        assert got["all_gather"] == [[0, 0], [1, 1]]
        assert got["broadcast"] == [1.0, 1.0, 1.0]
