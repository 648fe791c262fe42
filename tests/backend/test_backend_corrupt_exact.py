"""Exact-lane (INT32) collectives whose contribution was corrupted before the switch, through torch.distributed.

Rank 0's engine writes wrong check words into the first packet it sends whose first lane holds
SENTINEL (embedded: patched in the rank; the engine daemon: patched by a sitecustomize on the
daemon's PYTHONPATH, only in the daemon's process): the switch's stored sum of that chunk then fails its check
words on every resend, and the engine reports the chunk corrupt (CorruptResult.chunks,
dataplane/engine/reductions.py). The backend recomputes those elements exactly over the group's
TCP channel (worker/backend/fallback.py `guard_exact`), so every rank gets the exact result: an int32
sum wrapping like numpy int32, and a broadcast's bytes as the root sent them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.protocol import Dtype, lanes_for_mode
from luwu.worker.backend.config import BackendConfig

LANES = data_lanes(lanes_for_mode(BackendConfig.mode), Dtype.INT32)  # int32 elements per packet
SENTINEL = 0x5EED1234


def _sum_input(rank: int) -> np.ndarray:
    """Three packets and a short one; chunk 1 starts with SENTINEL on rank 0; some sums wrap."""
    x = (np.arange(3 * LANES + 5, dtype=np.int64) * (rank + 3) - 1000).astype(np.int32)
    x[5] = np.int32(2**31 - 2)  # 2^31 - 2 + 2^31 - 2 wraps to -4
    if rank == 0:
        x[LANES] = SENTINEL
    return x


def _bcast_input() -> np.ndarray:
    x = np.arange(2 * LANES, dtype=np.int32) * 7
    x[0] = SENTINEL
    return x


def _corrupt_rank0(budget: list[int]) -> None:
    """Patch this process's packet fill: the first `budget[0]` INT32 rows that start with SENTINEL
    get one check word flipped (a contribution corrupted before the switch, headers intact)."""
    from luwu.dataplane.engine import packets
    from luwu.dataplane.protocol import HEADER_LEN

    orig = packets.write_check_words

    def corrupting(rows, lanes, h, dtype):
        orig(rows, lanes, h, dtype)
        if dtype == int(Dtype.INT32) and budget[0]:
            first = rows[:, HEADER_LEN:HEADER_LEN + 4].view(">i4").reshape(-1)
            hit = np.flatnonzero(first == SENTINEL)
            if hit.size:
                rows[hit[0], HEADER_LEN + 4 * lanes + 3] ^= 0x10  # the first check word's low byte
                budget[0] -= 1

    packets.write_check_words = corrupting


# the engine daemon's patch (`_corrupt_rank0` in its process): only rank 0's data holds SENTINEL
_DAEMON_HOOK = """
import sys
if "luwu.dataplane.engine.daemon" in " ".join(getattr(sys, "orig_argv", [])):
    import numpy as np
    from luwu.dataplane.engine import packets
    from luwu.dataplane.protocol import HEADER_LEN, Dtype
    _orig, _budget = packets.write_check_words, [100]  # resends included: the switch keeps the first

    def _corrupting(rows, lanes, h, dtype):
        _orig(rows, lanes, h, dtype)
        if dtype == int(Dtype.INT32) and _budget[0]:
            hit = np.flatnonzero(rows[:, HEADER_LEN:HEADER_LEN + 4].view(">i4").reshape(-1) == SENTINEL)
            if hit.size:
                rows[hit[0], HEADER_LEN + 4 * lanes + 3] ^= 0x10  # the first check word's low byte
                _budget[0] -= 1

    packets.write_check_words = _corrupting
""".replace("SENTINEL", str(SENTINEL))


def corrupt_on_rank(rank: int, world: int) -> dict:
    budget = [0]
    embedded = os.environ.get("LUWU_ENGINE") == "embedded"
    if rank == 0 and embedded:
        _corrupt_rank0(budget)
    out: dict = {}
    budget[0] = 1
    t = torch.from_numpy(_sum_input(rank))
    dist.all_reduce(t)
    out["sum"] = t.numpy().copy()
    out["sum_budget"] = budget[0]
    budget[0] = 1
    b = torch.from_numpy(_bcast_input()) if rank == 0 else torch.zeros(2 * LANES, dtype=torch.int32)
    dist.broadcast(b, src=0)
    out["bcast"] = b.numpy().copy()
    out["bcast_budget"] = budget[0]
    t = torch.ones(7, dtype=torch.int32)  # the group still works after both
    dist.all_reduce(t)
    out["after"] = t.numpy().copy()
    out["embedded"] = embedded
    out["fallback"] = dict(dist.distributed_c10d._get_default_group()._sched.fallback.stats)
    return out


@pytest.mark.parametrize("engine", ["embedded", "process"])
def test_corrupt_int32_chunks_are_recomputed_exactly_on_every_rank(tmp_path, engine):
    world = 2
    env = {"LUWU_ENGINE": engine}
    if engine == "process":
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_DAEMON_HOOK)
        env["PYTHONPATH"] = os.pathsep.join([str(hook)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    results = run_ranks(corrupt_on_rank, world, tmp_path, env=env)
    with np.errstate(over="ignore"):
        exact = _sum_input(0)
        for r in range(1, world):
            exact = exact + _sum_input(r)  # int32 arrays: wraps like the switch
    assert exact[5] == -4
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        assert out["embedded"] == (engine == "embedded")
        if rank == 0 and engine == "embedded":
            assert out["sum_budget"] == 0 and out["bcast_budget"] == 0, f"nothing was corrupted on {where}"
        np.testing.assert_array_equal(out["sum"], exact, err_msg=f"int32 all_reduce, {where}")
        np.testing.assert_array_equal(out["bcast"], _bcast_input(), err_msg=f"broadcast, {where}")
        np.testing.assert_array_equal(out["after"], np.full(7, world, np.int32), err_msg=where)
        fb = out["fallback"]
        assert fb["corrupt_ops"] == 2 and fb["corrupt_chunks"] == 2, (where, fb)
        assert fb["elements"] == 2 * LANES, (where, fb)  # one whole chunk each
