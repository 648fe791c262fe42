"""Hierarchical push/pull on a rail-only plan: the server's steps around each rail's push and pull.

Each rail's optimizer node owns one rail shard of every unit (routes.py). Before a push the
server's K ranks reduce-scatter the unit's gradient over the server's NVLink: local rank k gets
shard k of every local rank's gradient and sums them in local rank order (float64, rounded once:
luwu.worker.rails.local_reduce), then pushes that partial through rail k, whose switch adds the
other servers' partials: the node receives the sum over every rank of the job. After a pull of
shard k, the server all-gathers the shards so that every rank holds the whole unit, each shard as
its rail's node served it (copied, never recomputed: every rank computes with the same values).

The exchanges ride a point-to-point channel of their own (worker/p2p.py, its addresses under a
store prefix of the job, bound to the NVLink address). Their tags are derived from what is moved
(kind, unit, version and a count of earlier exchanges of the same kind, unit and version): every
rank performs the same pushes and pulls (the model's rules, README.md), so the tags match
whatever order backward's hooks run in.
"""

from __future__ import annotations

import collections

import numpy as np

from luwu.worker.p2p import P2PChannel
from luwu.worker.rails import ServerExchange, local_reduce, shard_bounds

STORE_PREFIX = "luwu/mnn/{job}/nvlink/"  # the channel's addresses: apart from any process group's
KINDS = {"push": 0, "pull": 1, "gather": 2}
REPEATS = 1 << 8  # exchanges of one (kind, unit, version) told apart (a pull is taken at most twice a step)


class ServerSteps:
    """The reduce-scatter before a push and the all-gather after a pull, for one rank."""

    def __init__(self, store, job_id: str, rank: int, world_size: int, local_size: int, host: str, timeout: float):
        import datetime

        from torch.distributed import PrefixStore

        self.k = local_size
        self.timeout = timeout
        self.p2p = P2PChannel(PrefixStore(STORE_PREFIX.format(job=job_id), store), rank, world_size, host,
                              datetime.timedelta(seconds=timeout))
        self.server = ServerExchange(self.p2p, rank, local_size)
        self.index = self.server.index
        self._seen: collections.Counter[tuple[int, int, int]] = collections.Counter()

    def _tag(self, kind: str, unit: int, version: int) -> int:
        key = (KINDS[kind], unit, version)
        n = self._seen[key]
        self._seen[key] += 1
        return ((version * (1 << 24) + unit) * 4 + key[0]) * REPEATS + n % REPEATS

    def reduce_scatter(self, unit: int, version: int, grad: np.ndarray, what: str) -> None:
        """`grad` (the unit's whole gradient, float32): its own shard becomes the server's sum of
        that shard, in place; the other shards are sent to their ranks and left as they were."""
        bounds = shard_bounds(grad.size, self.k)
        got = self.server.exchange_wait(self._tag("push", unit, version),
                                        {j: grad[a:b] for j, (a, b) in enumerate(bounds)}, self.timeout,
                                        f"the reduce-scatter of {what}")
        a, b = bounds[self.index]
        grad[a:b] = local_reduce([got[j] for j in range(self.k)], "sum")

    def all_gather(self, unit: int, version: int, values: np.ndarray, what: str, kind: str = "pull") -> None:
        """`values` (the unit's whole buffer): its own shard, as pulled, goes to every rank of the
        server; the other shards are filled in with theirs."""
        bounds = shard_bounds(values.size, self.k)
        a, b = bounds[self.index]
        got = self.server.exchange_wait(self._tag(kind, unit, version), dict.fromkeys(range(self.k), values[a:b]),
                                        self.timeout, f"the all-gather of {what}")
        for j, (lo, hi) in enumerate(bounds):
            if j != self.index:
                if got[j].size != hi - lo:
                    raise RuntimeError(f"the all-gather of {what}: local rank {j} sent {got[j].size} elements for "
                                       f"its shard of {hi - lo}: the ranks of this server disagree on the unit")
                values[lo:hi] = got[j]

    def close(self) -> None:
        self.p2p.close()
