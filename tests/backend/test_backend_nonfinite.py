"""inf, NaN and float32 overflow through the luwu backend, against Gloo on the same ranks and inputs.

A contribution with inf/NaN (or a value the shared exponent cannot hold) saturates its chunk; the
backend recomputes those elements exactly over the ranks' TCP channel (worker/backend/fallback.py),
so inf/NaN propagate by IEEE rules and the finite elements of the same tensor stay exact
(docs/protocol.md 5.1). MAX/MIN with NaN give what Gloo gives (not always NaN: its ring keeps a rank's
own value over a NaN it receives; bit for bit in tests/backend/test_backend_integrity.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.protocol import Dtype, lanes_for_mode
from luwu.worker.backend.config import BackendConfig

# elements per packet of the embedded switch's default packet mode (its last lanes are check words)
LANES = data_lanes(lanes_for_mode(BackendConfig.mode), Dtype.FIXED32)
INF, NAN = float("inf"), float("nan")
DONE_WHEN = ([INF, 1, NAN, 2.5, -3], [1, 1, 1, 0.5, 1])  # rank 0, rank 1; other ranks contribute 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _input(case: str, rank: int) -> np.ndarray:
    """Each case's input on `rank` (float64 values, cast by the caller)."""
    big = np.float32(3e38)
    cases = {
        "done_when": DONE_WHEN[rank] if rank < 2 else [0.0] * 5,
        # 3e38 + 3e38 overflows to inf as in IEEE; 1e38 + -1e38 is exactly 0; inf + -inf is NaN
        "overflow": [[big, 1e38, -big, 3.4e38, INF, 7.0], [big, -1e38, -big, -3.4e38, -INF, 0.25]][min(rank, 1)]
        if rank < 2 else [0.0] * 6,
        "maxmin": [[NAN, -INF, INF, 1.0, -2.0, 0.0], [1.0, 5.0, 2.0, -INF, NAN, -0.0]][min(rank, 1)]
        if rank < 2 else [0.5] * 6,
    }
    return np.asarray(cases[case], dtype=np.float64)


def _spread(rank: int, world: int) -> np.ndarray:
    """Several packets: finite values everywhere, inf in chunk 1 on rank 0, NaN in chunk 3 on the last rank."""
    rng = np.random.default_rng(11 + rank)
    x = (rng.standard_normal(4 * LANES + 9) * 100).astype(np.float32)
    if rank == 0:
        x[LANES + 3] = INF
    if rank == world - 1:
        x[3 * LANES + 1] = NAN
    return x


def nonfinite_on_rank(rank: int, world: int) -> dict:
    gloo = dist.new_group(backend="gloo")
    out: dict = {}

    def both(name, make, fn):
        res = []
        for g in (None, gloo):
            t = make()
            fn(t, g)
            res.append(t.float().numpy().copy())
        out[name] = res

    for dname, dtype in DTYPES.items():
        both(f"done_when_{dname}", lambda dtype=dtype: torch.tensor(_input("done_when", rank), dtype=dtype),
             lambda t, g: dist.all_reduce(t, group=g))
        for op in ("MAX", "MIN"):
            both(f"{op}_{dname}", lambda dtype=dtype: torch.tensor(_input("maxmin", rank), dtype=dtype),
                 lambda t, g, op=op: dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g))
    both("overflow", lambda: torch.tensor(_input("overflow", rank), dtype=torch.float32),
         lambda t, g: dist.all_reduce(t, group=g))
    both("spread", lambda: torch.from_numpy(_spread(rank, world)), lambda t, g: dist.all_reduce(t, group=g))

    # AVG (Gloo has none): the exact path's sum / N
    t = torch.tensor(_input("overflow", rank), dtype=torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["avg"] = t.numpy().copy()

    # reduce_scatter_tensor: this rank's slice of the sum, inf/NaN included
    full = torch.tensor(np.tile(_input("done_when", rank), world), dtype=torch.float32)
    for name, g in (("luwu", None), ("gloo", gloo)):
        o = torch.empty(5)
        dist.reduce_scatter_tensor(o, full.clone(), group=g)
        out[f"reduce_scatter_{name}"] = o.numpy().copy()
    return out


def _same(a, b, msg):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=msg)  # NaN == NaN


@pytest.mark.parametrize("world,engine", [(2, "process"), (3, "embedded")])
def test_nonfinite_values_propagate_as_in_gloo(tmp_path, world, engine):
    results = run_ranks(nonfinite_on_rank, world, tmp_path, env={"LUWU_ENGINE": engine})
    def ins(case):
        return [_input(case, r) for r in range(world)]

    for rank, out in enumerate(results):
        where = f"rank {rank} of {world}"
        for dname in DTYPES:
            mine, ref = out[f"done_when_{dname}"]
            _same(mine, [INF, 2, NAN, 3, -2], f"done-when vector, {dname}, {where}")
            _same(mine, ref, f"done-when vector vs gloo, {dname}, {where}")
            for op in ("MAX", "MIN"):
                mine, ref = out[f"{op}_{dname}"]
                _same(mine, ref, f"{op} {dname} vs gloo, {where}")  # NaN where Gloo has NaN, and only there
        mine, ref = out["overflow"]
        _same(mine, [INF, 0, -INF, 0, NAN, 7.25], f"overflow, {where}")
        _same(mine, ref, f"overflow vs gloo, {where}")
        with np.errstate(invalid="ignore"):
            _same(out["avg"], (np.stack(ins("overflow")).sum(axis=0) / world).astype(np.float32), f"avg, {where}")
        mine, ref = out["spread"]
        xs = np.stack([_spread(r, world) for r in range(world)]).astype(np.float64)
        exact = xs.sum(axis=0)
        assert np.isinf(mine[LANES + 3]) and np.isnan(mine[3 * LANES + 1]), where
        assert np.isinf(ref[LANES + 3]) and np.isnan(ref[3 * LANES + 1]), where
        sat = np.zeros(mine.size, bool)
        sat[LANES:2 * LANES] = sat[3 * LANES:4 * LANES] = True
        # saturated chunks come from the exact path: float64 sum rounded once; the others within the bound
        _same(mine[sat], exact[sat].astype(np.float32), f"saturated chunks, {where}")
        assert np.isfinite(mine[~sat]).all(), where
        assert (np.abs(mine[~sat] - exact[~sat]) <= 1e-3 * (1 + np.abs(exact[~sat]))).all(), where
        _same(out["reduce_scatter_luwu"], out["reduce_scatter_gloo"], f"reduce_scatter vs gloo, {where}")
        _same(out["reduce_scatter_luwu"], np.stack(ins("done_when")).sum(axis=0), f"reduce_scatter, {where}")
    for r in range(1, world):
        for name in ("done_when_float32", "spread", "overflow"):
            _same(results[0][name][0], results[r][name][0], f"{name}: ranks 0 and {r} differ")
