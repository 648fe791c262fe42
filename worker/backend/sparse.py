"""Sparse (COO) allreduce for the luwu process group, as Gloo does it: no fixed-point sum in the switch
(the ranks' entries do not line up), but an exact exchange of every rank's indices and values, summed on
each host.

Two allgathers cross the switch as exact byte moves (codec.py): first each rank's entry count and
tensor description, then the entries padded to the largest count. Every rank then concatenates the
entries in rank order and coalesces them (torch adds duplicates in the values' dtype, as Gloo does), so
every rank holds the same sum. SUM only (the op Gloo supports for sparse tensors); CPU tensors only.
The call blocks until the sum is written: its two exchanges must be issued back to back on every rank,
in call order with the group's other collectives.
"""

from __future__ import annotations

import zlib

import torch

from .codec import UnsupportedCollective
from .work import LuwuWork

MAX_DIMS = 16  # the tensor description is a fixed-size int64 vector (one allgather of equal sizes)


def _describe(t: torch.Tensor) -> torch.Tensor:
    """What must agree across ranks (the entry count excepted), as int64 words."""
    shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
    dtype_id = zlib.crc32(str(t.dtype).encode())  # stable across processes, unlike hash()
    return torch.tensor([t.sparse_dim(), t.dense_dim(), dtype_id, t.dim(), *shape], dtype=torch.int64)


def sparse_allreduce(pg, t: torch.Tensor, op: str) -> LuwuWork:
    """Sum a sparse COO tensor over the group in place.

    Args:
        pg: the LuwuProcessGroup (its allgather moves the bytes).
        t: a sparse COO tensor on the CPU, of the same shape and dtype on every rank.
        op: the reduction's name; only "sum".

    Returns:
        A completed LuwuWork whose output is `t`, now the coalesced sum.

    Examples:
        >>> x = torch.sparse_coo_tensor([[rank]], [1.0], (world,))
        >>> dist.all_reduce(x)   # x.to_dense() == torch.ones(world) on every rank
    """
    name = f"allreduce(sparse {tuple(t.shape)} x {t.dtype}, {op.upper()})"
    if op != "sum":
        raise UnsupportedCollective(f"luwu {name}: sparse tensors reduce with SUM only")
    if t.device.type != "cpu":
        raise UnsupportedCollective(f"luwu {name}: sparse tensors must be on the CPU, not {t.device}")
    if t.dim() > MAX_DIMS:
        raise UnsupportedCollective(f"luwu {name}: sparse tensors of more than {MAX_DIMS} dimensions")
    world = pg.size()
    c = t.coalesce()
    idx, vals = c.indices().contiguous(), c.values().contiguous()
    mine = torch.cat([torch.tensor([idx.shape[1]], dtype=torch.int64), _describe(t)])
    metas = [torch.empty_like(mine) for _ in range(world)]
    pg.allgather([metas], [mine]).wait()
    for r, m in enumerate(metas):
        if not torch.equal(m[1:], mine[1:]):  # every rank sees every description: all raise together
            raise ValueError(f"luwu {name}: rank {r}'s sparse tensor differs in shape, dtype or sparse/dense "
                             "dimensions (every rank reduces tensors of one shape and dtype)")
    counts = [int(m[0]) for m in metas]
    top = max(counts)
    if top:
        pad_idx = torch.zeros((idx.shape[0], top), dtype=idx.dtype)
        pad_idx[:, : idx.shape[1]] = idx
        pad_vals = torch.zeros((top, *vals.shape[1:]), dtype=vals.dtype)
        pad_vals[: vals.shape[0]] = vals
        all_idx = [torch.empty_like(pad_idx) for _ in range(world)]
        all_vals = [torch.empty_like(pad_vals) for _ in range(world)]
        works = [pg.allgather([all_idx], [pad_idx]), pg.allgather([all_vals], [pad_vals])]
        for w in works:
            w.wait()
        idx = torch.cat([a[:, :n] for a, n in zip(all_idx, counts)], dim=1)
        vals = torch.cat([a[:n] for a, n in zip(all_vals, counts)])
    t.copy_(torch.sparse_coo_tensor(idx, vals, t.shape).coalesce())
    work = LuwuWork(name, [t])
    work._complete()
    return work
