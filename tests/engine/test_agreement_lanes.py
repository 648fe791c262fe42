"""The fingerprint's self-checking lanes (dataplane/engine/agreement.py, issue 27): a bit flip in
flight in an agreement lane is caught by the lane's own tag and never becomes a false "the
collectives differ" nor a silent pass; the MAX over workers of packed lanes still gives every
field's MIN and MAX."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from luwu.dataplane.engine import agreement as A
from luwu.dataplane.engine.handles import CollectiveMismatch, Handle
from luwu.dataplane.engine.reductions import AllreduceOp
from luwu.dataplane.integrity import crc16_arc

FIELDS = np.array([1, 123456789, 0, 2**31 - 1, 0x8000, 77], dtype=np.int32)


def test_tag_is_the_header_checks_crc():
    for index, kind, half in ((0, 0, 0), (3, 2, 0xBEEF), (255, 3, 0xFFFF), (8, 1, 0x8000)):
        assert int(A.tag(index, kind, half)) == crc16_arc(bytes([index, kind, half >> 8, half & 0xFF]))


def test_max_over_workers_gives_each_fields_min_and_max():
    other = FIELDS.copy()
    other[1], other[4] = 5, 1
    lo, hi, ok, differ = A.unpack(np.maximum(A.pack(FIELDS), A.pack(other)), FIELDS.size)
    assert ok and differ
    assert lo == [1, 5, 0, 2**31 - 1, 1, 77] and hi == FIELDS.tolist()
    lo, hi, ok, differ = A.unpack(np.maximum(A.pack(FIELDS), A.pack(FIELDS.copy())), FIELDS.size)
    assert ok and not differ and lo == hi == FIELDS.tolist()


def test_every_flip_of_one_to_three_bits_in_a_lane_is_caught():
    lanes = A.pack(FIELDS)
    assert lanes.size == A.lanes(FIELDS.size) == 4 * FIELDS.size
    missed = 0
    for i in range(lanes.size):
        for n in (1, 2, 3):
            for bits in itertools.combinations(range(32), n):
                x = lanes.copy().view(np.uint32)
                for b in bits:
                    x[i] ^= np.uint32(1 << b)
                _, _, ok, differ = A.unpack(x.view(np.int32), FIELDS.size)
                missed += ok
                assert not differ  # the corrupted half is not compared: never a false disagreement
    assert missed == 0


def test_a_lane_moved_to_another_fields_place_is_caught():
    lanes = A.pack(np.array([5, 5, 5], dtype=np.int32))
    swapped = lanes.copy()
    swapped[1], swapped[3] = lanes[3], lanes[1]  # same value, other field: the tag binds the place
    assert A.unpack(lanes, 3)[2] and not A.unpack(swapped, 3)[2]


class _Session:
    def __init__(self):
        self.stats: dict = {}


class _Meta:
    """The shape of the meta ReduceOp the engine reads (its session's stats)."""

    def __init__(self):
        self.session = _Session()


@pytest.mark.parametrize("corrupt", [False, True])
def test_the_engine_counts_a_corrupted_agreement_and_never_calls_it_a_mismatch(corrupt):
    """AllreduceOp reads the agreement with agreement.unpack: a lane whose tag fails is counted on
    the meta session and in the handle's info; only halves whose both lanes passed can disagree."""
    meta = _Meta()
    h = Handle("t")
    op = AllreduceOp(np.ones(4, np.int32), "max", 2, h, check=FIELDS)
    lanes = np.maximum(op._check_lanes(), A.pack(FIELDS)).view(np.uint32)
    if corrupt:
        lanes[5] ^= np.uint32(1 << 20)  # a value bit of field 1's low half
    assert op._agreed(lanes.view(np.int32), meta)
    assert not h.done()
    assert meta.session.stats.get("agreement.corrupt", 0) == int(corrupt)
    assert h.info.get("agreement_corrupt", False) == corrupt
    # a true difference in another field is still seen through a corrupted lane
    other = FIELDS.copy()
    other[3] = 9
    lanes = np.maximum(op._check_lanes(), A.pack(other)).view(np.uint32)
    lanes[5] ^= np.uint32(1 << 20)
    assert not op._agreed(lanes.view(np.int32), meta)
    with pytest.raises(CollectiveMismatch):
        h.wait(1)


def test_fields_ok_names_the_corrupted_field():
    lanes = A.pack(FIELDS).view(np.uint32)
    lanes[2 * FIELDS.size + 3] ^= np.uint32(1 << 3)  # field 1's low-half complement, a tag bit
    np.testing.assert_array_equal(A.fields_ok(lanes.view(np.int32), FIELDS.size),
                                  [True, False, True, True, True, True])
