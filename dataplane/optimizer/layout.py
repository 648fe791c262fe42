"""Where every number lives: layers split into shards, a shard's record in RAM and on disk.

A shard record is one page-aligned byte range, identical in a RAM buffer, a state file and a
checkpoint file, so that each moves with a single read or write call (O_DIRECT-friendly):

    [header page][fp32 state 0][fp32 state 1]...      <- entry: what a step reads and writes
    [served copy, padded to a page]                    <- state files only (bf16/fp16/fp32)

State 0 is the master weights, then the optimizer's arrays (Adam: exp_avg, exp_avg_sq; SGD with
momentum: momentum_buffer). The header carries the step count, so a record is self-describing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .errors import CheckpointError
from .spec import SERVED_DTYPES, JobSpec, LayerSpec

PAGE = 4096
HEADER_BYTES = PAGE
MAGIC = b"LUWUSHRD"
RECORD_FORMAT = 1
_HEADER = struct.Struct("<8sIIQIIQQQ64s")  # magic, format, n_states, step, layer, shard, elem_lo, numel, stride, job


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def region_stride(nbytes: int) -> int:
    """Distance between a shard's state arrays. Measured on this class of CPU (AMD Zen): when the
    four streams of the Adam kernel are 1-24 KiB apart modulo 64 KiB, it runs up to 1.7x slower,
    so large arrays are spaced to a residue outside that band (at most 24 KiB of padding)."""
    stride = round_up(nbytes, 256)
    if nbytes >= 1 << 16:
        r = stride % (1 << 16)
        if 1024 < r < 24 << 10:
            stride += (24 << 10) - r
    return stride


@dataclass(frozen=True)
class ShardPlan:
    job_id: str
    layer_id: int
    index: int
    elem_lo: int  # first element of the layer this shard holds
    numel: int
    runs: tuple[tuple[int, int, bool], ...]  # (lo, hi, decay) relative to the shard
    n_states: int
    served_itemsize: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job_id, self.layer_id, self.index)

    @property
    def stride(self) -> int:
        return region_stride(self.numel * 4)

    @property
    def entry_bytes(self) -> int:
        return round_up(HEADER_BYTES + self.n_states * self.stride, PAGE)

    @property
    def served_offset(self) -> int:
        return self.entry_bytes

    @property
    def served_bytes(self) -> int:
        return round_up(self.numel * self.served_itemsize, PAGE)

    @property
    def file_bytes(self) -> int:
        return self.served_offset + self.served_bytes

    def state_views(self, buf: np.ndarray) -> list[np.ndarray]:
        """The fp32 arrays inside an entry buffer (no copy)."""
        return [buf[HEADER_BYTES + i * self.stride: HEADER_BYTES + i * self.stride + self.numel * 4].view(np.float32)
                for i in range(self.n_states)]

    def name(self) -> str:
        return f"L{self.layer_id}.S{self.index}"

    # -- header -------------------------------------------------------------------------------
    def write_header(self, buf: np.ndarray, step: int) -> None:
        _HEADER.pack_into(buf.data, 0, MAGIC, RECORD_FORMAT, self.n_states, step, self.layer_id, self.index,
                          self.elem_lo, self.numel, self.stride, self.job_id.encode())

    def read_header(self, buf: np.ndarray, where: str) -> int:
        """Check that `buf` holds this shard's record; return its step count."""
        try:
            magic, fmt, n_states, step, layer, index, lo, numel, stride, job = _HEADER.unpack_from(buf.data, 0)
        except struct.error as e:
            raise CheckpointError(f"{where}: shard header unreadable ({e})") from None
        if magic != MAGIC or fmt != RECORD_FORMAT:
            raise CheckpointError(f"{where}: not a luwu shard record (magic {magic!r}, format {fmt})")
        got = (n_states, layer, index, lo, numel, stride, job.rstrip(b"\0").decode(errors="replace"))
        want = (self.n_states, self.layer_id, self.index, self.elem_lo, self.numel, self.stride, self.job_id)
        if got != want:
            raise CheckpointError(f"{where}: header describes (n_states, layer, shard, offset, numel, stride, job) "
                                  f"{got}, expected {want}")
        return step


@dataclass(frozen=True)
class LayerPlan:
    job_id: str
    spec: LayerSpec
    segments: tuple[tuple[str, int, int, bool], ...]  # (name, lo, hi, decay) in flattening order
    shards: tuple[ShardPlan, ...]
    served_dtype: np.dtype

    @property
    def layer_id(self) -> int:
        return self.spec.layer_id

    @property
    def numel(self) -> int:
        return self.segments[-1][2]

    @property
    def served_buffer_bytes(self) -> int:
        return round_up(self.numel * self.served_dtype.itemsize, PAGE)


def plan_layer(job: JobSpec, layer: LayerSpec, max_shard_elems: int) -> LayerPlan:
    """Shards pack whole tensors; a tensor larger than a shard is cut at multiples of
    `max_shard_elems` from its own start. Each shard's runs are its pieces of named tensors (never
    merged), so that the fused kernels walk every tensor on the same vector grid as torch.optim
    does on the whole tensor, and the results are bit-identical."""
    n_states = len(job.optimizer.state_names)
    served = SERVED_DTYPES[job.served_dtype]
    segments, lo = [], 0
    for name, shape in layer.shapes.items():
        n = int(np.prod(shape))
        segments.append((name, lo, lo + n, name not in layer.no_decay))
        lo += n
    pieces: list[tuple[int, int, bool]] = []  # (lo, hi, decay) in layer elements, at most one shard each
    for _, a, b, decay in segments:
        pieces += [(p, min(b, p + max_shard_elems), decay) for p in range(a, b, max_shard_elems)]
    groups: list[list[tuple[int, int, bool]]] = [[]]
    for piece in pieces:
        cur = groups[-1]
        if cur and piece[1] - cur[0][0] > max_shard_elems:
            groups.append([])
        groups[-1].append(piece)
    shards = []
    for index, group in enumerate(groups):
        s_lo, s_hi = group[0][0], group[-1][1]
        runs = tuple((a - s_lo, b - s_lo, d) for a, b, d in group)
        shards.append(ShardPlan(job.job_id, layer.layer_id, index, s_lo, s_hi - s_lo, runs, n_states, served.itemsize))
    return LayerPlan(job.job_id, layer, tuple(segments), tuple(shards), served)
