"""Sparse COO allreduce on the luwu backend (worker/backend/sparse.py) against Gloo's on the same ranks:
the same coalesced sum, bit for bit; mismatched tensors and unsupported ops raise on every rank."""

from __future__ import annotations

import torch
from backend_harness import run_ranks


def _sparse(rank: int, world: int, dtype) -> torch.Tensor:
    # overlapping entries (every rank has row 0), one rank with none at all, two dense dims
    n = 0 if rank == world - 1 else rank + 2
    g = torch.Generator().manual_seed(11 + rank)
    idx = torch.stack([torch.arange(n) % 5, torch.randint(0, 3, (n,), generator=g)])
    vals = (torch.randn((n, 2, 3), generator=g) * 10 ** rank).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, (5, 3, 2, 3))


def _sum_both(rank: int, world: int):
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    out = {}
    for dtype in (torch.float32, torch.float64, torch.int64):
        mine, theirs = _sparse(rank, world, dtype), _sparse(rank, world, dtype)
        dist.all_reduce(mine)
        dist.all_reduce(theirs, group=gloo)
        out[str(dtype)] = (mine.to_dense().numpy(), theirs.to_dense().numpy(), mine.is_coalesced())
    errors = []
    bad = torch.sparse_coo_tensor([[0]], [1.0], (4 if rank == 0 else 5,))
    for t, op in ((bad, dist.ReduceOp.SUM), (_sparse(rank, world, torch.float32), dist.ReduceOp.MAX)):
        try:
            dist.all_reduce(t, op=op)
            errors.append(None)
        except (ValueError, RuntimeError, TypeError) as e:
            errors.append(str(e))
    return out, errors


def test_sparse_allreduce_matches_gloo(tmp_path):
    for rank, (out, errors) in enumerate(run_ranks(_sum_both, 3, tmp_path)):
        for dtype, (mine, theirs, coalesced) in out.items():
            assert coalesced, (rank, dtype)
            assert mine.tobytes() == theirs.tobytes(), (rank, dtype)
        assert errors[0] is not None and "differs in shape" in errors[0], (rank, errors)
        assert errors[1] is not None and "SUM only" in errors[1], (rank, errors)
