"""numba kernels for the software switch's aggregation: the compiled twins of the aggregation
fast path (dataplane/switch/fast/aggregate_groups.py `plan` + `apply`: `phase_groups`; `groups_qualify`,
its qualification alone, and `headers_all_ok`, the header check of integrity.headers_ok, `scan_turn` and `turn_inputs` for
fast/aggregate_turn.py), of one round of
dataplane/switch/controls/aggregation_lanes.py (`apply_rows`) and of its emission of stored lanes
alone (`put_rows`: dataplane/switch/batch.py `write_results`).

numpy finds the qualifying groups of a batch and runs their slot state machine in some fifty
small array calls per batch (a fixed cost of a few hundred microseconds per event-loop turn),
then folds the groups position by position, every step converting the packets' big-endian
lanes into a temporary; `phase_groups` does both in one pass per group: qualify it, update the
slot registers, read each packet's lanes once (byte-swapped in registers), accumulate into the
slot's lane register, and, when the phase completes, write the sum big-endian into the
completing packet's row. Packet rows come as one 1-D uint32 array and a row stride (`lane_rows`): a
row's lanes are then a contiguous slice, which LLVM vectorises (byte swaps and adds in SIMD
registers); indexing rows of a strided 2-D view compiles to scalar code that runs about 1.6x
slower over the same rows (measured on 64 KiB rows). Arithmetic is on uint32 words (wrapping adds are the same bits as
int32's) and signed maximum for MAX groups, so the result is the numpy path's bit for bit
(tests/switch/test_switch_vectorised_equivalence.py runs the pipeline both ways against a
plain-Python model; tests/switch/test_switch_phase_groups_kernel.py compares the kernel with
`plan` + `apply` on random register states). Imported only when kernels are on (dataplane/kernels).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numpy.lib.stride_tricks import as_strided

from .fixed_point import _bswap32


def lane_rows(payload: np.ndarray) -> tuple[np.ndarray, int] | None:
    """The (K, lanes) uint32 view `payload` (a column range of 2-D packet rows) as (flat,
    stride): one 1-D array from its first lane, row r's lanes being
    `flat[r * stride:r * stride + lanes]` (the bytes between rows are the rows' own headers and
    tails, never touched). None when rows are not a whole number of words apart (frames of an
    odd `max_frame`): the caller runs the numpy reference instead."""
    k, n = payload.shape
    step, item = payload.strides
    if k == 0 or item != 4 or step % 4 or step < 4 * n:
        return None
    return as_strided(payload, shape=((k - 1) * (step // 4) + n,), strides=(4,)), step // 4


@njit(cache=True, nogil=True)
def _row(flat, r, stride, n):
    """Row r's lanes of a `lane_rows` array: a contiguous slice."""
    at = r * stride
    return flat[at:at + n]


@njit(cache=True, nogil=True)
def _combine_row(acc, src, is_max, assign):
    """acc = src (assign), acc + src (wrapping) or signed max(acc, src), src big-endian words."""
    if assign:
        for j in range(acc.size):
            acc[j] = _bswap32(src[j])
    elif is_max:
        for j in range(acc.size):
            v = np.int32(_bswap32(src[j]))
            a = np.int32(acc[j])
            acc[j] = np.uint32(v if v > a else a)
    else:
        for j in range(acc.size):
            acc[j] = np.uint32(acc[j] + _bswap32(src[j]))


@njit(cache=True, nogil=True)
def _add_rows(acc, a, b, c, d, k, assign):
    """acc = (0 if assign else acc) + the first k (1..4) of the big-endian rows a, b, c, d
    (wrapping): one pass over the register for up to four contributions (30% less time than
    four passes over 64 KiB rows, measured; rows past k are ignored)."""
    if k == 1:
        _combine_row(acc, a, False, assign)
    elif k == 2:
        if assign:
            for j in range(acc.size):
                acc[j] = np.uint32(_bswap32(a[j]) + _bswap32(b[j]))
        else:
            for j in range(acc.size):
                acc[j] = np.uint32(acc[j] + np.uint32(_bswap32(a[j]) + _bswap32(b[j])))
    elif k == 3:
        if assign:
            for j in range(acc.size):
                acc[j] = np.uint32(np.uint32(_bswap32(a[j]) + _bswap32(b[j])) + _bswap32(c[j]))
        else:
            for j in range(acc.size):
                acc[j] = np.uint32(np.uint32(acc[j] + _bswap32(a[j])) + np.uint32(_bswap32(b[j]) + _bswap32(c[j])))
    elif assign:
        for j in range(acc.size):
            acc[j] = np.uint32(np.uint32(_bswap32(a[j]) + _bswap32(b[j])) + np.uint32(_bswap32(c[j]) + _bswap32(d[j])))
    else:
        for j in range(acc.size):
            acc[j] = np.uint32(acc[j] + np.uint32(np.uint32(_bswap32(a[j]) + _bswap32(b[j]))
                                                  + np.uint32(_bswap32(c[j]) + _bswap32(d[j]))))


@njit(cache=True, nogil=True, inline="always")
def _group_ok(order, lo, m, s, epoch, is_max, bit, nw, slot_owner, bitmap, contributors):
    """Whether the group order[lo:lo + m] (one slot's packets) qualifies (fast/aggregate_groups.py),
    reading the registers only: (qualifies, first, the countdown after its first packet, its
    bits, the bitmap it finds)."""
    h = order[lo]
    g = s[h]
    gbits = np.uint32(0)
    bsum = np.int64(0)
    for q in range(lo, lo + m):
        p = order[q]
        if s[p] != g or epoch[p] != epoch[h] or is_max[p] != is_max[h]:
            return False, False, np.int64(0), gbits, gbits
        gbits |= bit[p]
        bsum += np.int64(bit[p])
    if np.int64(gbits) != bsum:
        return False, False, np.int64(0), gbits, gbits
    before = np.uint32(0) if slot_owner[g] != epoch[h] else bitmap[g]
    if (before & gbits) != 0:
        return False, False, np.int64(0), gbits, before
    first = before == 0
    rem0 = np.int64(nw[h]) - 1 if first else np.int64(contributors[g]) - 1
    if rem0 < m - 1:
        return False, False, np.int64(0), gbits, before
    return True, first, rem0, gbits, before


@njit(cache=True, nogil=True)
def groups_qualify(order, slot, s, epoch, is_max, bit, nw, slot_owner, bitmap, contributors):
    """Whether every group of the packets on one slot qualifies, so that `phase_groups` with the
    same arguments handles every packet (a group's registers are its slot's own: what one group
    writes no other group reads). Reads only."""
    n = order.size
    i = 0
    while i < n:
        h = order[i]
        j = i + 1
        while j < n and slot[order[j]] == slot[h]:
            j += 1
        ok = _group_ok(order, i, j - i, s, epoch, is_max, bit, nw, slot_owner, bitmap, contributors)[0]
        if not ok:
            return False
        i = j
    return True


@njit(cache=True, nogil=True, inline="always")
def _enter_group(order, lo, m, s, other, epoch, is_max, bit, nw, exponent, saturated, slot_owner, bitmap,
                 contributors, exponents, slot_flags, fast, remaining, out_exponent, out_saturated, last):
    """The slot state machine of the group order[lo:lo + m] (one slot's packets; `phase_groups`):
    returns (qualifies, first, remaining after its last packet); a group that qualifies has its
    registers (all but the lanes) and its packets' outcome written, one that does not is untouched."""
    ok, first, rem0, gbits, before = _group_ok(order, lo, m, s, epoch, is_max, bit, nw, slot_owner, bitmap,
                                               contributors)
    if not ok:
        return False, False, np.int64(0)
    h = order[lo]
    g = s[h]
    # slot_owner, worker_bitmap, contributor_counter
    slot_owner[g] = epoch[h]
    bitmap[g] = before | gbits
    bitmap[other[h]] &= ~gbits
    e = exponent[h]
    sat = False
    for q in range(lo, lo + m):
        p = order[q]
        fast[p] = True
        remaining[p] = np.uint32(rem0 - (q - lo))
        if exponent[p] > e:
            e = exponent[p]
        sat = sat or saturated[p]
    rest = rem0 - (m - 1)
    contributors[g] = np.uint32(rest)
    # exponent_max and SATURATED
    if not first:
        if exponents[g] > e:
            e = exponents[g]
        sat = sat or slot_flags[g] != 0
    exponents[g] = e
    slot_flags[g] = 1 if sat else 0
    tail = order[lo + m - 1]
    out_exponent[tail] = e
    out_saturated[tail] = sat
    last[tail] = True
    return True, first, rest


@njit(cache=True, nogil=True)
def phase_groups(order, slot, s, other, epoch, is_max, bit, nw, exponent, saturated, rows,
                 slot_owner, bitmap, contributors, exponents, slot_flags, regs, payload, stride,
                 fast, remaining, out_exponent, out_saturated, last, write_out):
    """The aggregation fast path over one batch's aggregation packets (arrays indexed by their
    position; `order` sorts them by `slot`, arrival order inside a slot): every group of the
    packets on one slot (one or more) that qualifies (fast/aggregate_groups.py: same register index, epoch and
    operation; distinct worker bits, none already in the bitmap; the countdown reaching zero at
    the last packet at the earliest) runs through the slot state machine and the lane fold, and
    its packets get fast = True, their `remaining`, and the last one its exponent and
    SATURATED (out_*, with last = True). Other groups are untouched (the caller runs them in
    rounds). Registers as in dataplane/switch/registers.py, lanes as `apply_rows`'s (`payload`,
    `stride`: `lane_rows` of the packets' lanes). `write_out` False: a completed sum stays in its lane register only (the
    caller writes it once where the packet leaves from: a multicast pool row, aggregate_groups.fold).
    Returns how many packets it handled."""
    n = order.size
    handled = 0
    i = 0
    while i < n:
        h = order[i]
        j = i + 1
        while j < n and slot[order[j]] == slot[h]:
            j += 1
        m = j - i
        lo, i = i, j
        ok, first, rest = _enter_group(order, lo, m, s, other, epoch, is_max, bit, nw, exponent, saturated,
                                       slot_owner, bitmap, contributors, exponents, slot_flags, fast, remaining,
                                       out_exponent, out_saturated, last)
        if not ok:
            continue
        tail = order[lo + m - 1]
        # aggregation_lanes: the group's lanes folded in arrival order (sums up to four rows
        # per pass over the register: wrapping adds give the same bits in any order)
        acc = regs[s[h]]
        mx = is_max[h]
        n_lanes = acc.size
        if mx:
            _combine_row(acc, _row(payload, rows[h], stride, n_lanes), mx, first)
            for q in range(lo + 1, lo + m):
                _combine_row(acc, _row(payload, rows[order[q]], stride, n_lanes), mx, False)
        else:
            assign = first
            q = lo
            while q < lo + m:
                k = min(4, lo + m - q)
                _add_rows(acc, _row(payload, rows[order[q]], stride, n_lanes),
                          _row(payload, rows[order[q + 1 if k > 1 else q]], stride, n_lanes),
                          _row(payload, rows[order[q + 2 if k > 2 else q]], stride, n_lanes),
                          _row(payload, rows[order[q + 3 if k > 3 else q]], stride, n_lanes), k, assign)
                assign = False
                q += k
        if rest == 0 and write_out:
            out = _row(payload, rows[tail], stride, n_lanes)
            for k in range(acc.size):
                out[k] = _bswap32(acc[k])
        handled += m
    return handled


@njit(cache=True, nogil=True)
def apply_rows(regs, payload, stride, slots, rows, first, dup, is_max, emit):
    """One round of aggregation_lanes (dataplane/switch/controls/aggregation_lanes.py) with unique
    slots: packet i's lanes overwrite (first[i]), add to or take the signed max with (is_max[i])
    its slot's register unless it is a duplicate; then rows that `emit` get the stored lanes
    big-endian. `regs` the lane registers' uint32 view; `payload`, `stride`: `lane_rows` of the
    packets' lanes."""
    for i in range(slots.size):
        acc = regs[slots[i]]
        src = _row(payload, rows[i], stride, acc.size)
        if first[i] or not dup[i]:
            _combine_row(acc, src, is_max[i], first[i])
        if emit[i]:
            for j in range(acc.size):
                src[j] = _bswap32(acc[j])


@njit(cache=True, nogil=True)
def put_rows(regs, payload, stride, slots, rows):
    """Rows `rows[i]` of `payload` (`lane_rows`) = lane register `slots[i]`, big-endian: the
    emission of stored lanes alone (a deferred result written where it leaves from)."""
    for i in range(slots.size):
        acc = regs[slots[i]]
        out = _row(payload, rows[i], stride, acc.size)
        for j in range(acc.size):
            out[j] = _bswap32(acc[j])


@njit(cache=True, nogil=True)
def headers_all_ok(rows, tables, offset):
    """Whether every row of `rows` (K, >=32 uint8) carries its header check (docs/protocol.md 3.5)
    big-endian at `offset`: the xor of `tables[p][byte]` over the other 30 header bytes, p counting
    them in order (protocol.HCHECK_TABLES, as integrity.header_checks gathers them)."""
    for r in range(rows.shape[0]):
        c = np.uint16(0)
        p = 0
        for j in range(32):
            if j == offset or j == offset + 1:
                continue
            c ^= tables[p, rows[r, j]]
            p += 1
        if c != (np.uint16(rows[r, offset]) << np.uint16(8) | np.uint16(rows[r, offset + 1])):
            return False
    return True


@njit(cache=True, nogil=True)
def scan_turn(rows, tables, offset, dtype_at, port, length, kid, keys, counts):
    """A turn's headers for fast/aggregate_turn.py: False-like -1 unless every row passes
    `headers_all_ok`; else the number of distinct keys (header bytes 0-7 as one big-endian word,
    the dtype byte at `dtype_at`, the port, the length), written in order of first arrival into
    `keys` (at most its rows: -1 past them), each row's key position into `kid` and the rows per
    key into `counts`."""
    if not headers_all_ok(rows, tables, offset):
        return -1
    m = 0
    for r in range(rows.shape[0]):
        w = np.uint64(0)
        for j in range(8):
            w = (w << np.uint64(8)) | np.uint64(rows[r, j])
        d = np.uint64(rows[r, dtype_at])
        p = np.uint64(port[r])
        n = np.uint64(length[r])
        found = -1
        for q in range(m):
            if keys[q, 0] == w and keys[q, 1] == d and keys[q, 2] == p and keys[q, 3] == n:
                found = q
                break
        if found < 0:
            if m == keys.shape[0]:
                return -1
            keys[m, 0], keys[m, 1], keys[m, 2], keys[m, 3] = w, d, p, n
            counts[m] = 0
            found = m
            m += 1
        kid[r] = found
        counts[found] += 1
    return m


@njit(cache=True, nogil=True)
def turn_inputs(rows, slot_at, exponent_at, kid, per_key, slots, set_flag, max_flag, saturated_flag,
                slot, s, other, epoch, bit, nw, is_max, saturated, exponent):
    """The slot state machine's per-packet inputs of a turn for fast/aggregate_turn.py (as
    pipeline._AggInputs gathers them), from the header rows (flags at byte 1, the big-endian slot
    at `slot_at`, the exponent at `exponent_at`) and each packet's key row of `per_key` (bit, epoch,
    workers, pool base, pool size): False, as soon as a slot lies outside its session's pool."""
    for r in range(rows.shape[0]):
        q = kid[r]
        sl = ((np.int64(rows[r, slot_at]) << 24) | (np.int64(rows[r, slot_at + 1]) << 16)
              | (np.int64(rows[r, slot_at + 2]) << 8) | np.int64(rows[r, slot_at + 3]))
        if ((sl - per_key[q, 3]) & 0xFFFFFFFF) >= per_key[q, 4]:
            return False
        f = rows[r, 1]
        in_set = (f & set_flag) != 0
        slot[r] = sl
        s[r] = (slots if in_set else 0) + sl
        other[r] = (0 if in_set else slots) + sl
        bit[r] = np.uint32(per_key[q, 0])
        epoch[r] = np.uint32(per_key[q, 1])
        nw[r] = np.uint32(per_key[q, 2])
        is_max[r] = (f & max_flag) != 0
        saturated[r] = (f & saturated_flag) != 0
        e = np.int64(rows[r, exponent_at])
        exponent[r] = np.int8(e - 256 if e > 127 else e)
    return True


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels on tiny inputs of the pipeline's dtypes,
    so that the switch's first aggregation batch does not wait for it while the endpoints'
    timers run."""
    regs = np.zeros((2, 4), dtype=np.uint32)
    rows = lane_rows(np.zeros((2, 48), dtype=np.uint8)[:, 32:48].view(np.uint32))  # as a batch's
    if rows is None:
        raise AssertionError("48-byte rows are a whole number of words apart")
    payload, stride = rows
    one = np.ones(1, dtype=np.int64)
    yes, no = np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.bool_)
    apply_rows(regs, payload, stride, one, one, yes, no, no, yes)
    put_rows(regs, payload, stride, one, one)
    two = np.zeros(2, dtype=np.int64)
    u32, b2 = np.zeros(2, dtype=np.uint32), np.zeros(2, dtype=np.bool_)
    hdr, i64 = np.zeros((2, 64), dtype=np.uint8), np.zeros(2, dtype=np.int64)
    headers_all_ok(hdr, np.zeros((30, 256), dtype=np.uint16), 26)
    scan_turn(hdr, np.zeros((30, 256), dtype=np.uint16), 26, 25, i64, i64, i64.copy(), np.zeros((2, 4), np.uint64),
              i64.copy())
    turn_inputs(hdr, 12, 24, i64, np.zeros((1, 5), np.int64), 4, 1, 2, 4, i64.copy(), i64.copy(), i64.copy(),
                np.zeros(2, np.uint32), np.zeros(2, np.uint32), np.zeros(2, np.uint32), np.zeros(2, np.bool_),
                np.zeros(2, np.bool_), np.zeros(2, np.int8))
    groups_qualify(np.arange(2), two, two, u32, b2, np.array([1, 2], np.uint32), u32 + 2, np.zeros(2, np.uint32),
                   np.zeros(2, np.uint32), np.zeros(2, np.uint32))
    phase_groups(np.arange(2), two, two, two, u32, b2, np.array([1, 2], np.uint32), u32 + 2, np.zeros(2, np.int8), b2,
                 np.arange(2), np.zeros(2, np.uint32), np.zeros(2, np.uint32), np.zeros(2, np.uint32),
                 np.zeros(2, np.int8), np.zeros(2, np.uint8), regs, payload, stride, b2.copy(), u32.copy(),
                 np.zeros(2, np.int8), b2.copy(), b2.copy(), True)
