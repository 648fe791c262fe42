"""`Engine.allreduce(check=...)`: the workers' fingerprint fields are agreed on the meta session
(dataplane/engine/reductions.py). Equal fields give the plain result; fields that differ on any
worker fail the handle with CollectiveMismatch on every worker, carrying each field's smallest and
largest value, whatever the reduction (a float sum's fields ride in its exponent agreement)."""

from __future__ import annotations

import numpy as np
import pytest

from luwu.dataplane.engine.handles import CollectiveMismatch
from luwu.dataplane.loopback import local_star as star

CASES = [("sum", np.float32), ("avg", np.float32), ("max", np.float32), ("min", np.float32), ("sum", np.int32),
         ("max", np.int32)]


@pytest.mark.parametrize(("op", "dtype"), CASES)
def test_equal_fingerprints_give_the_plain_result(op, dtype):
    xs = [np.arange(100, dtype=dtype) * (r + 1) for r in range(3)]
    check = np.array([1, 2, 3, 2**31 - 1, 0], dtype=np.int32)
    with star(3) as (_, _, engines):
        got = [h.wait(60) for h in [e.allreduce(x, op, check=check) for e, x in zip(engines, xs)]]
        plain = [h.wait(60) for h in [e.allreduce(x, op) for e, x in zip(engines, xs)]]
    for g, p in zip(got, plain):
        np.testing.assert_array_equal(g, p)


@pytest.mark.parametrize(("op", "dtype"), CASES)
def test_a_differing_fingerprint_fails_every_worker(op, dtype):
    xs = [np.ones(100, dtype=dtype) for _ in range(3)]
    checks = [np.array([7, 100, 5], dtype=np.int32), np.array([7, 100, 5], dtype=np.int32),
              np.array([7, 200, 4], dtype=np.int32)]
    with star(3) as (_, _, engines):
        handles = [e.allreduce(x, op, check=c) for e, x, c in zip(engines, xs, checks)]
        errors = []
        for h in handles:
            with pytest.raises(CollectiveMismatch) as err:
                h.wait(60)
            errors.append(err.value)
    for e, c in zip(errors, checks):
        assert e.lo == [7, 100, 4] and e.hi == [7, 200, 5], (e.lo, e.hi)
        assert e.mine == c.tolist()


def test_check_fields_must_be_non_negative():
    with star(1) as (_, _, engines), pytest.raises(ValueError, match="non-negative"):
        engines[0].allreduce(np.ones(4, np.float32), check=np.array([-1], np.int32))
