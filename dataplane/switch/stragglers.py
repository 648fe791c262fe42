"""Who holds each sum back: per session and worker, how often the worker's contribution was the
one that completed a slot (the last to arrive) and how long after the slot's first contribution.

Host-side bookkeeping of the software switch, outside the P4 twin's semantics: the pipeline hands
every batch's aggregation outcome (`AggregationResult`) here after its register controls ran, and
`record` folds the whole batch in with a handful of numpy operations (no per-packet Python).
Time is the host's monotonic clock read once per batch, so a lag is resolved to one event-loop
turn: contributions that arrive in the same turn count as simultaneous (lag 0).

Per (session, worker) it keeps: `contributions` (accepted, not duplicates), `duplicates`
(retransmissions of a contribution already counted), `last` (slots this worker completed),
`lag_seconds` (their summed lag: first contribution to this last one) and `lag_buckets` (a
histogram of the same lags over `LAG_BUCKETS`). `luwu_switch_last_arrivals_total{session,worker}`
and friends export it (dataplane/observe/metrics.py); `luwu-ctl top` reads them through the controller.
"""

from __future__ import annotations

import time
from bisect import bisect_left

import numpy as np

from ..observe.metrics import LAG_BUCKETS
from ..protocol import MAX_CONTRIBUTORS, MAX_SESSIONS

_BOUNDS = np.array(LAG_BUCKETS)
_NEVER = np.iinfo(np.int64).max
SMALL = 16  # batches of up to this many aggregation packets are recorded one packet at a time


class Stragglers:
    """Last arrivals per (session, worker) of one switch; `record` is called per batch under the switch lock.

    Dense per (session, bitmap bit) arrays: a batch updates them with a few `ufunc.at` calls, whatever
    its mix of sessions and workers; `worker_of` remembers which worker id holds each bit."""

    def __init__(self, slots: int, clock=time.monotonic):
        self.clock = clock
        self.first_seen = np.zeros(2 * slots, dtype=np.float64)  # per register index: its phase's first contribution
        self._earliest = np.full(2 * slots, _NEVER, dtype=np.int64)  # scratch: a batch's first-contribution positions
        self.reset()

    def reset(self) -> None:
        cells = MAX_SESSIONS * MAX_CONTRIBUTORS
        self.counts = np.zeros((cells, 3), dtype=np.int64)  # contributions not completing, duplicates, last
        self.lag = np.zeros(cells, dtype=np.float64)
        self.buckets = np.zeros((cells, len(LAG_BUCKETS) + 1), dtype=np.int64)
        self.worker_of = np.zeros(cells, dtype=np.int64)

    def record(self, session: np.ndarray, worker: np.ndarray, bit: np.ndarray, index: np.ndarray,
               num_workers: np.ndarray, dup: np.ndarray, remaining: np.ndarray) -> None:
        """Fold one batch's aggregation packets in, in arrival order.

        Args:
            session, worker: each packet's header fields; bit: its worker's bitmap bit (a power of two).
            index: its register index (set * slots + slot).
            num_workers: its session's worker count; dup, remaining: the register controls' outcome.
        """
        n = len(index)
        if n == 0:
            return
        if n <= SMALL:
            self.record_lists(session.tolist(), worker.tolist(), bit.tolist(), index.tolist(), num_workers.tolist(),
                              dup.tolist(), remaining.tolist())
            return
        now = self.clock()
        rem = remaining.astype(np.int64)
        cell = session.astype(np.int64) * MAX_CONTRIBUTORS + (np.frexp(bit.astype(np.float64))[1] - 1)
        self.worker_of[cell] = worker
        fresh = ~dup
        done = fresh & (rem == 0)
        first = fresh & (rem == num_workers.astype(np.int64) - 1)
        # columns: contributions that did not complete their slot (0), duplicates (1), completing ones (2)
        np.add.at(self.counts, (cell, dup + 2 * done), 1)
        di = np.flatnonzero(done)
        if len(di):
            lag = now - self.first_seen[index[di]]
            fi = np.flatnonzero(first)
            if len(fi):  # a first contribution earlier in this batch (or the same packet): lag 0
                np.minimum.at(self._earliest, index[fi], fi)
                lag[self._earliest[index[di]] <= di] = 0.0
                self._earliest[index[fi]] = _NEVER
            np.add.at(self.lag, cell[di], lag)
            np.add.at(self.buckets, (cell[di], np.searchsorted(_BOUNDS, lag)), 1)
        self.first_seen[index[first]] = now

    def record_lists(self, session: list[int], worker: list[int], bit: list[int], index: list[int],
                     num_workers: list[int], dup: list[bool], remaining: list[int]) -> None:
        """`record` on Python lists, one packet after the other (a few packets: the same counts, the
        same float sums in the same order, without the `ufunc.at` calls' fixed cost)."""
        now = self.clock()
        # where each register index saw its first contribution of this batch (a later completion: lag 0)
        earliest: dict[int, int] = {}
        for j, (ix, d, r, nw) in enumerate(zip(index, dup, remaining, num_workers)):
            if not d and r == nw - 1 and ix not in earliest:
                earliest[ix] = j
        for j, (s, w, b, ix, d, r) in enumerate(zip(session, worker, bit, index, dup, remaining)):
            cell = s * MAX_CONTRIBUTORS + int(b).bit_length() - 1  # (frexp's exponent - 1, as `record`)
            self.worker_of[cell] = w
            done = not d and r == 0
            self.counts[cell, int(d) + 2 * done] += 1
            if done:
                lag = 0.0 if earliest.get(ix, j + 1) <= j else now - float(self.first_seen[ix])
                self.lag[cell] += lag
                self.buckets[cell, bisect_left(LAG_BUCKETS, lag)] += 1
        for ix in earliest:
            self.first_seen[ix] = now

    def snapshot(self) -> dict[int, dict[int, dict]]:
        """{session: {worker: {"contributions", "duplicates", "last", "lag_seconds", "lag_buckets"}}}
        (`lag_buckets` non-cumulative per LAG_BUCKETS bound, then +Inf)."""
        out: dict[int, dict[int, dict]] = {}
        for cell in np.flatnonzero(self.counts.any(axis=1)).tolist():
            c = self.counts[cell]
            out.setdefault(cell // MAX_CONTRIBUTORS, {})[int(self.worker_of[cell])] = {
                "contributions": int(c[0] + c[2]), "duplicates": int(c[1]), "last": int(c[2]),
                "lag_seconds": float(self.lag[cell]), "lag_buckets": [int(v) for v in self.buckets[cell]]}
        return out
