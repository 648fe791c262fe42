"""The steps of each collective on the engine (they run on the scheduler's submit thread).

Reductions encode tensors for the engine (codec.py) and decode the result into the outputs.
Exact moves lay every rank's bytes out in one int32 word buffer, each rank filling only its own
segments (zeros elsewhere), and read their segments from the sum. all_to_all first agrees on the
block sizes with a small allreduce of the N x N size matrix, then moves the blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .codec import ByteLayout, Encoding, decode, encode, flat, host_reduce, nbytes, write, write_bytes
from .scheduler import OpContext

__all__ = [
    "allgather",
    "allgather_into",
    "alltoall",
    "barrier",
    "broadcast",
    "flat",
    "gather",
    "reduce_scatter",
    "reduce_tensors",
    "scatter",
    "split_bytes",
]


# -- reductions -------------------------------------------------------------------------------------------
def reduce_tensors(ctx: OpContext, tensors: list[torch.Tensor], encs: list[Encoding], op: str,
                   write_back: bool = True, world: int = 1, rank: int = 0) -> None:
    """Reduce every tensor in place; tensors of one encoding share one engine operation (host
    encodings: one exact gather of every rank's bytes, reduced here in rank order)."""
    groups: dict[Encoding, list[int]] = {}
    for i, enc in enumerate(encs):
        groups.setdefault(enc, []).append(i)
    handles, plans = [], []
    for enc, idx in groups.items():
        if enc.kind == "host":
            layout = ByteLayout([nbytes(tensors[i]) for i in idx for _ in range(world)])
            buf = layout.empty()
            for k, i in enumerate(idx):
                layout.put(buf, k * world + rank, tensors[i])
            handles.append(ctx.allreduce(buf, "sum"))  # an exact move: each rank fills only its segments
            plans.append((enc, idx, layout))
            continue
        parts = [encode(tensors[i], enc) for i in idx]
        x = parts[0] if len(parts) == 1 else np.concatenate(parts)
        handles.append(ctx.allreduce(x, op))
        plans.append((enc, idx, None))

    def assemble(results: list[np.ndarray]) -> None:
        if not write_back:
            return
        for (enc, idx, layout), r in zip(plans, results):
            if layout is not None:
                for k, i in enumerate(idx):
                    t = tensors[i]
                    parts = [_from_bytes(layout.segment(r, k * world + s), t) for s in range(world)]
                    write(t, host_reduce(parts, op))
                continue
            at = 0
            for i in idx:
                n = tensors[i].numel() * enc.words_per_element
                write(tensors[i], decode(r[at: at + n], enc))
                at += n

    ctx.finish(handles, assemble)


def _from_bytes(data: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).view(like.dtype).reshape(-1)


def reduce_scatter(ctx: OpContext, out: torch.Tensor, make_input: Callable[[], torch.Tensor], enc: Encoding,
                   op: str, rank: int, world: int = 1) -> None:
    n = out.numel()
    if enc.kind == "host":  # every rank's whole input, reduced here; this rank keeps its block
        x = flat(make_input())
        layout = ByteLayout([nbytes(x)] * world)
        buf = layout.empty()
        layout.put(buf, rank, x)

        def assemble_host(results: list[np.ndarray]) -> None:
            parts = [_from_bytes(layout.segment(results[0], s), x) for s in range(world)]
            write(out, host_reduce(parts, op)[rank * n: (rank + 1) * n])

        ctx.finish([ctx.allreduce(buf, "sum")], assemble_host)
        return
    h = ctx.allreduce(encode(make_input(), enc), op)
    w = enc.words_per_element

    def assemble(results: list[np.ndarray]) -> None:
        write(out, decode(results[0][rank * n * w: (rank + 1) * n * w], enc))

    ctx.finish([h], assemble)


# -- exact moves --------------------------------------------------------------------------------------------
def _exact(ctx: OpContext, buf: np.ndarray, assemble: Callable[[np.ndarray], None]) -> None:
    h = ctx.allreduce(buf, "sum")
    ctx.finish([h], lambda results: assemble(results[0]))


def broadcast(ctx: OpContext, t: torch.Tensor, root: int, rank: int) -> None:
    layout = ByteLayout([nbytes(t)])
    buf = layout.empty()
    if rank == root:
        layout.put(buf, 0, t)
    _exact(ctx, buf, lambda r: None if rank == root else layout.take(r, 0, t))


def allgather(ctx: OpContext, outs: list[torch.Tensor], t: torch.Tensor, rank: int) -> None:
    layout = ByteLayout([nbytes(o) for o in outs])
    buf = layout.empty()
    layout.put(buf, rank, t)

    def assemble(r: np.ndarray) -> None:
        for i, o in enumerate(outs):
            layout.take(r, i, o)

    _exact(ctx, buf, assemble)


def allgather_into(ctx: OpContext, out: torch.Tensor, t: torch.Tensor, world: int, rank: int) -> None:
    layout = ByteLayout([nbytes(t)] * world)
    buf = layout.empty()
    layout.put(buf, rank, t)
    _exact(ctx, buf, lambda r: write_bytes(out, np.concatenate([layout.segment(r, i) for i in range(world)])))


def gather(ctx: OpContext, outs: list[torch.Tensor], t: torch.Tensor, world: int, rank: int) -> None:
    layout = ByteLayout([nbytes(t)] * world)
    buf = layout.empty()
    layout.put(buf, rank, t)

    def assemble(r: np.ndarray) -> None:
        for i, o in enumerate(outs):  # empty except on the root
            layout.take(r, i, o)

    _exact(ctx, buf, assemble)


def scatter(ctx: OpContext, out: torch.Tensor, ins: list[torch.Tensor], world: int, rank: int) -> None:
    layout = ByteLayout([nbytes(out)] * world)
    buf = layout.empty()
    for i, t in enumerate(ins):  # empty except on the root
        layout.put(buf, i, t)
    _exact(ctx, buf, lambda r: layout.take(r, rank, out))


def barrier(ctx: OpContext) -> None:
    _exact(ctx, np.zeros(1, dtype=np.int32), lambda r: None)


# -- all_to_all -----------------------------------------------------------------------------------------------
def split_bytes(t: torch.Tensor, splits: list[int], world: int, what: str) -> list[tuple[int, int]]:
    """(byte offset, byte count) of each rank's block of t, split along dim 0 (equal blocks if no splits)."""
    total = nbytes(t)
    rows = t.shape[0] if t.dim() else 1
    row_bytes = total // rows if rows else 0
    if not splits:
        if rows % world:
            raise ValueError(f"luwu all_to_all_single: the {what}'s first dimension ({rows}) does not divide by "
                             f"world_size ({world}); pass split sizes")
        splits = [rows // world] * world
    if len(splits) != world or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"luwu all_to_all_single: {what} split sizes {splits} must be {world} non-negative numbers "
                         f"summing to the first dimension ({rows})")
    out, at = [], 0
    for s in splits:
        out.append((at, s * row_bytes))
        at += s * row_bytes
    return out


def alltoall(ctx: OpContext, send: list[Callable[[], np.ndarray]], recv_sizes: list[int],
             deliver: Callable[[list[np.ndarray]], None], world: int, rank: int) -> None:
    """Block (s, d) goes from rank s to rank d; `send[d]()` gives this rank's bytes for d."""
    chunks = [f() for f in send]
    sizes = np.zeros((world, world), dtype=np.int32)
    sizes[rank] = [c.size for c in chunks]
    ctx.then(ctx.allreduce(sizes.reshape(-1), "sum"),
             lambda m: _alltoall_blocks(ctx, m.reshape(world, world), chunks, recv_sizes, deliver, world, rank))


def _alltoall_blocks(ctx: OpContext, matrix: np.ndarray, chunks: list[np.ndarray], recv_sizes: list[int],
                     deliver, world: int, rank: int) -> None:
    layout = ByteLayout([int(v) for v in matrix.reshape(-1)])
    buf = layout.empty()
    for d, c in enumerate(chunks):
        layout.put_bytes(buf, rank * world + d, c)

    def assemble(r: np.ndarray) -> None:
        # checked only now: a rank whose sizes disagree still contributes, so the others do not hang
        for s in range(world):
            if int(matrix[s, rank]) != recv_sizes[s]:
                raise ValueError(f"luwu all_to_all: rank {s} sends {int(matrix[s, rank])} bytes to rank {rank}, "
                                 f"but rank {rank}'s output for it holds {recv_sizes[s]} bytes")
        deliver([layout.segment(r, s * world + rank).copy() for s in range(world)])

    _exact(ctx, buf, assemble)



