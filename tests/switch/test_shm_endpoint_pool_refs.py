"""A shared-memory endpoint lends the rows it receives without a copy: runs of references into a
multicast pool (the switch's one copy of a packet for several ports) come back as pool rows, cut
where the run stops; a reference past its pool is a lost packet, never another row."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from luwu.dataplane.net.shm_endpoint import ShmEndpoint
from luwu.dataplane.net.shm_ring import ShmPool, ShmRing, pool_path, supported

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux x86-64 with /dev/shm")


def test_endpoint_lends_runs_of_pool_references(tmp_path):
    """References lend pool rows in runs: one pool, consecutive rows inside it (a whole batch at
    once, recv's usual case); a run stops at the pool's end, at another pool, at a step that is
    not +1 and at a packet in the ring itself; a reference past the pool is a lost packet."""
    prefix = f"/dev/shm/luwu-test-{os.getpid()}-{time.monotonic_ns()}"
    down = ShmRing(prefix + ".down", "producer", slots=32, row_bytes=64, create=True)
    up = ShmRing(prefix + ".up", "consumer", slots=8, row_bytes=64, create=True)
    pools = {i: ShmPool(pool_path(os.getpid(), i), slots=8, row_bytes=64, create=True) for i in (1, 2)}
    ep = ShmEndpoint(prefix, batch=16)
    try:
        for i, pool in pools.items():
            pool.rows[:] = (np.arange(8)[:, None] + 16 * i).astype(np.uint8)  # row r of pool i: all bytes 16 i + r
        own = np.full((1, 64), 99, dtype=np.uint8)

        def refs(pool_id, at):
            assert down.push_refs(pool_id, np.array(at, dtype=np.uint64), np.full(len(at), 40 + pool_id)) == len(at)

        def lent():
            out = []
            while k := ep.recv():
                out.append([(int(ep.rx[j, 0]), int(ep.rx_len[j])) for j in range(k)])
            return out

        refs(1, [2, 3, 4])
        assert lent() == [[(18, 41), (19, 41), (20, 41)]]
        refs(1, [6, 7, 0])  # the pool's end
        refs(2, [0, 1])  # another pool
        refs(1, [1, 3])  # a step that is not +1
        assert lent() == [[(22, 41), (23, 41)], [(16, 41)], [(32, 42), (33, 42)], [(17, 41)], [(19, 41)]]
        refs(1, [4])
        refs(2, [5])  # the next row's number, in another pool
        assert lent() == [[(20, 41)], [(37, 42)]]
        down.push_rows(own, np.array([0]), np.array([64]))
        refs(2, [5])
        down.push_rows(own, np.array([0]), np.array([64]))
        assert lent() == [[(99, 64)], [(37, 42)], [(99, 64)]]
        refs(1, [8, 9])  # past the pool: lost, never another row
        assert lent() == [] and ep.stats["rx_lost"] == 2
        refs(1, [5])
        assert lent() == [[(21, 41)]]
    finally:
        ep.close()
        for pool in pools.values():
            pool.close()
        up.close()
        down.close()
