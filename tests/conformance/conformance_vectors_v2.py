"""Conformance vectors of packet format v2 (docs/protocol.md 3.5-3.8, 5.2; issues 27 and 29).

* The header check (hcheck): a header corrupted on the way in (a data field, hcheck itself, a
  heartbeat) is dropped BAD_CHECKSUM before any state is touched -- the same worker's good
  packet afterwards is a first contribution, not a duplicate, and the phase completes with the
  good packets' sum. Every emitted header carries a recomputed hcheck (every vector checks it:
  expected frames are sealed, conformance_frames.py).
* FIXED16: int16 slots packed two per int32 lane (`hi * 2^16 + lo`), which the switch sums as
  plain int32 lanes (a negative low slot borrows from its high slot, and the sum splits back
  exactly); its exponent agreement is a signed int32 MAX of self-checking lanes; a resend, a GRAD
  completing toward the node; lengths 32 + 4 * lanes, as every aggregation dtype.
* Check words: the last lanes of an aggregation payload are opaque to the switch, summed like
  data; the sum verifies with `integrity.check_words(..., n)` (FIXED32 and FIXED16 with its
  exponent lanes), and a contribution corrupted in one lane (header intact) still aggregates but
  fails the receiver's check (asserted while the vector is built).
* PARAM/PULL with the 4-byte trailer: the length rules (a payload one byte short: MALFORMED).
* Chunks (3.3): on the 64-lane build a packet of any count is one whole chunk (a short FIXED16
  agreement included); half a chunk or two chunks is MALFORMED. Packets shorter than the switch's
  lanes need a wider switch: tests/switch/test_switch_short_packets.py.
"""

from __future__ import annotations

import numpy as np
from conformance_frames import frame_in, lanes_bytes, luwu_layer, slots_bytes, with_trailer, wrap32
from conformance_topology import DATA, LANES, NODE_HOST, NODE_S, WORKERS
from conformance_vectors import Agg, Script, Vector, agg, keep_flags, result, to_group, to_host, to_up
from conformance_vectors_messages import hb
from conformance_vectors_slots import total, values

from luwu.dataplane import integrity
from luwu.dataplane.fixed16 import pack_slots, unpack_slots
from luwu.dataplane.protocol import LANE_CHUNK, NODE, DropReason, Dtype, Event, Flag, MsgType

W0, W1, W2, W3 = WORKERS
SEQ_BYTE = 8  # first byte of `seq` in the 32-byte header


def flip(offset: int, bit: int = 0):
    """A mangler for `frame_in`: flips one bit of the sealed header (byte `offset`)."""
    def mangle(data: bytearray) -> None:
        data[offset] ^= 1 << bit
    return mangle


class Agg16(Agg):
    """A FIXED16 aggregation packet: its values are int16 slots, two per lane."""

    @property
    def payload(self) -> bytes:
        return slots_bytes(self.values)


def agg16(mtype: MsgType, s, src, seq: int, vals, **kw) -> Agg16:
    a = agg(mtype, s, src, seq, vals, dtype=Dtype.FIXED16, **kw)
    return Agg16(a.layer, a.values, a.src)


def fields(layer) -> dict:
    """The header fields `integrity.header_term` reads, from a scapy Luwu layer."""
    return {"type": int(layer.type), "session": layer.session, "seq": layer.seq, "slot": layer.slot,
            "tensor": layer.tensor, "offset": layer.offset, "count": layer.count, "numel": layer.numel,
            "flags": int(layer.flags), "exponent": layer.exponent}


# -- header check --------------------------------------------------------------------------------

def bad_header_check() -> Vector:
    """Corrupted headers are dropped BAD_CHECKSUM and touch nothing; the good packets then complete."""
    s = Script()
    seq = 40
    pk = [agg(MsgType.ALLREDUCE, DATA, h, seq, values(h.rank, 40), exponent=2, dtype=Dtype.FIXED32)
          for h in WORKERS]
    bad = agg(MsgType.ALLREDUCE, DATA, W0, seq, values(7, 40), exponent=2, dtype=Dtype.FIXED32)
    s.send(W0, None, frame=frame_in(W0, bad.layer, bad.payload, mangle=flip(SEQ_BYTE + 3)),
           note="seq's low bit flipped after sealing: BAD_CHECKSUM, slot untouched")
    s.send(W0, None, frame=frame_in(W0, bad.layer, bad.payload, mangle=flip(integrity.HCHECK_OFFSET + 1, 4)),
           note="hcheck itself corrupted: BAD_CHECKSUM")
    s.send(W1, None, frame=frame_in(W1, hb(DATA, W1, 1, 5, 5), mangle=flip(20, 7)),
           note="a heartbeat with a flipped reserved bit: BAD_CHECKSUM")
    s.send(W2, None, frame=frame_in(W2, luwu_layer(9, DATA.id, W2.rank), mangle=flip(SEQ_BYTE)),
           note="type 9 with a bad header check: BAD_CHECKSUM comes first")
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload, note="good contributions (w0 first: its bit was never set)")
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=2, flags=keep_flags(pk[3].layer.flags))
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, lanes_bytes(total(*(p.values for p in pk)))),
           note="last: RESULT with the four good packets' sum, hcheck recomputed")
    return Vector("bad_header_check", "3.5, 6.6", ("bad_checksum", "bad_checksum_no_state", "hcheck_recomputed"),
                  s.steps, drops={DropReason.BAD_CHECKSUM: 4},
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1},
                  session_packets={DATA.id: 4})


# -- FIXED16 -------------------------------------------------------------------------------------

def values16(rank: int, seed: int) -> list[int]:
    """A worker's int16 slots (2 * LANES): small random values of both signs (headroom for 4
    contributors: |v| < 2^13), plus edge slots (the headroom's extremes, whose sums reach
    +-(2^15 - 4); -1 in a low slot, which borrows from its high slot; rank)."""
    v = np.random.default_rng(7000 + 100 * seed + rank).integers(-2**13 + 1, 2**13, size=2 * LANES)
    v[0] = 2**13 - 1
    v[1] = -(2**13 - 1)
    v[2] = -(2**13 - 1)
    v[3] = -1
    v[5] = rank - 2
    return [int(x) for x in v]


def summed16(pk: list[Agg16]) -> bytes:
    """The switch's sum of FIXED16 packets: their packed lanes added as int32 (wrapping), which
    splits back into the slot sums mod 2^16 (asserted: the property the format rests on; exact for
    the data, whose sums fit int16, and the check words' high halves are taken mod 2^16 anyway)."""
    lanes = np.sum([pack_slots(np.asarray([p.values], dtype=np.int64))[0].astype(np.int64) for p in pk], axis=0)
    out = wrap32(lanes)
    want = (np.sum(np.asarray([p.values for p in pk], dtype=np.int64), axis=0) + 2**15) % 2**16 - 2**15
    assert unpack_slots(np.asarray([out], dtype=np.int64).astype(np.int32))[0].tolist() == want.tolist()
    return lanes_bytes(out)


def fixed16_allreduce() -> Vector:
    """FIXED16 ALLREDUCE: packed int16 slots summed as int32 lanes, the RESULT 4 * lanes bytes of
    sums that split back into the slot sums; a resend after completion gets the same sums, to its
    sender only."""
    s = Script()
    seq = 60
    pk = [agg16(MsgType.ALLREDUCE, DATA, h, seq, values16(h.rank, 1)) for h in WORKERS]
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload, note="absorbed")
    summed = summed16(pk)
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=keep_flags(pk[3].layer.flags))
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, summed),
           note="RESULT: int32 sums of packed slots (negative low slots borrow)")
    retx = agg16(MsgType.ALLREDUCE, DATA, W1, seq, values16(1, 1), flags=Flag.RETX)
    again = result(retx, mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=keep_flags(retx.layer.flags) | Flag.RETX)
    s.send(W1, retx.layer, retx.payload, to_host(W1, W1, again, summed), note="resend: stored sums to w1")
    return Vector("fixed16_allreduce", "5.2, 6.3", ("fixed16_sum", "fixed16_negative", "fixed16_resent"), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1, Event.RESENT: 1,
                          Event.UNICAST: 1})


def fixed16_max() -> Vector:
    """FIXED16 with MAX (a job's exponent agreement): the signed int32 max of self-checking lanes
    `e << 16 | exp_tag(e)` is the lane of the max exponent, negative exponents included (an
    unsigned max would make -1 the largest)."""
    s = Script()
    seq = 61
    nc = integrity.check_lanes(int(Dtype.FIXED16))
    pk = []
    for h in WORKERS:
        e = np.random.default_rng(7200 + h.rank).integers(-128, 128, size=LANES - nc)
        e[0] = -1 - h.rank  # all negative: the max is -1
        a = agg(MsgType.ALLREDUCE, DATA, h, seq, [], flags=Flag.MAX, dtype=Dtype.FIXED16, count=LANES - nc)
        t = integrity.check_words(np.zeros(2 * LANES - 2 * nc), fields(a.layer), int(Dtype.FIXED16))
        a.values = [int(x) for x in integrity.pack_exponents(e)] + [int(x) << 16 for x in t]
        pk.append(a)
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload)
    expect = [int(x) for x in np.max(np.asarray([p.values for p in pk], dtype=np.int64), axis=0)]
    got, ok = integrity.unpack_exponents(np.asarray(expect[:LANES - nc], dtype=np.int64).astype(np.int32))
    assert ok.all() and got[0] == -1, "the max of packed exponents is the packed max"
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=int(Flag.MAX))
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, lanes_bytes(expect)))
    return Vector("fixed16_max", "5.2, 6.3", ("fixed16_max",), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


def fixed16_grad() -> Vector:
    """FIXED16 GRADs at a root: the AGG to the node carries the packed int32 sums; a FIXED16 GRAD
    outside the pool goes to the node unaggregated with FALLBACK, its lanes untouched."""
    s = Script()
    seq = 7
    pk = [agg16(MsgType.GRAD, NODE_S, h, seq, values16(h.rank, 3)) for h in WORKERS]
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload)
    summed = summed16(pk)
    out = result(pk[3], mtype=MsgType.AGG, worker=NODE, exponent=0, flags=keep_flags(pk[3].layer.flags))
    s.send(W3, pk[3].layer, pk[3].payload, to_up(NODE_S, W3, out, summed), note="AGG to the node")
    outside = agg16(MsgType.GRAD, NODE_S, W2, seq, values16(2, 4), slot=5)
    fb = outside.layer.copy()
    fb.flags = int(fb.flags) | int(Flag.FALLBACK)
    s.send(W2, outside.layer, outside.payload, to_up(NODE_S, W2, fb, outside.payload),
           note="slot 5 is outside the pool: FALLBACK toward the node, lanes as sent")
    return Vector("fixed16_grad", "5.2, 6.3", ("fixed16_agg", "fixed16_fallback"), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.UNICAST: 2, Event.FALLBACK: 1})


# -- check words ---------------------------------------------------------------------------------

def _sealed32(layer, data: list[int]) -> list[int]:
    """FIXED32 lanes: `data` (lanes - 2 of them) then the sender's two check words."""
    c = integrity.check_words(np.asarray(data, dtype=np.int64), fields(layer), int(Dtype.FIXED32))
    return data + wrap32([int(x) for x in c])


def _verifies(lanes: list[int], layer, n: int) -> bool:
    """The receiver's check of a FIXED32 sum of `n` contributions (docs/protocol.md 3.6)."""
    k = LANES - integrity.check_lanes(int(Dtype.FIXED32))
    want = integrity.check_words(np.asarray(lanes[:k], dtype=np.int64), fields(layer), int(Dtype.FIXED32), n=n)
    return [int(x) & 0xFFFFFFFF for x in lanes[k:]] == [int(x) for x in want]


def check_words_fixed32() -> Vector:
    """Check words are lanes to the switch: summed like data, and the sum verifies for n = 4. A
    contribution with one data lane corrupted after its check words were made (header intact)
    aggregates all the same; its sum fails the receiver's check."""
    s = Script()
    data = LANES - integrity.check_lanes(int(Dtype.FIXED32))
    events = {Event.ABSORBED: 6, Event.COMPLETED: 2, Event.MULTICAST: 2}
    for seq, corrupt in ((90, False), (91, True)):
        pk = []
        for h in WORKERS:
            a = agg(MsgType.ALLREDUCE, DATA, h, seq, [], exponent=-3, dtype=Dtype.FIXED32)
            a.values = _sealed32(a.layer, values(h.rank, seq)[:data])
            pk.append(a)
        if corrupt:
            pk[1].values[17] ^= 1 << 9  # on the wire, after the sender made its check words
        for p in pk[:3]:
            s.send(p.src, p.layer, p.payload)
        summed = total(*(p.values for p in pk))
        out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=-3, flags=keep_flags(pk[3].layer.flags))
        assert _verifies(summed, out, 4) != corrupt, f"check words of seq {seq}: the integrity reference disagrees"
        s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, lanes_bytes(summed)),
               note="RESULT: check lanes summed like data" + (" (the receiver's check fails)" if corrupt else ""))
    return Vector("check_words_fixed32", "3.6, 6.3", ("check_words_sum", "check_words_corrupt_lane"), s.steps,
                  events=events)


def check_words_fixed16() -> Vector:
    """FIXED16 check words (4 words of 16 bits, each in the high half of one of the last 4 lanes)
    and exponent slots, summed like data: the receiver splits the lanes, divides the exponent slots
    by n and verifies the 16-bit check words of the sum (a 64-lane packet holds one block)."""
    s = Script()
    seq = 62
    dt = int(Dtype.FIXED16)
    ns = 2 * LANES - 2 * integrity.check_lanes(dt)  # slots before the check lanes
    nb = integrity.fixed16_blocks(LANES)
    nd = integrity.data_lanes(LANES, dt)
    assert nb == 1, "the 64-lane build carries one FIXED16 block (docs/protocol.md 5.2)"
    exps = np.arange(nb, dtype=np.int64) - 5  # the agreed block exponents
    pk = []
    for h in WORKERS:
        a = agg16(MsgType.ALLREDUCE, DATA, h, seq, [])
        before = np.zeros(ns, dtype=np.int64)
        before[:nb] = exps
        before[nb:nb + nd] = values16(h.rank, 5)[:nd]
        before[nb:nb + nd] //= 4  # |v| < 2^11: headroom for 4 contributors
        c = integrity.check_words(before, fields(a.layer), dt, n=1, exps=exps)
        a.values = [int(x) for x in before] + [v for x in c for v in (int(x), 0)]
        pk.append(a)
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload)
    summed = summed16(pk)
    slots = unpack_slots(np.frombuffer(summed, dtype=">i4").astype(np.int32)[None])[0]
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=keep_flags(pk[3].layer.flags))
    got_exps = slots[:nb]
    assert (got_exps % 4 == 0).all() and (got_exps // 4 == exps).all()
    want = integrity.check_words(slots[:ns], fields(out), dt, n=4, exps=got_exps // 4)
    assert [int(x) & 0xFFFF for x in slots[ns::2]] == [int(x) for x in want], "FIXED16 check words"
    assert not slots[ns + 1::2].any(), "the check lanes' low halves stay 0"
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, summed),
           note="RESULT: exponent slots = 4 e_b, 16-bit check words of the sum")
    return Vector("check_words_fixed16", "3.6, 5.2", ("check_words_fixed16", "fixed16_exponent_lanes"), s.steps,
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


# -- lengths -------------------------------------------------------------------------------------

def trailer_lengths() -> Vector:
    """PARAM and PULL carry a 4-byte trailer: 32 + count * itemsize + 4 and 32 + 12 * count + 4;
    one byte short (or no trailer) is MALFORMED, and so is an aggregation packet of 2 * lanes
    bytes (FIXED16's length before its slots were packed into int32 lanes), FIXED16 or not."""
    s = Script()
    param = luwu_layer(MsgType.PARAM, NODE_S.id, NODE, count=3, seq=9, slot=1, tensor=2, dtype=int(Dtype.FP32), numel=3)
    body = with_trailer(bytes(range(12)))
    s.send(NODE_HOST, param, body, out=to_group(NODE_S, NODE_HOST, param, body), note="PARAM: 32 + 12 + 4")
    s.send(NODE_HOST, param, body[:-1], note="PARAM one byte short: MALFORMED")
    s.send(NODE_HOST, param, bytes(range(12)), note="PARAM without its trailer: MALFORMED")
    pull = luwu_layer(MsgType.PULL, NODE_S.id, W3.rank, count=1, seq=4)
    req = with_trailer(bytes(range(50, 62)))
    s.send(W3, pull, req, out=to_up(NODE_S, W3, pull, req), note="PULL: 32 + 12 + 4")
    s.send(W3, pull, req[:-1], note="PULL one byte short: MALFORMED")
    half = lanes_bytes([1] * LANES)[:2 * LANES]
    narrow16 = agg16(MsgType.ALLREDUCE, DATA, W0, 63, [1] * LANES)
    s.send(W0, narrow16.layer, half, note="FIXED16 with 2 * lanes bytes: MALFORMED")
    narrow = agg(MsgType.ALLREDUCE, DATA, W0, 63, [1] * LANES, dtype=Dtype.FIXED32)
    s.send(W0, narrow.layer, half, note="FIXED32 with 2 * lanes bytes: MALFORMED")
    return Vector("trailer_lengths", "3.3, 3.8, 5.2", ("param_trailer", "pull_trailer", "malformed_trailer",
                                                       "malformed_fixed16"), s.steps,
                  drops={DropReason.MALFORMED: 5}, events={Event.MULTICAST: 1, Event.UNICAST: 1},
                  session_packets={NODE_S.id: 2})


def chunk_lengths() -> Vector:
    """Aggregation packets carry whole chunks of LANE_CHUNK lanes, the fewest their count needs
    (3.3). A 64-lane switch has one chunk, so a packet of any count is the whole packet: a FIXED16
    exponent agreement of 5 blocks (MAX, one lane per block, then 4 check lanes) is 32 + 4 * 64
    bytes, and so is its RESULT. Half a chunk or two chunks, 32-bit or FIXED16, is MALFORMED, counted, and changes no
    slot (the phase then completes with the four right packets)."""
    assert LANES == LANE_CHUNK, "the BMv2 build has one chunk"
    s = Script()
    seq, count = 67, 5
    pk = []
    for h in WORKERS:
        v = [0] * LANES  # padding between the exponents and the check lanes
        v[:count] = [int(x) for x in integrity.pack_exponents(np.arange(count) - 3 * h.rank)]
        v[LANES - 4:] = [h.rank << 16, 1 << 16, 2 << 16, 3 << 16]
        pk.append(agg(MsgType.ALLREDUCE, DATA, h, seq, v, flags=Flag.MAX, dtype=Dtype.FIXED16, count=count))
    half = agg(MsgType.ALLREDUCE, DATA, W0, seq, [1] * LANES, flags=Flag.MAX, count=count)
    ones = lanes_bytes([1] * LANES)
    s.send(W0, half.layer, ones[:len(ones) // 2], note="32-bit, half a chunk: MALFORMED")
    s.send(W0, half.layer, ones * 2, note="32-bit, two chunks: MALFORMED")
    s.send(W0, pk[0].layer, pk[0].payload[:len(pk[0].payload) // 2], note="FIXED16, half a chunk: MALFORMED")
    s.send(W0, pk[0].layer, pk[0].payload * 2, note="FIXED16, two chunks: MALFORMED")
    for p in pk[:3]:
        s.send(p.src, p.layer, p.payload, note="FIXED16 agreement of 5 blocks: one whole chunk")
    expect = [int(x) for x in np.max(np.asarray([p.values for p in pk], dtype=np.int64), axis=0)]
    out = result(pk[3], mtype=MsgType.RESULT, worker=NODE, exponent=0, flags=int(Flag.MAX))
    s.send(W3, pk[3].layer, pk[3].payload, to_group(DATA, W3, out, lanes_bytes(expect)),
           note="RESULT: the one chunk, 32 + 4 * 64 bytes")
    return Vector("chunk_lengths", "3.3, 5.2, 6.7", ("chunk_lengths", "malformed_chunks"), s.steps,
                  drops={DropReason.MALFORMED: 4}, session_packets={DATA.id: 4},
                  events={Event.ABSORBED: 3, Event.COMPLETED: 1, Event.MULTICAST: 1})


VECTORS = [bad_header_check, fixed16_allreduce, fixed16_max, fixed16_grad, check_words_fixed32, check_words_fixed16,
           trailer_lengths, chunk_lengths]
