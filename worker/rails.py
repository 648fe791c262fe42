"""The rail-only pieces both the torch backend and ModelInNetwork use: one cut of a tensor into
rail shards, the server's partial sum of a shard, and the exchange between the ranks of one server.

On a rail-only fabric local rank k of every server hangs off rail switch k and the rails are not
connected (Wang et al., Rail-only), so anything summed over the whole job goes server (NVLink
reduce-scatter) -> rail k (in-network sum of shard k) -> server (NVLink all-gather). The backend's
hierarchical allreduce (worker/backend/hierarchy.py) and ModelInNetwork's hierarchical push/pull
(worker/model_in_network/routes.py) are built on these; the controller's planner cuts every layer
for the rails' optimizer nodes with the same rule (`shard_bounds` is its `split_even`), so the
shard a server's rank k reduces is the slice rail k's node owns.

The server's NVLink is the group's point-to-point channel (worker/p2p.py), bound to the NVLink
address; ranks are numbered server by server (torchrun's order): server s holds ranks
[s*K, (s+1)*K).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from luwu.controller.shards import split_even


class RailError(RuntimeError):
    """An exchange inside the server failed or did not complete in time."""


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) shards: the controller's cut of a layer over the rails
    (`luwu.controller.shards.split_even`: shard k starts at numel * k // parts), so that rank k's
    shard is the slice rail k's optimizer node serves."""
    return [(off, off + n) for off, n in split_even(numel, parts)]


def local_reduce(parts: list[np.ndarray], op: str) -> np.ndarray:
    """The server's partial of one shard, parts in local rank order (float sums in float64,
    rounded once; int32 sums wrap like the switch's; max/min as numpy's, NaN propagating)."""
    if op in ("sum", "avg"):
        if parts[0].dtype == np.float32:
            with np.errstate(over="ignore", invalid="ignore"):
                return np.sum(np.stack(parts).astype(np.float64), axis=0).astype(np.float32)
        return np.add.reduce(np.stack(parts), axis=0, dtype=parts[0].dtype)  # int32 wraps, as the switch adds
    fn = np.maximum if op == "max" else np.minimum
    out = parts[0].copy()
    for p in parts[1:]:
        fn(out, p, out=out)
    return out


Done = Callable[["dict[int, np.ndarray] | None", "BaseException | None"], None]


class ServerExchange:
    """One rank's exchanges with the other ranks of its server over the point-to-point channel
    `p2p` (a `luwu.worker.p2p.P2PChannel`): local rank `index` = rank % local_size."""

    def __init__(self, p2p, rank: int, local_size: int):
        self.p2p = p2p
        self.k = local_size
        self.index = rank % local_size
        first = rank - self.index
        self.local = list(range(first, first + local_size))

    def exchange(self, tag: int, mine: dict[int, np.ndarray], done: Done) -> None:
        """Send mine[j] to local rank j and receive what each local rank sends this one; then
        `done({local index: array}, None)` (this rank's own part included) or `done(None, error)`,
        once, from whichever thread finishes it. Success waits for this rank's sends too: the
        channel reads mine[j] in place, so the caller may reuse those buffers once done runs."""
        me, dtype = self.index, mine[self.index].dtype
        got: dict[int, np.ndarray] = {me: mine[me]}
        state = {"finished": False, "sent": 0}
        lock = threading.Lock()

        def finish(err: BaseException | None) -> None:
            with lock:
                if state["finished"] or (err is None and (len(got) < self.k or state["sent"] < self.k - 1)):
                    return
                state["finished"] = True
            if err is not None:
                done(None, err)
            else:
                done(got, None)

        def deliver(j: int, payload: bytes) -> None:
            with lock:
                got[j] = np.frombuffer(payload, dtype=dtype)

        def sent(err: BaseException | None) -> None:
            if err is None:
                with lock:
                    state["sent"] += 1
            finish(err)

        for j, peer in enumerate(self.local):
            if j != me:
                self.p2p.send(peer, tag, np.ascontiguousarray(mine[j]).view(np.uint8), sent)
        for j, peer in enumerate(self.local):
            if j != me:
                self.p2p.recv(peer, tag, lambda b, j=j: deliver(j, b), finish)
        finish(None)  # K == 1, or everything already arrived

    def exchange_wait(self, tag: int, mine: dict[int, np.ndarray], timeout: float, what: str) -> dict[int, np.ndarray]:
        """`exchange`, waited for: RailError naming `what` when it fails or takes over `timeout` s."""
        box: list = []
        finished = threading.Event()

        def done(got: dict[int, np.ndarray] | None, err: BaseException | None) -> None:
            box.append((got, err))
            finished.set()

        self.exchange(tag, mine, done)
        if not finished.wait(timeout):
            raise RailError(f"{what} inside the server did not complete within {timeout:g} s (are ranks {self.local} "
                            "running, and is the point-to-point host their NVLink address?)")
        got, err = box[0]
        if err is not None or got is None:
            raise RailError(f"{what} inside the server failed: {err}")
        return got
