"""Vectorised construction of luwu packets straight into a send ring.

An operation describes its packets once (`aggregation_fill`, `param_fill`); the send stream
asks it for rows [i0, i1) just before their first transmission, so a large buffer is
quantised and packetised a block at a time, overlapping with sending, with no full-size copy.
Also the one bounds check of received data packets, `in_bounds` (a worker's RESULTs, a node's AGGs).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from .. import fixed16
from ..integrity import _T_MULT as T_MULT
from ..integrity import (
    HEADER_CHECK_TABLE,
    TRAILER_LEN,
    check_lanes,
    check_words_rows,
    header_terms,
    lane_bytes,
    seal_headers,
    sealed,
    trailer,
    wire_lanes,
)
from ..kernels import use_numba
from ..protocol import (
    DATA_HEADER,
    HCHECK_OFFSET,
    HEADER_LEN,
    HEARTBEAT_HEADER,
    NODE,
    PULL_REQUEST,
    ZERO_TYPES,
    Dtype,
    Flag,
    MsgType,
    header_view,
    slot_for,
    ver_type,
)
from ..quantize import (
    as_words,
    contributor_bits,
    fixed_point_kernels,
    quantize,
    quantize16_factors,
    quantize_factors,
    quantize_into_rows,
)

MASK32 = 0xFFFFFFFF
_ALL, _ANY = np.logical_and.reduce, np.logical_or.reduce  # without ndarray.all/any's Python wrappers (per batch)
_MAX8 = np.uint8(Flag.MAX)
_SATURATED8 = np.uint8(Flag.SATURATED)
_FLAGS_AT = DATA_HEADER.fields["flags"][1]  # a header's flags byte
LanesOf = Callable[[int, int], tuple[np.ndarray, np.ndarray | None]]  # chunks [i0, i1) -> (int32 lanes, saturated)


def aggregation_fill(*, seg_start: int, msg_type: MsgType, session: int, worker: int, pool_base: int, pool_size: int,
                     lanes: int, tensor: int, numel: int, dtype: Dtype, lanes_of: LanesOf, flags: int = 0,
                     exponents: np.ndarray | None = None, row_lanes: int | None = None):
    """A fill function for GRAD/ALLREDUCE packets of one buffer (chunk i = seq seg_start + i).

    An exact (INT32) chunk whose lanes are all zero goes as a header-only ZERO packet
    (docs/protocol.md 3.2): the switch adds it as zeros and emits full results, so a rank that
    owns a few segments of a broadcast or all_gather buffer sends little more than its own
    bytes. Its ring row keeps length 32, so a retransmission is header-only too.

    `lanes` is the data elements per packet; with `row_lanes` (the switch's lane count) the
    packet's lanes past them are its check words (docs/protocol.md 3.6), written over the lanes
    as sent (after quantising, saturation and zero rows): `integrity.check_words_rows`."""
    row_len = HEADER_LEN + 4 * (lanes if row_lanes is None else row_lanes)
    zero_ok = dtype == Dtype.INT32 and msg_type in ZERO_TYPES
    # the fields every packet of the buffer shares, written once here; a fill builds its block's
    # headers from this in a contiguous scratch and copies them into the rows once at the end: the
    # rows lie a packet (up to 64 KiB) apart, and each field written there in place was a strided
    # pass costing a cache and TLB miss per row (a third of the fill's CPU besides quantising)
    vt = ver_type(msg_type)
    template = _template(vt, session, worker, 0, tensor, int(dtype), numel)
    shared = (vt, session, worker, tensor, int(dtype), numel, seg_start, pool_base, pool_size, lanes, flags)
    short_whole = row_lanes is not None and wire_lanes(lanes, int(dtype), flags, row_lanes) < row_lanes

    def fill(i0: int, i1: int, rows: np.ndarray, lens: np.ndarray) -> None:
        # a few rows (an exponent row, a small push, a resend): packed one struct call per row
        if i1 - i0 <= SCALAR_HEADER_ROWS:
            hrows = aggregation_headers_scalar(shared, i0, i1, exponents)
        else:
            hrows = aggregation_headers(template, shared, i0, i1, exponents)
        h = header_view(hrows)
        lens[:] = row_len
        checked = False
        if isinstance(lanes_of, QuantizedLanes):  # quantise straight into the rows, one pass
            saturated = lanes_of.write_checked(i0, i1, rows, hrows, int(dtype), seal=True) \
                if row_lanes is not None else None
            checked = saturated is not None  # check words written in the same pass, the headers sealed after it
            if saturated is None:
                saturated = lanes_of.write(i0, i1, rows, HEADER_LEN)
        else:
            values, saturated = lanes_of(i0, i1)
            block = values.reshape(i1 - i0, lanes)
            payload = rows[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4")
            nz = _nonzero_rows(block) if zero_ok else None
            if nz is None or nz.all():
                payload[...] = block
            else:  # all-zero chunks: header-only rows, their lanes neither copied nor sent
                payload[nz] = block[nz]
                h["flags"] |= np.where(nz, np.uint8(0), np.uint8(Flag.ZERO))
                lens[~nz] = HEADER_LEN
        if not checked and saturated is not None and saturated.any():
            h["flags"] |= np.where(saturated, np.uint8(Flag.SATURATED), np.uint8(0))
        if row_lanes is not None:  # the check words, over the lanes as they go (docs/protocol.md 3.6)
            if not checked:
                write_check_words(rows, lanes, h, int(dtype))
            # only a chunk of fewer than `lanes` elements (the buffer's last) can travel short: a
            # whole one's count + 2 check lanes is all `row_lanes` (wire_lanes of a 32-bit dtype)
            if i1 * lanes > numel or short_whole:
                shorten_rows(rows, lens, h["count"], int(dtype), h["flags"], row_lanes)
        if not checked:  # (a checked fill's headers: flagged, sealed and copied by its compiled pass)
            seal_headers(hrows)  # the header check (docs/protocol.md 3.5), over the final headers
            rows[:, :HEADER_LEN] = hrows

    return fill


def fixed16_fill(*, seg_start: int, msg_type: MsgType, session: int, worker: int, pool_base: int, pool_size: int,
                 lanes: int, tensor: int, x: np.ndarray, exps: np.ndarray, n: int,
                 live: Callable[[], bool] | None = None, on_saturated: Callable[[], None] | None = None):
    """A fill function for the FIXED16 GRAD/ALLREDUCE packets of float32 buffer `x` (packet i = seq
    seg_start + i, elements [i*D, (i+1)*D), dataplane/fixed16.py): headers as `aggregation_fill`
    writes them (count and offset in elements, exponent byte 0), then the payload quantised with the
    agreed block exponents `exps` straight into the rows, check words included. `live`, as
    QuantizedLanes: once False, a (re)sent packet quantises zeros and is flagged SATURATED."""
    _nb, data = fixed16.layout(lanes)
    numel = x.size
    vt = ver_type(msg_type)
    template = _template(vt, session, worker, 0, tensor, int(Dtype.FIXED16), numel)
    shared = (vt, session, worker, tensor, int(Dtype.FIXED16), numel, seg_start, pool_base, pool_size, data, 0)
    row_len = fixed16.row_len(lanes)
    factors = quantize16_factors(exps, n)

    def fill(i0: int, i1: int, rows: np.ndarray, lens: np.ndarray) -> None:
        if i1 - i0 <= SCALAR_HEADER_ROWS:
            hrows = aggregation_headers_scalar(shared, i0, i1, None)
        else:
            hrows = aggregation_headers(template, shared, i0, i1, None)
        rows[:, :HEADER_LEN] = hrows
        lens[:] = row_len
        dead = live is not None and not live()
        src = np.zeros_like(x) if dead else x
        saturated = fixed16.encode_rows(src, exps, n, lanes, rows, i0, factors)
        if dead:
            saturated[:] = True
        if saturated.any():
            rows[:, 1] |= np.where(saturated, np.uint8(Flag.SATURATED), np.uint8(0))  # the flags byte
            if on_saturated is not None and not dead:
                on_saturated()
        h = header_view(rows)
        shorten_rows(rows, lens, h["count"], int(Dtype.FIXED16), h["flags"], lanes)
        seal_headers(rows)  # the header check (docs/protocol.md 3.5), over the final headers

    return fill


def exponent16_fill(*, seg_start: int, session: int, worker: int, pool_base: int, pool_size: int, lanes: int,
                    tensor: int, exps: np.ndarray):
    """A fill function for a FIXED16 job's exponent agreement (FIXED16 ALLREDUCE packets with MAX, one
    self-checking lane `e << 16 | exp_tag(e)` per block, dataplane/fixed16.py `encode_agreement_rows`)."""
    per = fixed16.agreement_lanes(lanes)
    vt = ver_type(MsgType.ALLREDUCE)
    numel = len(exps)
    template = _template(vt, session, worker, 0, tensor, int(Dtype.FIXED16), numel)
    shared = (vt, session, worker, tensor, int(Dtype.FIXED16), numel, seg_start, pool_base, pool_size, per,
              int(Flag.MAX))
    row_len = fixed16.row_len(lanes)

    def fill(i0: int, i1: int, rows: np.ndarray, lens: np.ndarray) -> None:
        if i1 - i0 <= SCALAR_HEADER_ROWS:
            hrows = aggregation_headers_scalar(shared, i0, i1, None)
        else:
            hrows = aggregation_headers(template, shared, i0, i1, None)
        rows[:, :HEADER_LEN] = hrows
        lens[:] = row_len
        fixed16.encode_agreement_rows(exps, lanes, rows, i0)
        h = header_view(rows)
        shorten_rows(rows, lens, h["count"], int(Dtype.FIXED16), h["flags"], lanes)
        seal_headers(rows)

    return fill


def shorten_rows(rows: np.ndarray, lens: np.ndarray, counts: np.ndarray, dtype: int, flags: np.ndarray,
                 lanes: int) -> None:
    """Cut whole aggregation packets (check lanes last, as encoded on a switch of `lanes` lanes)
    to the length their counts give (docs/protocol.md 3.3, `integrity.wire_lanes`): a row whose
    packet needs fewer whole chunks than the switch's lanes has its check lanes moved to the end
    of those chunks and its length `lens` set to match. The check words are unchanged by the move:
    they weigh the lanes before them, and every lane cut was padding (zero; checked, a bug
    otherwise). Header-only rows (ZERO, length 32) stay as they are."""
    if len(counts) == 1:  # a lone row (an exponent agreement's): on Python ints, as wire_lanes allows
        m = wire_lanes(int(counts[0]), dtype, int(flags[0]), lanes)
        n, short = np.array([m]), np.array([0] if m < lanes and lens[0] != HEADER_LEN else [], dtype=np.int64)
    else:
        n = wire_lanes(counts.astype(np.int64), dtype, flags, lanes)
        short = np.flatnonzero((n < lanes) & (lens != HEADER_LEN))
    if not len(short):
        return
    w = lane_bytes(dtype)
    ck = w * check_lanes(dtype)
    full = HEADER_LEN + w * lanes
    for i, m in zip(short.tolist(), n[short].tolist()):
        end = HEADER_LEN + w * m
        row = rows[i]
        if row[end - ck:full - ck].any():
            raise RuntimeError(f"luwu bug: an aggregation packet of count {int(counts[i])} has non-zero lanes past "
                               f"its {m} lanes (docs/protocol.md 3.3)")
        row[end - ck:end] = row[full - ck:full]
        row[full - ck:full] = 0
        lens[i] = end


def check_words_of(rows: np.ndarray, idx: np.ndarray, lanes: int, h: np.ndarray, dtype: int,
                   n: int) -> np.ndarray:
    """The 32-bit check words (K, 2) uint64 that packets `rows[idx]` (headers `h`, K of them) carry,
    or must carry as a sum of `n`, over their first `lanes` lanes: the compiled lane sums and header
    term (kernels/fixed_point.py `check_words32`), or the reference (`integrity.check_words_rows`)
    where kernels are off or the rows are not a flat buffer."""
    out = _check_words32(rows, idx, lanes, h, dtype, n, 0)
    if out is None:
        return check_words_rows(rows[idx, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4"), h, dtype, n)
    return out[0]


def write_check_words(rows: np.ndarray, lanes: int, h: np.ndarray, dtype: int) -> None:
    """Write each row's check words (one contribution) into its 2 lanes after the first `lanes`:
    `check_words_of` (compiled: in the same pass as the sums) stored big-endian."""
    if _check_words32(rows, None, lanes, h, dtype, 1, 1) is None:  # then check_words_of's kernel declines too
        words = check_words_rows(rows[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4"), h, dtype, 1)
        rows[:, HEADER_LEN + 4 * lanes:HEADER_LEN + 4 * (lanes + 2)].view(">u4")[...] = words


def check_words_hold(rows: np.ndarray, idx: np.ndarray, lanes: int, h: np.ndarray, dtype: int,
                     n: int) -> np.ndarray:
    """Whether each packet `rows[idx]` (headers `h`) carries, in its 2 lanes after the first `lanes`,
    the check words of a sum of `n` (`check_words_of` compared with what it carries: compiled in
    one pass per row)."""
    at = HEADER_LEN + 4 * lanes
    if _ALL(h["flags"] & _MAX8):  # MAX packets' words are their header terms alone (check_words_rows'
        got = rows[idx, at:at + 8].view(">u4").astype(np.uint64)  # answer for them, and the kernel
        return (got == header_terms(h, dtype)).all(axis=1)  # declines them): no copy of their lanes
    done = _check_words32(rows, idx, lanes, h, dtype, n, 2)
    if done is not None:
        return done[1]
    got = rows[idx, at:at + 8].view(">u4").astype(np.uint64)
    # the kernel declined, so check_words_of's would too: its reference straight away
    return (got == check_words_rows(rows[idx, HEADER_LEN:at].view(">i4"), h, dtype, n)).all(axis=1)


def _check_words32(rows: np.ndarray, idx: np.ndarray | None, lanes: int, h: np.ndarray, dtype: int, n: int,
                   mode: int) -> tuple[np.ndarray, np.ndarray] | None:
    """kernels/fixed_point.py `check_words32` of rows `idx` (None: all), or None where the reference
    must run (kernels off, rows or headers not flat buffers, FIXED16's 16-bit check words, MAX packets)."""
    if not use_numba() or check_lanes(dtype) != 2 or not h.flags.c_contiguous or h.dtype != DATA_HEADER:
        return None
    words = as_words(rows, HEADER_LEN)
    if words is None or _ANY(h["flags"] & _MAX8):
        return None
    k = len(h)
    sel = np.arange(k, dtype=np.int64) if idx is None else np.ascontiguousarray(idx, dtype=np.int64)
    out = np.empty((k, 2), dtype=np.uint64)
    ok = np.empty(k if mode == 2 else 0, dtype=np.bool_)
    fixed_point_kernels().check_words32(
        words, rows.shape[1] // 4, HEADER_LEN // 4, lanes, sel, h.view(np.uint8).reshape(k, HEADER_LEN),
        np.arange(k, dtype=np.int64), _TERM_AT, _TERM_WIDTH, _TERM_MULT,
        0 if dtype == Dtype.INT32 else int(dtype), int(MsgType.GRAD), int(MsgType.AGG), n, mode, out, ok)
    return out, ok


# check_words32's header layout (as fixed16.py's for header_terms16): byte offsets and widths (flags:
# the SET | MAX mask) of the fields the header term multiplies, and the 2 words' multipliers
_FIELDS = DATA_HEADER.fields
assert _FIELDS is not None
_TERM_AT = np.array([int(_FIELDS[f][1]) for f in ("session", "seq", "slot", "tensor", "offset", "count", "numel",
                                                  "dtype", "flags", "exponent", "ver_type")], dtype=np.int64)
_TERM_WIDTH = np.array([int(_FIELDS[f][0].itemsize) for f in ("session", "seq", "slot", "tensor", "offset", "count",
                                                              "numel")] + [1, int(Flag.SET | Flag.MAX), 1, 1],
                       dtype=np.int64)
_TERM_MULT = (T_MULT[:2] & 0xFFFFFFFF).astype(np.uint32)
TERM_LAYOUT = (_TERM_AT, _TERM_WIDTH, _TERM_MULT)  # for the compiled RESULT pass (collective.py), which checks too


def _nonzero_rows(block: np.ndarray) -> np.ndarray:
    """Which rows of `block` hold a non-zero lane. A row whose first lane is non-zero needs no
    scan, so dense data costs one strided read, not a second pass over the buffer."""
    nz = block[:, 0] != 0
    maybe = np.flatnonzero(~nz)
    if len(maybe) * 8 > len(block):  # many candidates: one contiguous scan beats gathering them
        return block.any(axis=1)
    if len(maybe):
        nz[maybe] = block[maybe].any(axis=1)
    return nz


SCALAR_HEADER_ROWS = 8  # fills of up to this many rows pack their headers row by row (aggregation_headers_scalar)
# what every header of an aggregation buffer is made from:
# (ver_type, session, worker, tensor, dtype, numel, seg_start, pool_base, pool_size, lanes, flags)
Shared = tuple[int, int, int, int, int, int, int, int, int, int, int]


def aggregation_headers(template: np.ndarray, shared: Shared, i0: int, i1: int,
                        exponents: np.ndarray | None) -> np.ndarray:
    """The (i1 - i0, 32) headers of chunks [i0, i1) of an aggregation buffer (the reference):
    `template`'s shared fields in a contiguous scratch, the per-chunk ones written a field at a time."""
    _vt, _session, _worker, _tensor, _dtype, numel, seg_start, pool_base, pool_size, lanes, flags = shared
    chunk = np.arange(i0, i1, dtype=np.int64)
    seqs = (seg_start + chunk) & MASK32
    slot, set_ = slot_for(seqs, pool_base, pool_size)
    hrows = np.empty((i1 - i0, HEADER_LEN), dtype=np.uint8)
    hrows[...] = template
    h = header_view(hrows)
    h["flags"] = (flags | (set_ * int(Flag.SET))).astype(np.uint8)
    h["count"] = np.minimum(lanes, numel - chunk * lanes)
    h["seq"] = seqs
    h["slot"] = slot
    h["offset"] = chunk * lanes
    if exponents is not None:
        h["exponent"] = exponents[i0:i1]
    return hrows


def aggregation_headers_scalar(shared: Shared, i0: int, i1: int, exponents: np.ndarray | None) -> np.ndarray:
    """`aggregation_headers` for a few rows, the same bytes (tests/engine/test_scalar_paths.py):
    one struct call per row instead of a dozen numpy calls per fill (~40 us for a lone exponent row)."""
    vt, session, worker, tensor, dtype, numel, seg_start, pool_base, pool_size, lanes, flags = shared
    exps = exponents[i0:i1].tolist() if exponents is not None else None
    out = bytearray(HEADER_LEN * (i1 - i0))
    set_flag = int(Flag.SET)
    for j, c in enumerate(range(i0, i1)):
        seq = (seg_start + c) & MASK32
        slot, set_ = slot_for(seq, pool_base, pool_size)
        e = 0 if exps is None else ((exps[j] + 128) & 0xFF) - 128  # numpy's wrap into the int8 field
        _DATA.pack_into(out, j * HEADER_LEN, vt, (flags | (set_ * set_flag)) & 0xFF, session, worker,
                        min(lanes, numel - c * lanes) & 0xFFFF, seq, slot & MASK32, tensor, (c * lanes) & MASK32, e,
                        dtype, 0, numel)
    return np.frombuffer(out, dtype=np.uint8).reshape(i1 - i0, HEADER_LEN)


class QuantizedLanes:
    """lanes_of for a float32 buffer in fixed point with agreed per-chunk exponents, for a sum
    over `n` contributors. `aggregation_fill` calls `write`, which quantises chunks [i0, i1)
    straight into the packet rows (dataplane/quantize.py `quantize_into_rows`: compiled or numpy);
    calling it returns (int32 lanes, saturated) like any lanes_of. `on_saturated` runs when a
    block had to clip (the caller's handle learns the result is not exact there).

    `live` says whether `x` still holds the caller's values: a retransmission quantises again
    from `x` (send_stream.py `refill`), and once the caller's handle has failed the caller may
    reuse `x`; a packet written then carries zeros flagged SATURATED, which makes the switch's
    sum of that chunk SATURATED (an exact recomputation or NaN), never a plausible number."""

    __slots__ = ("_factors", "exps", "lanes", "live", "n", "on_saturated", "x")

    def __init__(self, x: np.ndarray, exps: np.ndarray, lanes: int, n: int,
                 on_saturated: Callable[[], None] | None = None, live: Callable[[], bool] | None = None):
        self.x, self.exps, self.lanes, self.n, self.on_saturated = x, exps, lanes, n, on_saturated
        self.live = live
        self._factors: tuple[np.ndarray, np.ndarray] | None = None  # every chunk's scale, split once

    def __call__(self, i0: int, i1: int) -> tuple[np.ndarray, np.ndarray]:
        q, sat = quantize(self.x[i0 * self.lanes: i1 * self.lanes], self.exps[i0:i1], self.lanes, self.n)
        self._told(sat)
        return q, sat

    def write(self, i0: int, i1: int, rows: np.ndarray, col: int) -> np.ndarray:
        if self.live is not None and not self.live():
            rows[:, col:col + 4 * self.lanes] = 0
            return np.ones(i1 - i0, dtype=bool)
        if self._factors is None:
            self._factors = quantize_factors(self.exps, self.n)
        s1, s2 = self._factors
        sat = quantize_into_rows(self.x[i0 * self.lanes: i1 * self.lanes], self.exps[i0:i1], self.lanes, self.n,
                                 rows, col, (s1[i0:i1], s2[i0:i1]))
        self._told(sat)
        return sat

    def write_checked(self, i0: int, i1: int, rows: np.ndarray, hrows: np.ndarray, dtype: int,
                      seal: bool = False) -> np.ndarray | None:
        """`write` at column HEADER_LEN plus each row's 2 check words after its lanes (headers
        `hrows`, their SET and MAX flags final), in one compiled pass per row (kernels/fixed_point.py
        `quantize_rows_checked`); None, with nothing written, where that cannot run (then `write`
        and `write_check_words`: the same bytes). `seal`: then, also compiled (`seal_rows32`), what
        `aggregation_fill` does next: SATURATED into the flags of `hrows` where a row saturated,
        the header checks (`seal_headers`), and the headers copied into the rows."""
        if (not use_numba() or check_lanes(dtype) != 2 or (self.live is not None and not self.live())
                or not hrows.flags.c_contiguous or _ANY(hrows[:, 1] & _MAX8)):
            return None
        words = as_words(rows, HEADER_LEN)
        if words is None:
            return None
        if self._factors is None:
            self._factors = quantize_factors(self.exps, self.n)
        s1, s2 = self._factors
        x = np.ascontiguousarray(self.x[i0 * self.lanes: i1 * self.lanes], dtype=np.float32).reshape(-1)
        sat = np.zeros(i1 - i0, dtype=np.bool_)
        fixed_point_kernels().quantize_rows_checked(
            x, s1[i0:i1], s2[i0:i1], np.float32(2 ** (31 - contributor_bits(self.n)) - 1), words, rows.shape[1] // 4,
            HEADER_LEN // 4, self.lanes, sat, hrows, _TERM_AT, _TERM_WIDTH, _TERM_MULT,
            0 if dtype == Dtype.INT32 else dtype, int(MsgType.GRAD), int(MsgType.AGG))
        if seal:
            fixed_point_kernels().seal_rows32(hrows, sat, _FLAGS_AT, _SATURATED8, *HEADER_CHECK_TABLE, HCHECK_OFFSET,
                                              words.view(np.uint8), rows.shape[1])
        self._told(sat)
        return sat

    def _told(self, sat: np.ndarray) -> None:
        if self.on_saturated is not None and sat.any():
            self.on_saturated()


def slice_lanes(values: np.ndarray, lanes: int) -> LanesOf:
    """lanes_of for values already encoded (int32, chunks * lanes)."""
    return lambda i0, i1: (values[i0 * lanes: i1 * lanes], None)


def param_fill(*, seg_start: int, session: int, pull_id: int, tensor: int, data: np.ndarray, dtype: Dtype,
               elems_per_packet: int):
    """A fill function for the PARAM packets answering one pull (`data`: flat, native dtype)."""
    wire = np.dtype(data.dtype).newbyteorder(">")
    numel, epp = data.size, elems_per_packet
    # the fields every packet of the pull shares, written once; a fill builds its block's headers
    # from this in a contiguous scratch and copies them into the rows (64 KiB apart) in one pass,
    # as aggregation_fill does, and writes the values straight into the rows (no zeroed staging copy)
    template = _template(ver_type(MsgType.PARAM), session, NODE, pull_id, tensor, int(dtype), numel)

    def fill(i0: int, i1: int, rows: np.ndarray, lens: np.ndarray) -> None:
        n = i1 - i0
        chunk = np.arange(i0, i1, dtype=np.int64)
        counts = np.clip(numel - chunk * epp, 0, epp)
        hrows = np.empty((n, HEADER_LEN), dtype=np.uint8)
        hrows[...] = template
        h = header_view(hrows)
        h["count"] = counts
        h["seq"] = (seg_start + chunk) & MASK32
        h["offset"] = chunk * epp
        seal_headers(hrows)
        rows[:, :HEADER_LEN] = hrows
        payload = rows[:, HEADER_LEN:HEADER_LEN + epp * wire.itemsize].view(wire)  # (n, epp)
        lo, hi = i0 * epp, min(i1 * epp, numel)
        full = max(0, hi - lo) // epp
        if full:
            payload[:full] = data[lo:lo + full * epp].reshape(full, epp)
        if full < n:  # a last partial packet, and a pull of nothing: zeros past the values, as sent before
            rest = max(0, hi - lo - full * epp)
            payload[full, :rest] = data[lo + full * epp:lo + full * epp + rest]
            payload[full, rest:] = 0
            payload[full + 1:] = 0
        ends = HEADER_LEN + counts * wire.itemsize
        for r, end in enumerate(ends.tolist()):  # the trailer: CRC-32 of the values (docs/protocol.md 3.7)
            rows[r, end:end + TRAILER_LEN] = np.frombuffer(trailer(rows[r, HEADER_LEN:end]), dtype=np.uint8)
        lens[:] = ends + TRAILER_LEN

    return fill


def _struct_of(layout: np.dtype, names: tuple[str, ...]) -> struct.Struct:
    """protocol.py's numpy layout as a struct.Struct packing `names` in order (the fields after
    them zero): single packets (a heartbeat, a PULL) are packed in one call, where a numpy row
    and a field-by-field structured write cost ~20x more; the layout stays protocol.py's."""
    assert layout.names[:len(names)] == names, (layout.names, names)
    fmt = ">"
    for name in layout.names:
        f = layout.fields[name][0]
        if f.kind == "V" or name not in names:
            fmt += f"{f.itemsize}x"
        else:
            assert f.itemsize == 1 or f.byteorder == ">", name  # the wire is big-endian
            fmt += {"u": "BHIQ", "i": "bhiq"}[f.kind][f.itemsize.bit_length() - 1]
    out = struct.Struct(fmt)
    assert out.size == layout.itemsize
    return out


_DATA = _struct_of(DATA_HEADER, DATA_HEADER.names)


def _template(vt: int, session: int, worker: int, slot: int, tensor: int, dtype: int, numel: int) -> np.ndarray:
    """A (1, 32) header row with the fields every packet of a buffer shares (the rest zero),
    packed in one call: per operation, where six structured-field writes cost ~10x more."""
    return np.frombuffer(_DATA.pack(vt, 0, session, worker, 0, 0, slot, tensor, 0, 0, dtype, 0, numel),
                         dtype=np.uint8).reshape(1, HEADER_LEN)


_HEARTBEAT = _struct_of(HEARTBEAT_HEADER, ("ver_type", "flags", "session", "worker", "count", "seq", "ack", "credit"))
_PULL_HEADER = _struct_of(DATA_HEADER, ("ver_type", "flags", "session", "worker", "count"))
_PULL_REQUEST = _struct_of(PULL_REQUEST, PULL_REQUEST.names)
_HEARTBEAT_VT, _PULL_VT, _GAP = ver_type(MsgType.HEARTBEAT), ver_type(MsgType.PULL), int(Flag.GAP)


def heartbeat_bytes(session: int, worker: int, seq: int, ack: int, credit: int, gap: bool = False) -> bytes:
    """One HEARTBEAT packet {ack, credit} (docs/protocol.md 7.2) as bytes, ready to send."""
    return sealed(_HEARTBEAT.pack(_HEARTBEAT_VT, _GAP if gap else 0, session, worker, 0, seq & MASK32, ack & MASK32,
                                  credit & MASK32))


def heartbeat(session: int, worker: int, seq: int, ack: int, credit: int, gap: bool = False) -> np.ndarray:
    """`heartbeat_bytes` as a (1, 32) uint8 row."""
    return np.frombuffer(bytearray(heartbeat_bytes(session, worker, seq, ack, credit, gap)), dtype=np.uint8)[None]


def pull_request_bytes(session: int, worker: int, requests: list[tuple[int, int, int]]) -> bytes:
    """One PULL packet carrying (pull_id, tensor, version) requests, as bytes."""
    parts = [sealed(_PULL_HEADER.pack(_PULL_VT, 0, session, worker, len(requests)))]
    body = b"".join(_PULL_REQUEST.pack(*req) for req in requests)
    return b"".join((*parts, body, trailer(body)))  # the trailer (docs/protocol.md 3.7)


def pull_request(session: int, worker: int, requests: list[tuple[int, int, int]]) -> np.ndarray:
    """`pull_request_bytes` as a (1, n) uint8 row."""
    return np.frombuffer(bytearray(pull_request_bytes(session, worker, requests)), dtype=np.uint8)[None]


def payload_int32(rows: np.ndarray, lanes: int) -> np.ndarray:
    """The lanes of aggregation packets (K rows) as a (K, lanes) big-endian int32 view."""
    return rows[:, HEADER_LEN:HEADER_LEN + 4 * lanes].view(">i4")


# what a receiver expects of the chunks of tensor t (`in_bounds`): (elements per packet, numel,
# FIXED16 or not, or None: either format), or None for a tensor it does not know (left to it)
ChunkOf = Callable[[int, np.ndarray, np.ndarray], tuple[int, int, bool | None] | None]


def in_bounds(idx: np.ndarray, h: np.ndarray, stats: dict, chunk_of: ChunkOf) -> np.ndarray:
    """The received data packets among `idx` whose header names a chunk of its tensor.

    `chunk_of(tensor, hs, mine)` (hs: the headers `h[idx]`, mine: the mask of that tensor's) says
    what the receiver expects: a packet's offset must be a whole chunk (a multiple of the elements
    per packet) below numel, its count at most a packet, its numel the tensor's (and, where given,
    its format FIXED16 or not). Anything else is dropped and counted (`stats`
    `dropped.out_of_bounds`) before the window marks it received, so the resend cures it: a
    corrupted header that passed its CRC-16 (about 2^-16 of wider errors) must never index past a
    receiver's buffers (a crash of the engine loop, or of a compiled kernel). Used by
    `CollectiveSession.on_results` (RESULTs of its ops) and `NodeServerSession.on_agg` (AGGs of a
    layer's assembly).

    Returns:
        np.ndarray: `idx` itself when every packet passes, else the passing ones (in order).
    """
    hs = h[idx]
    tensors = hs["tensor"]
    every = tensors == tensors[0]
    if _ALL(every):  # the common batch, one tensor's: its fields read whole, not gathered by a mask
        want = chunk_of(int(tensors[0]), hs, every)
        if want is None:
            return idx
        per, numel, f16 = want
        off = hs["offset"].astype(np.int64)
        ok = (off % per == 0) & (off < numel) & (hs["count"] <= per) & (hs["numel"] == numel)
        if f16 is not None:
            ok &= (hs["dtype"] == int(Dtype.FIXED16)) == f16
        if _ALL(ok):
            return idx
        stats["dropped.out_of_bounds"] = stats.get("dropped.out_of_bounds", 0) + int((~ok).sum())
        return idx[ok]
    ok = np.ones(len(idx), dtype=bool)
    for t in np.unique(tensors):
        mine = tensors == t
        want = chunk_of(int(t), hs, mine)
        if want is None:
            continue
        per, numel, f16 = want
        off = hs["offset"][mine].astype(np.int64)
        good = (off % per == 0) & (off < numel) & (hs["count"][mine] <= per) & (hs["numel"][mine] == numel)
        if f16 is not None:
            good &= (hs["dtype"][mine] == int(Dtype.FIXED16)) == f16
        ok[mine] = good
    if _ALL(ok):
        return idx
    stats["dropped.out_of_bounds"] = stats.get("dropped.out_of_bounds", 0) + int((~ok).sum())
    return idx[ok]
