"""Tensors <-> the flat float32/int32 arrays the engine reduces.

Two ways across the switch:
* reductions (allreduce, reduce, reduce_scatter): floats widen to float32 (bf16/fp16 are narrowed
  back afterwards, fixed point with a shared exponent for sums, exact for max/min); int8, uint8,
  int16 and int32 widen to int32 and are exact; int64 sums go as four 16-bit limbs per element
  (N * 0xFFFF per limb cannot overflow int32, the carries are put back afterwards: exact, and
  wrapping like int64).
* exact moves (broadcast, allgather, all_to_all, scatter, gather): a tensor's bytes, viewed as
  int32 words (padded to a multiple of 4 bytes), summed with zeros from the ranks that do not
  own them; integer sums are bit-exact, so any dtype crosses unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

WORD = 4  # bytes per int32 lane
LIMB_BITS = 16
LIMBS = 64 // LIMB_BITS

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SMALL_INTS = {torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}
OPS = ("sum", "avg", "max", "min")


class UnsupportedCollective(TypeError):
    """An op/dtype pair the luwu backend does not reduce; the message lists what it does."""


@dataclass(frozen=True)
class Encoding:
    dtype: torch.dtype
    op: str
    kind: str  # "float", "int", "limbs"

    @property
    def words_per_element(self) -> int:
        return LIMBS if self.kind == "limbs" else 1


# ops the hosts compute exactly from every rank's raw bytes (moved exactly through the switch)
HOST_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")
HOST_DTYPES = (torch.float64, torch.int64, torch.int16, torch.int8, torch.uint8, torch.int32, torch.bool,
               *FLOATS)


def reduction_encoding(dtype: torch.dtype, op: str, collective: str = "allreduce") -> Encoding:
    """How a reduction crosses the network: in the switch ("float": fixed point with a shared
    exponent; "int"; "limbs": int64 SUM as 16-bit limbs), or, for what the switch cannot compute
    exactly (PRODUCT, bitwise ops, float64, int64 MAX/MIN), on the hosts ("host": every rank's
    bytes are gathered exactly through the switch and each rank reduces them in rank order)."""
    if op in OPS and dtype in FLOATS:
        return Encoding(dtype, op, "float")
    if op in OPS and op != "avg" and dtype in SMALL_INTS:
        return Encoding(dtype, op, "int")
    if op == "sum" and dtype == torch.int64:
        return Encoding(dtype, op, "limbs")
    if op not in HOST_OPS:
        raise UnsupportedCollective(f"luwu {collective}: reduce op {op.upper()} is not supported; luwu reduces with "
                                    f"SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR and BXOR")
    floating = dtype.is_floating_point
    if dtype not in HOST_DTYPES or (op == "avg" and not floating) or (op in ("band", "bor", "bxor") and floating):
        raise UnsupportedCollective(
            f"luwu {collective}: {op.upper()} of {dtype} is not supported"
            + ("; AVG is defined for floating types (use SUM and divide)" if op == "avg" else
               "; bitwise ops take integer or bool tensors" if op in ("band", "bor", "bxor") else
               "; luwu reduces float16, bfloat16, float32, float64, int8, uint8, int16, int32, int64 and bool"))
    return Encoding(dtype, op, "host")


GLOO_MAX_SEGMENT = 1 << 20  # bytes: gloo::AllreduceOptions::kMaxSegmentSize, which torch's ProcessGroupGloo keeps


def gloo_owners(numel: int, esize: int, world: int) -> np.ndarray:
    """Which rank's chunk each element is in, in Gloo's ring allreduce (gloo/allreduce.cc `ring`):
    the buffer is cut into numSegments segments (a multiple of world, at least 2 * world, at most
    kMaxSegmentSize bytes each), rank r owning segments r * perRank .. (r + 1) * perRank - 1."""
    total = numel * esize
    max_seg = esize * max(1, GLOO_MAX_SEGMENT // esize)
    segments = max(-(-total // max_seg), 2 * world)
    segments = -(-segments // world) * world
    per_segment = -(-total // segments)  # bytes, rounded up, then up to whole elements
    seg_bytes = -(-per_segment // esize) * esize
    per_rank = segments // world
    return (np.arange(numel, dtype=np.int64) * esize // max(seg_bytes, 1)) // per_rank % world


def gloo_reduce_owners(numel: int, esize: int, world: int) -> np.ndarray:
    """Which rank each element's partial result ends at in Gloo's ring reduce (gloo/reduce.cc),
    whose segments are cut differently from its allreduce's: ceil(total / (2 * world)) bytes (at
    most kMaxSegmentSize, rounded up to whole elements), their count rounded up to a multiple of
    world (at least 2 * world), rank r owning segments r * perRank .. (r + 1) * perRank - 1; the
    root then gathers every rank's chunk. Its chain runs as the allreduce's (`gloo_max_min`)."""
    total = numel * esize
    max_seg = esize * max(1, GLOO_MAX_SEGMENT // esize)
    seg_bytes = -(-max(1, min(-(-total // (2 * world)), max_seg)) // esize) * esize
    segments = max(-(-total // seg_bytes), 2 * world)
    per_rank = -(-segments // world)
    return (np.arange(numel, dtype=np.int64) * esize // seg_bytes) // per_rank % world


def gloo_ring(kind: str, numel: int, esize: int, world: int) -> np.ndarray:
    """Each element's owner rank (`gloo_max_min`'s `owners`) in the ring Gloo runs for collective
    `kind` (fingerprint.KINDS names) over a buffer of `numel` elements laid out as luwu's engine
    buffer of that collective: reduce is Gloo's ring reduce over the whole buffer;
    reduce_scatter (a list of world inputs, laid end to end) is one allreduce per rank's block
    (torch's ProcessGroupGloo reduces each block on its own); all_reduce and
    reduce_scatter_tensor are one allreduce of the whole buffer. Checked against Gloo in
    tests/backend/test_backend_gloo_order.py."""
    if kind == "reduce":
        return gloo_reduce_owners(numel, esize, world)
    if kind == "reduce_scatter" and world > 1 and numel % world == 0:
        return np.tile(gloo_owners(numel // world, esize, world), world)
    return gloo_owners(numel, esize, world)


def gloo_max_min(parts: list[torch.Tensor], op: str, owners: np.ndarray) -> torch.Tensor:
    """MAX/MIN of floats exactly as Gloo's ring allreduce computes them, NaN and signed zeros included.

    Element i's partial result travels the ring from rank owner-1 down to its owner, and each rank
    keeps `std::max(local, received)` = `local < received ? received : local` (MIN: `received <
    local ? received : local`): a comparison with NaN is false, so a rank's own value replaces a NaN
    it receives, and its own NaN is kept; equal values (0.0 and -0.0) keep its own. Checked against
    Gloo in tests/backend/test_backend_integrity.py.

    Args:
        parts: every rank's values (rank order), one flat tensor each, all of one floating dtype.
        op: "max" or "min".
        owners: each element's owner rank (`gloo_owners` of the whole buffer, indexed like parts).

    Returns:
        The reduced values, a new tensor.
    """
    world = len(parts)
    if world == 1:
        return parts[0].clone()
    stacked = torch.stack([p.reshape(-1) for p in parts])
    owner = torch.from_numpy(np.asarray(owners, dtype=np.int64))
    cols = torch.arange(stacked.shape[1])
    acc = stacked[(owner - 1) % world, cols]
    for k in range(2, world + 1):
        local = stacked[(owner - k) % world, cols]
        keep = (local < acc) if op == "max" else (acc < local)
        acc = torch.where(keep, acc, local)
    return acc


def host_reduce(parts: list[torch.Tensor], op: str, kind: str = "all_reduce") -> torch.Tensor:
    """The ranks' contributions (rank order) reduced in rank order, in their own dtype: the same
    result on every rank; for SUM/AVG of floats the rounding of a sequential sum; float MAX/MIN
    as Gloo's collective `kind` computes them (`gloo_max_min`, `gloo_ring`)."""
    if op in ("max", "min") and parts[0].is_floating_point():
        return gloo_max_min(parts, op, gloo_ring(kind, parts[0].numel(), parts[0].element_size(), len(parts)))
    acc = parts[0].clone()
    for p in parts[1:]:
        if op in ("sum", "avg"):
            acc = acc + p if acc.dtype == torch.bool else acc.add_(p)
        elif op == "product":
            acc = acc & p if acc.dtype == torch.bool else acc.mul_(p)
        elif op == "max":
            acc = torch.maximum(acc, p)
        elif op == "min":
            acc = torch.minimum(acc, p)
        elif op == "band":
            acc.bitwise_and_(p)
        elif op == "bor":
            acc.bitwise_or_(p)
        else:
            acc.bitwise_xor_(p)
    if op == "avg":
        acc /= len(parts)
    return acc


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1)


def encode(t: torch.Tensor, enc: Encoding) -> np.ndarray:
    """The engine's input for tensor t: float32 or int32, words_per_element words per element."""
    x = flat(t)
    if enc.kind == "float":
        if x.dtype == torch.float32:
            return x.numpy()
        wide = x.to(torch.float32)
        if x.dtype == torch.float16 and bool(torch.isnan(x).any()):  # a NaN's sign and payload, exactly (decode)
            nan = torch.isnan(x)
            h = x.view(torch.int16)[nan].to(torch.int32)
            wide.view(torch.int32)[nan] = (h & 0x8000) << 16 | 0x7F800000 | (h & 0x3FF) << 13
        return wide.numpy()
    if enc.kind == "int":
        a = x.numpy()
        return a if a.dtype == np.int32 else a.astype(np.int32)
    u = x.numpy().view(np.uint64)
    shifts = np.arange(LIMBS, dtype=np.uint64) * np.uint64(LIMB_BITS)
    return ((u[:, None] >> shifts) & np.uint64(0xFFFF)).astype(np.int32).reshape(-1)


def decode(a: np.ndarray, enc: Encoding) -> torch.Tensor:
    """A flat tensor of enc.dtype from the engine's result `a` (whose dtype is float32 or int32)."""
    if enc.kind == "float":
        out = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
        if enc.dtype == torch.float32:
            return out
        narrow = out.to(enc.dtype)
        _keep_nan_bits(narrow, out)
        return narrow
    if enc.kind == "int":
        return torch.from_numpy(np.asarray(a, dtype=np.int32).astype(SMALL_INTS[enc.dtype]))
    limbs = np.asarray(a, dtype=np.int32).reshape(-1, LIMBS).astype(np.uint64)  # limb sums are >= 0
    shifts = np.arange(LIMBS, dtype=np.uint64) * np.uint64(LIMB_BITS)
    total = np.zeros(limbs.shape[0], dtype=np.uint64)
    for k in range(LIMBS):  # uint64 arithmetic wraps, as int64 sums do
        total += limbs[:, k] << shifts[k]
    return torch.from_numpy(total.view(np.int64))


def _keep_nan_bits(narrow: torch.Tensor, wide: torch.Tensor) -> None:
    """A NaN keeps its bits (sign and payload of the widened value), as Gloo moves it: torch's
    conversions make NaNs 0xFFFF (bfloat16, vectorised) or 0x7FFF (float16, some paths)."""
    nan = torch.isnan(wide)
    if bool(nan.any()):
        bits = wide.view(torch.int32)[nan]
        if narrow.dtype == torch.bfloat16:
            narrow.view(torch.int16)[nan] = (bits >> 16).to(torch.int16)
        else:  # float16: sign, all-ones exponent, the top 10 bits of the mantissa
            narrow.view(torch.int16)[nan] = ((bits >> 16) & -32768 | 0x7C00 | (bits >> 13) & 0x3FF).to(torch.int16)


def decode_into(t: torch.Tensor, a: np.ndarray, enc: Encoding) -> None:
    """`write(t, decode(a, enc))`, with one copy fewer for a contiguous CPU bfloat16/float16 tensor:
    the engine's float32 result is narrowed straight into t's storage (the same conversion, NaN
    bits kept the same way), not into a new tensor first."""
    if enc.kind != "float" or enc.dtype == torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        write(t, decode(a, enc))
        return
    wide = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    with torch.no_grad():
        narrow = t.detach().view(-1)
        narrow.copy_(wide)
        _keep_nan_bits(narrow, wide)


# -- exact moves -----------------------------------------------------------------------------------
def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def words(n: int) -> int:
    return -(-n // WORD)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    x = flat(t)
    if x.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return x.view(torch.uint8).numpy() if x.dtype != torch.uint8 else x.numpy()


class ByteLayout:
    """Segments of byte buffers laid end to end in an int32 word buffer, each starting on a word."""

    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)
        self.offsets = []
        at = 0
        for n in self.sizes:
            self.offsets.append(at)
            at += words(n) * WORD
        self.total_words = at // WORD

    def empty(self) -> np.ndarray:
        return np.zeros(self.total_words, dtype=np.int32)

    def segment(self, buf: np.ndarray, index: int) -> np.ndarray:
        a = self.offsets[index]
        return buf.view(np.uint8)[a: a + self.sizes[index]]

    def put(self, buf: np.ndarray, index: int, t: torch.Tensor) -> None:
        self.put_bytes(buf, index, tensor_bytes(t))

    def put_bytes(self, buf: np.ndarray, index: int, data: np.ndarray) -> None:
        if data.size != self.sizes[index]:
            raise ValueError(f"segment {index} holds {self.sizes[index]} bytes, got {data.size}")
        if data.size:
            self.segment(buf, index)[:] = data

    def take(self, buf: np.ndarray, index: int, t: torch.Tensor) -> None:
        if self.sizes[index]:
            write_bytes(t, self.segment(buf, index))


def write_bytes(t: torch.Tensor, data: np.ndarray) -> None:
    """Copy raw bytes into tensor t (any dtype, any strides)."""
    src = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
    with torch.no_grad():
        t.copy_(src.view(t.dtype).reshape(t.shape))


def write(t: torch.Tensor, values: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(values.reshape(t.shape))
