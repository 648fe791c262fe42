"""The steps of each collective on the engine (they run on the scheduler's submit thread).

Reductions encode tensors for the engine (codec.py) and decode the result into the outputs.
Moves whose every byte goes to every rank (broadcast, all_gather, barrier) lay the ranks' bytes out
in one int32 word buffer, each rank filling only its own segments (zeros elsewhere), and read them
from the switch's sum, which it multicasts. Moves whose blocks each have one receiver (gather,
scatter, all_to_all) go point to point over TCP (direct.py), each byte once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .codec import (
    ByteLayout,
    Encoding,
    decode_into,
    encode,
    flat,
    host_reduce,
    nbytes,
    tensor_bytes,
    write,
    write_bytes,
)
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
    handles = []
    plans: list[tuple[Encoding, list[int], ByteLayout | None]] = []  # layout: a host encoding's byte segments
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
        # in place: x is the tensor's own storage (a contiguous float32/int32 tensor) or this call's
        # own encoding of it; the result lands there with no new array (assemble skips the copy into
        # the tensor when it is its storage). Not for MAX/MIN of floats, whose NaN elements the
        # exact path recomputes from x (fallback.py), nor for a reduce's non-root ranks (write_back)
        in_place = write_back and (enc.kind == "int" or (enc.kind == "float" and op in ("sum", "avg")))
        handles.append(ctx.allreduce(x, op, out=x if in_place else None))
        plans.append((enc, idx, None))

    def assemble(results: list[np.ndarray]) -> None:
        if not write_back:
            return
        for (enc, idx, layout), r in zip(plans, results):
            if layout is not None:
                for k, i in enumerate(idx):
                    t = tensors[i]
                    parts = [_from_bytes(layout.segment(r, k * world + s), t) for s in range(world)]
                    write(t, host_reduce(parts, op, _kind(ctx)))
                continue
            at = 0
            for i in idx:
                n = tensors[i].numel() * enc.words_per_element
                if not _is_storage(r, at, tensors[i]):  # already there when reduced in the tensor's own storage
                    decode_into(tensors[i], r[at: at + n], enc)
                at += n

    ctx.finish(handles, assemble)


def _kind(ctx: OpContext) -> str:
    """The collective's name (fingerprint.KINDS): where Gloo's ring cuts a float MAX/MIN (codec.gloo_ring)."""
    fp = ctx.work.fingerprint
    return fp.kind if fp is not None else "all_reduce"


def _is_storage(r: np.ndarray, at: int, t: torch.Tensor) -> bool:
    """Whether r[at:] is t's own memory (a contiguous CPU tensor reduced in place) with t's dtype."""
    if not t.is_contiguous() or t.device.type != "cpu" or r.dtype.itemsize != t.element_size() \
            or r.dtype.kind != ("f" if t.is_floating_point() else "i") or t.numel() == 0:
        return False
    return r.__array_interface__["data"][0] + at * r.dtype.itemsize == t.data_ptr()


def _from_bytes(data: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).view(like.dtype).reshape(-1)


def reduce_scatter(ctx: OpContext, out: torch.Tensor, make_input: Callable[[], torch.Tensor], enc: Encoding,
                   op: str, rank: int, world: int = 1, fresh: bool = False) -> None:
    """`fresh`: make_input() returns a tensor of this call's own (the concatenated input list), which
    the engine may then reduce in place (no result array the size of every rank's blocks)."""
    n = out.numel()
    if enc.kind == "host":  # every rank's whole input, reduced here; this rank keeps its block
        x = flat(make_input())
        layout = ByteLayout([nbytes(x)] * world)
        buf = layout.empty()
        layout.put(buf, rank, x)

        def assemble_host(results: list[np.ndarray]) -> None:
            parts = [_from_bytes(layout.segment(results[0], s), x) for s in range(world)]
            write(out, host_reduce(parts, op, _kind(ctx))[rank * n: (rank + 1) * n])

        ctx.finish([ctx.allreduce(buf, "sum")], assemble_host)
        return
    words = encode(make_input(), enc)
    # in place as reduce_tensors does: the input's own encoding (a widened copy, or a fresh input)
    own = fresh or enc.kind == "limbs" or (enc.kind == "int" and enc.dtype != torch.int32) or \
        (enc.kind == "float" and enc.dtype != torch.float32)
    in_place = own and (enc.kind == "int" or (enc.kind == "float" and op in ("sum", "avg")))
    h = ctx.allreduce(words, op, out=words if in_place else None)
    w = enc.words_per_element

    def assemble(results: list[np.ndarray]) -> None:
        decode_into(out, results[0][rank * n * w: (rank + 1) * n * w], enc)

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


def gather(ctx: OpContext, outs: list[torch.Tensor], t: torch.Tensor, world: int, rank: int, root: int) -> None:
    """Every rank's block straight to the root (direct.py)."""
    if rank != root:
        sent, _ = ctx.direct({root: tensor_bytes(t)}, [])
        ctx.finish(sent, lambda results: None)
        return
    sources = [s for s in range(world) if s != rank]
    _, got = ctx.direct({}, sources)

    def assemble(results: list[np.ndarray]) -> None:
        for s, data in zip(sources, results):
            _check_block(data, outs[s], f"rank {s}'s block for the gather", "the root's output for it")
            write_bytes(outs[s], data)
        write_bytes(outs[rank], tensor_bytes(t))

    ctx.finish([got[s] for s in sources], assemble)


def scatter(ctx: OpContext, out: torch.Tensor, ins: list[torch.Tensor], world: int, rank: int, root: int) -> None:
    """The root's block for each rank straight to it (direct.py)."""
    if rank == root:
        sent, _ = ctx.direct({d: tensor_bytes(ins[d]) for d in range(world) if d != rank}, [])
        ctx.finish(sent, lambda results: write_bytes(out, tensor_bytes(ins[rank])))
        return
    _, got = ctx.direct({}, [root])

    def assemble(results: list[np.ndarray]) -> None:
        _check_block(results[0], out, f"the root's block for rank {rank}", "this rank's output")
        write_bytes(out, results[0])

    ctx.finish([got[root]], assemble)


def _check_block(data: np.ndarray, out: torch.Tensor, what: str, holder: str) -> None:
    if data.size != nbytes(out):
        raise ValueError(f"luwu: {what} has {data.size} bytes, but {holder} holds {nbytes(out)} "
                         f"({tuple(out.shape)} x {out.dtype})")


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
    """Block (s, d) goes from rank s straight to rank d (direct.py); `send[d]()` gives this rank's
    bytes for d, `recv_sizes[s]` what this rank expects from s (uneven sizes are fine)."""
    peers = [p for p in range(world) if p != rank]
    own = send[rank]()
    sent, got = ctx.direct({d: send[d]() for d in peers}, peers)

    def assemble(results: list[np.ndarray]) -> None:
        chunks = dict(zip(peers, results[len(sent):]))
        chunks[rank] = own
        for s in range(world):
            # checked here: a rank whose sizes disagree has still sent its blocks, so no one hangs
            if chunks[s].size != recv_sizes[s]:
                raise ValueError(f"luwu all_to_all: rank {s} sends {chunks[s].size} bytes to rank {rank}, "
                                 f"but rank {rank}'s output for it holds {recv_sizes[s]} bytes")
        deliver([np.asarray(chunks[s]) for s in range(world)])

    ctx.finish(sent + [got[p] for p in peers], assemble)
