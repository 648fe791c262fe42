"""Allreduce on a rail-only plan: the server's ranks, then the rails, then the server again.

On a rail-only fabric local rank k of every server hangs off rail switch k and the rails are not
connected, so each collective session of the plan sums one rail (one rank per server). An
allreduce over the whole group is then hierarchical, as the Rail-only paper (Wang et al.) does it:

1. reduce-scatter inside the server: local rank k gets shard k of every local rank's input over the
   server's NVLink (here the group's point-to-point channel, bound to the NVLink address by
   LUWU_P2P_HOST) and reduces the K parts in local rank order (float sums in float64, rounded
   once; int32 sums wrap like the switch's; max/min as torch.maximum/minimum, NaN propagating);
2. in-network allreduce of that partial shard on rail k (the engine, the plan's session);
3. all-gather inside the server: every local rank gets every rail's summed shard.

Each shard's final value is computed once (by its rail) and copied, so every rank holds the same
result. A float sum sees the server's partial sums as contributions: its error stays within the
fixed-point bound of docs/protocol.md 5 for world_size / K contributors of those partials.

The cut (`shard_bounds`), the partial sum (`local_reduce`) and the exchange inside the server are
worker/rails.py's, shared with ModelInNetwork's hierarchical push/pull.

Ranks are numbered server by server (torchrun's order): server s holds ranks [s*K, (s+1)*K); `check_rails`
refuses a plan whose rail sessions say otherwise.
The intra-server exchanges are matched by tags drawn in submission order; the engine operation
of step 2 is submitted on the scheduler's submit thread after step 1 completes (step 1 blocks
that thread, bounded by the group's timeout), so every rail sees its operations in one order.

Not available on a rail-only plan: the exact recomputation of saturated float sums (a sum with
inf/NaN or |x| >= 2^127 fails with an error instead; flat plans recompute it exactly,
fallback.py), and point-to-point traffic between servers (no path between rails here).
"""

from __future__ import annotations

import threading

import numpy as np

from luwu.dataplane.engine import Handle
from luwu.worker.rails import ServerExchange, local_reduce, shard_bounds

from .diagnostics import LuwuError

__all__ = ["RailHierarchy", "check_rails", "local_reduce", "shard_bounds"]  # the last two: worker/rails.py

HIERARCHY_TAG_BASE = -(2**60)  # p2p tags of the intra-server steps (direct.py: -2^61, fallback.py: -2^62)


RAIL_KEY = "luwu/rail/{rank}"  # c10d store: a rank's collective session ids (each group has its own prefix)


def check_rails(store, rank: int, world_size: int, local_size: int, sessions: list[int], timeout: float) -> None:
    """Refuse a plan whose rails do not follow the server-by-server rank order this module
    assumes: every rank's collective sessions equal those of the rank with the same local index on
    server 0 (one rail), and differ from the other ranks' of its server (one rail each). Otherwise
    a rail session would sum shards of different positions: a plausible, wrong number."""
    import datetime
    import json

    store.set(RAIL_KEY.format(rank=rank), json.dumps(sorted(sessions)))
    keys = [RAIL_KEY.format(rank=r) for r in range(world_size)]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    rails = [tuple(json.loads(store.get(key))) for key in keys]
    for r, rail in enumerate(rails):
        if rail != rails[r % local_size]:
            raise LuwuError(f"rank {r} sums on sessions {list(rail)}, rank {r % local_size} (the same local rank on "
                            f"server 0) on {list(rails[r % local_size])}: the ranks are not numbered server by server "
                            f"with LOCAL_WORLD_SIZE={local_size} GPUs each (rank = server * {local_size} + rail); "
                            "fix the launcher's rank order or LOCAL_WORLD_SIZE")
    if len(set(rails[:local_size])) != local_size:
        raise LuwuError(f"the {local_size} ranks of server 0 share a rail session ({[list(r) for r in rails[:local_size]]})"
                        f": LOCAL_WORLD_SIZE={local_size} is not the number of rails of this plan")


class RailHierarchy:
    """The intra-server steps of one process group (use `allreduce` from the submit thread)."""

    def __init__(self, p2p, rank: int, world_size: int, local_size: int, timeout: float):
        self.p2p = p2p
        self.rank, self.world_size, self.k = rank, world_size, local_size
        self.server = ServerExchange(p2p, rank, local_size)
        self.index, self.local = self.server.index, self.server.local  # local rank = rail
        self.timeout = timeout
        self._next = 0

    def allreduce(self, x: np.ndarray, op: str, submit) -> Handle:
        """`submit(partial, op)` is the engine's allreduce on this rank's rail; returns a Handle of
        the whole group's result."""
        tag = HIERARCHY_TAG_BASE + 2 * self._next
        self._next += 1
        n = x.size
        flat = x.reshape(-1)
        if n < self.k:  # every rail gets a non-empty shard
            flat = np.concatenate([flat, np.zeros(self.k - n, dtype=x.dtype)])
        bounds = shard_bounds(flat.size, self.k)
        name = f"hierarchical allreduce({n} x {x.dtype}, {op})"
        parts = self._exchange_now(tag, {j: flat[a:b] for j, (a, b) in enumerate(bounds)}, name, "reduce-scatter")
        partial = local_reduce([parts[j] for j in range(self.k)], op)
        out = Handle(name)
        engine_h = submit(partial, "sum" if op == "avg" else op)

        def rail_done(h: Handle) -> None:
            if h.error is not None:
                out.set_error(h.error)
                return
            shard = np.asarray(h.wait())
            if h.saturated and shard.dtype == np.float32 and np.isnan(shard).any():
                out.set_error(LuwuError(
                    f"luwu {name}: a float sum saturated on rail {self.index} (an inf/NaN or a value of at least "
                    "2^127 in the input); its exact recomputation is not available on a rail-only plan, so no "
                    "result is returned. Check the inputs for non-finite values (e.g. scale the loss down)"))
                return
            if op == "avg":
                shard = (shard / self.world_size).astype(shard.dtype)

            def gathered(shards: dict[int, np.ndarray] | None, error: BaseException | None) -> None:
                if error is not None or shards is None:
                    out.set_error(LuwuError(f"luwu {name}: the all-gather inside the server failed: {error}"))
                else:
                    out.set_result(np.concatenate([shards[j] for j in range(self.k)])[:n])

            self._exchange(tag + 1, dict.fromkeys(range(self.k), shard), gathered)

        engine_h.add_done_callback(rail_done)
        return out

    def _exchange_now(self, tag: int, mine: dict[int, np.ndarray], name: str, step: str) -> dict[int, np.ndarray]:
        """`_exchange`, waited for (bounded by the group's timeout)."""
        box: list = []
        finished = threading.Event()

        def done(got: dict[int, np.ndarray] | None, err: BaseException | None) -> None:
            box.append((got, err))
            finished.set()

        self._exchange(tag, mine, done)
        if not finished.wait(self.timeout):
            raise LuwuError(f"luwu {name}: the {step} inside the server did not complete within {self.timeout:g} s "
                            f"(are ranks {self.local} running, and is LUWU_P2P_HOST their NVLink address?)")
        got, err = box[0]
        if err is not None:
            raise LuwuError(f"luwu {name}: the {step} inside the server failed: {err}")
        return got

    def _exchange(self, tag: int, mine: dict[int, np.ndarray], done) -> None:
        """worker/rails.py `ServerExchange.exchange` on this group's channel."""
        self.server.exchange(tag, mine, done)
