"""Every collective of the luwu backend against Gloo on the same ranks, in real rank processes.

Each rank runs every case twice, on the default `luwu` group and on a Gloo group over the same
ranks, with the same inputs. Integer reductions and everything that moves bytes (broadcast,
allgather, gather, scatter, all_to_all, send/recv) must be bit-identical to Gloo; float sums must
lie within the fixed-point bound of docs/protocol.md 5 (`luwu.dataplane.quantize.error_bound`)
of the exact sum, and so within that bound plus Gloo's own rounding of Gloo's result; float
max/min are exact.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.protocol import Dtype, lanes_for_mode
from luwu.dataplane.quantize import chunk_exponents, error_bound
from luwu.worker.backend.config import BackendConfig

# elements per packet of the embedded switch's default packet mode (its last lanes are check words)
LANES = data_lanes(lanes_for_mode(BackendConfig.mode), Dtype.FIXED32)
FLOAT_NUMEL = 3 * LANES + 5  # several packets, a ragged last one
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32,
         "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8, "float64": torch.float64,
         "bool": torch.bool}


def float_input(case: str, rank: int, numel: int = FLOAT_NUMEL) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(case.encode()) + 7919 * rank)
    x = (rng.standard_normal(numel) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    if rank == 0:
        x[:LANES] = 0  # a chunk that is zero on one rank only
    return x


def int_input(case: str, rank: int, numel: int, lo: int, hi: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(case.encode()) + 104729 * rank)
    return rng.integers(lo, hi, numel, dtype=np.int64).astype(dtype)


def _t(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))
    return t.to(TORCH[dtype])


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.detach().clone().numpy()


def _both(gloo, fn):
    """fn(group) -> tensor(s) on the luwu (default) group and on the gloo group."""
    return fn(None), fn(gloo)


def collectives_on_rank(rank: int, world: int) -> dict:
    gloo = dist.new_group(backend="gloo")
    assert dist.get_backend() == "luwu"
    out: dict = {}

    def record(name, fn):
        luwu_res, gloo_res = _both(gloo, fn)
        conv = (lambda r: [_np(x) for x in r]) if isinstance(luwu_res, list) else _np
        out[name] = (conv(luwu_res), conv(gloo_res))

    # -- allreduce --------------------------------------------------------------------------------------------
    for dtype in ("float32", "bfloat16", "float16"):
        def ar_sum(g, dtype=dtype):
            t = _t(float_input(f"sum-{dtype}", rank) / (100 if dtype == "float16" else 1), dtype)
            dist.all_reduce(t, group=g)
            return t
        record(f"allreduce_sum_{dtype}", ar_sum)
    for dtype in ("float32", "bfloat16"):
        for op in ("MAX", "MIN"):
            def ar_mm(g, dtype=dtype, op=op):
                t = _t(float_input(f"mm-{dtype}", rank, 1000), dtype)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
                return t
            record(f"allreduce_{op}_{dtype}", ar_mm)

    def ar_avg(g):
        t = _t(float_input("avg", rank, 500), "float32")
        if g is None:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        else:  # Gloo has no AVG
            dist.all_reduce(t, group=g)
            t /= world
        return t
    record("allreduce_avg_float32", ar_avg)

    int_cases = [("int32", "SUM", -(2**27), 2**27), ("int32", "MAX", -(2**31), 2**31), ("int32", "MIN", -(2**31), 2**31),
                 ("int8", "SUM", -30, 30), ("uint8", "MAX", 0, 256), ("int64", "SUM", -(2**50), 2**50)]
    for dtype, op, lo, hi in int_cases:
        def ar_int(g, dtype=dtype, op=op, lo=lo, hi=hi):
            t = _t(int_input(f"int-{dtype}-{op}", rank, 3001, lo, hi, np.int64), dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
            return t
        record(f"allreduce_{op}_{dtype}", ar_int)

    def ar_many(g):  # several tensors, two dtypes, in one call
        ts = [_t(float_input("many-a", rank, 37), "float32"), _t(int_input("many-b", rank, 11, -99, 99, np.int32), "int32"),
              _t(float_input("many-c", rank, 2 * LANES), "float32")]
        if g is None:
            opts = dist.AllreduceOptions()
            dist.distributed_c10d._get_default_group().allreduce(ts, opts).wait()
        else:
            for t in ts:
                dist.all_reduce(t, group=g)
        return ts
    record("allreduce_list", ar_many)

    # -- what the switch cannot compute exactly: the hosts reduce every rank's bytes in rank order -------------
    # (values chosen so that any summation order is exact: Gloo's order may differ from rank order)
    host_cases = [("float64", "SUM", lambda n: int_input("h-f64", rank, n, -(2**40), 2**40, np.int64) / 4.0),
                  ("float64", "MAX", lambda n: int_input("h-f64m", rank, n, -999, 999, np.int64) * 0.5),
                  ("float32", "PRODUCT", lambda n: int_input("h-prod", rank, n, -8, 8, np.int64)),
                  ("int32", "PRODUCT", lambda n: int_input("h-iprod", rank, n, -1000, 1000, np.int64)),
                  ("int64", "MAX", lambda n: int_input("h-i64", rank, n, -(2**62), 2**62, np.int64)),
                  ("int32", "BXOR", lambda n: int_input("h-xor", rank, n, -(2**31), 2**31, np.int64)),
                  ("int32", "BAND", lambda n: int_input("h-and", rank, n, -(2**31), 2**31, np.int64)),
                  ("bool", "BOR", lambda n: int_input("h-or", rank, n, 0, 2, np.int64).astype(bool))]
    for dtype, op, make in host_cases:
        def ar_host(g, dtype=dtype, op=op, make=make):
            t = _t(make(2 * LANES + 3), dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
            return t
        record(f"host_allreduce_{op}_{dtype}", ar_host)

    def rs_product(g):
        i = _t(int_input("h-rsp", rank, 4 * world, -9, 9, np.int64), "int64")
        o = torch.empty(4, dtype=torch.int64)
        dist.reduce_scatter_tensor(o, i, op=dist.ReduceOp.PRODUCT, group=g)
        return o
    record("host_reduce_scatter_PRODUCT_int64", rs_product)

    def ag_coalesced(g):
        ins = [_t(float_input("agc-a", rank, 3), "float32"), _t(float_input("agc-b", rank, 5), "float32")]
        outs = [[torch.empty_like(t) for t in ins] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins, group=g)
        return [t for o in outs for t in o]
    record("all_gather_coalesced", ag_coalesced)

    # -- reduce, reduce_scatter -----------------------------------------------------------------------------
    def red(g):
        t = _t(int_input("reduce", rank, 100, -1000, 1000, np.int32), "int32")
        dist.reduce(t, dst=1, op=dist.ReduceOp.MAX, group=g)
        return t
    record("reduce_max_int32_dst1", red)

    def rs_list(g):
        ins = [_t(float_input(f"rs-{r}", rank, 700), "float32") for r in range(world)]
        o = torch.empty(700)
        dist.reduce_scatter(o, ins, group=g)
        return o
    record("reduce_scatter_float32", rs_list)

    def rs_tensor(g):
        i = _t(int_input("rst", rank, 5 * world, -(2**20), 2**20, np.int32), "int32")
        o = torch.empty(5, dtype=torch.int32)
        dist.reduce_scatter_tensor(o, i, group=g)
        return o
    record("reduce_scatter_tensor_int32", rs_tensor)

    # -- exact moves ------------------------------------------------------------------------------------------
    for dtype, numel in (("float64", 7), ("int8", 5), ("bool", 3), ("float32", 0), ("float32", 2 * LANES + 1)):
        def bc(g, dtype=dtype, numel=numel):
            src = int_input(f"bc-{dtype}", rank, numel, 0, 2, np.int64) if dtype == "bool" else \
                float_input(f"bc-{dtype}", rank, numel)
            t = _t(src.astype(np.float64) * (rank + 1), dtype) if dtype != "bool" else _t(src.astype(bool), dtype)
            dist.broadcast(t, src=1 % world, group=g)
            return t
        record(f"broadcast_{dtype}_{numel}", bc)

    def ag(g):
        outs = [torch.empty(3, dtype=torch.float16) for _ in range(world)]
        dist.all_gather(outs, _t(float_input("ag", rank, 3), "float16"), group=g)
        return outs
    record("all_gather_float16", ag)

    def agt(g):
        o = torch.empty(world * 4, dtype=torch.int64)
        dist.all_gather_into_tensor(o, _t(int_input("agt", rank, 4, -(2**62), 2**62, np.int64), "int64"), group=g)
        return o
    record("all_gather_into_tensor_int64", agt)

    def gat(g):
        t = _t(float_input("gather", rank, 9), "float32")
        outs = [torch.zeros(9) for _ in range(world)] if rank == 0 else None
        dist.gather(t, outs, dst=0, group=g)
        return outs if rank == 0 else [t]
    record("gather_dst0", gat)

    def sca(g):
        root = world - 1
        ins = [_t(int_input(f"sc-{r}", rank, 6, -9, 9, np.int16), "int32") for r in range(world)] if rank == root else None
        o = torch.zeros(6, dtype=torch.int32)
        dist.scatter(o, ins, src=root, group=g)
        return o
    record("scatter_src_last", sca)

    def a2a_single(g):
        in_splits = [(rank + d) % 3 + 1 for d in range(world)]  # rows this rank sends to d
        out_splits = [(s + rank) % 3 + 1 for s in range(world)]
        i = _t(float_input("a2a", rank, sum(in_splits) * 2).reshape(-1, 2), "float32")
        o = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(o, i, out_splits, in_splits, group=g)
        return o
    record("all_to_all_single_uneven", a2a_single)

    def a2a_equal(g):
        i = _t(int_input("a2ae", rank, 4 * world, -99, 99, np.int64), "int64")
        o = torch.empty_like(i)
        dist.all_to_all_single(o, i, group=g)
        return o
    record("all_to_all_single_equal", a2a_equal)

    # all_to_all with lists: Gloo has no list form, so the reference is the definition itself
    ins = [torch.full((rank + d + 1,), float(100 * rank + d)) for d in range(world)]
    outs = [torch.empty(s + rank + 1) for s in range(world)]
    dist.all_to_all(outs, ins)
    out["all_to_all_list"] = ([_np(o) for o in outs],
                              [np.full(s + rank + 1, float(100 * s + rank), dtype=np.float32) for s in range(world)])

    # -- send / recv (TCP) ------------------------------------------------------------------------------------
    def ring(g):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        got = [torch.empty(5, dtype=torch.int64) for _ in range(3)]
        reqs = [dist.irecv(got[k], src=prv, tag=k, group=g) for k in (2, 0, 1)]  # posted out of tag order
        for k in range(3):
            dist.send(torch.arange(5) + 1000 * rank + k, dst=nxt, tag=k, group=g)
        for r in reqs:
            r.wait()
        return got
    record("send_recv_ring", ring)

    def any_source(g):  # rank 0 receives from whichever rank sends (dist.recv without src)
        if rank == 0:
            got = []
            for _ in range(world - 1):
                t = torch.empty(3, dtype=torch.int64)
                src = dist.recv(t, tag=7, group=g)
                got.append([src, *t.tolist()])
            return torch.tensor(sorted(got))
        dist.send(torch.arange(3) + 100 * rank, dst=0, tag=7, group=g)
        return torch.zeros(1, dtype=torch.int64)
    record("recv_any_source", any_source)

    dist.barrier()
    dist.barrier(group=gloo)
    return out


def _float_bound(case: str, world: int, dtype: str, lanes: int = LANES, numel: int = FLOAT_NUMEL,
                 scale: float = 1.0):
    xs = [float_input(case, r, numel) / scale for r in range(world)]
    if dtype != "float32":  # what the ranks actually summed: their inputs rounded to dtype, widened
        xs = [torch.from_numpy(x).to(TORCH[dtype]).float().numpy() for x in xs]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    exps = np.max([chunk_exponents(x, lanes) for x in xs], axis=0)
    return exact, exps


def check(results: list[dict], world: int) -> None:
    for rank, out in enumerate(results):
        for name, (mine, ref) in out.items():
            where = f"rank {rank}, {name}"
            if name.startswith("allreduce_sum_"):
                dtype = name.rsplit("_", 1)[1]
                scale = 100 if dtype == "float16" else 1
                exact, exps = _float_bound(f"sum-{dtype}", world, dtype, scale=scale)
                bound = error_bound(mine.astype(np.float32), exps, LANES, world, dtype)
                err = np.abs(mine.astype(np.float64) - exact)
                assert (err <= bound).all(), f"{where}: error {err.max()} beyond the bound {bound[err.argmax()]}"
                gloo_err = np.abs(ref.astype(np.float64) - exact)
                assert (np.abs(mine.astype(np.float64) - ref) <= bound + gloo_err).all(), where
            elif name == "allreduce_avg_float32":
                np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=where)
            elif name == "allreduce_list":
                np.testing.assert_array_equal(mine[1], ref[1], err_msg=where)
                for k in (0, 2):
                    np.testing.assert_allclose(mine[k], ref[k], rtol=1e-5, atol=1e-6 * np.abs(ref[k]).max(),
                                               err_msg=where)
            elif name == "reduce_scatter_float32":
                xs = [np.concatenate([float_input(f"rs-{r}", s, 700) for r in range(world)]) for s in range(world)]
                exact = np.sum([x.astype(np.float64) for x in xs], axis=0)[rank * 700:(rank + 1) * 700]
                exps = np.max([chunk_exponents(x, LANES) for x in xs], axis=0)
                full = np.zeros(world * 700, np.float32)
                full[rank * 700:(rank + 1) * 700] = mine
                bound = error_bound(full, exps, LANES, world)[rank * 700:(rank + 1) * 700]
                assert (np.abs(mine - exact) <= bound).all(), where
            elif name == "reduce_max_int32_dst1" and rank != 1:
                continue  # only the destination's result is defined
            elif isinstance(mine, list):
                assert len(mine) == len(ref), where
                for a, b in zip(mine, ref):
                    np.testing.assert_array_equal(a, b, err_msg=where)
            else:
                assert mine.dtype == ref.dtype and mine.shape == ref.shape, where
                np.testing.assert_array_equal(mine, ref, err_msg=where)  # exact (ints, bytes, max/min)
    # every rank holds the same allreduce result (one multicast sum)
    for name in results[0]:
        if name.startswith("allreduce"):
            a = results[0][name][0]
            for r in range(1, world):
                b = results[r][name][0]
                if isinstance(a, list):
                    for x, y in zip(a, b):
                        np.testing.assert_array_equal(x, y)
                else:
                    np.testing.assert_array_equal(a, b, err_msg=f"{name}: ranks 0 and {r} differ")


@pytest.mark.parametrize("world,engine", [(2, "process"), (3, "embedded")])
def test_every_collective_matches_gloo(tmp_path, world, engine):
    results = run_ranks(collectives_on_rank, world, tmp_path, env={"LUWU_ENGINE": engine})
    assert len(results[0]) > 30
    check(results, world)
