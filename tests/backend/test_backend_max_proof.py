"""MAX/MIN results from the switch are proven end to end (worker/backend/max_proof.py, issue 27):
the check words verify sums only, so after a MAX/MIN each rank checks result >= its own input and
a SUM round proves that every rank holds the same result and every element is some rank's
input. A result corrupted in flight (here: after the engine decoded it, on one rank or on all)
fails the proof on every rank and is recomputed exactly over TCP: the answer is Gloo's, bit for
bit, never the corrupted one. SUM collectives never take the extra round."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.protocol import lanes_for_mode
from luwu.worker.backend.config import BackendConfig

LANES = lanes_for_mode(BackendConfig.mode)
N = 2 * LANES + 5  # whole chunks and a short one
CASES = {  # name: (ranks whose received result is corrupted, how), None: no corruption
    "clean": None,
    "raised_on_one_rank": ("last", "raise"),
    "raised_on_all": ("all", "raise"),
    "lowered_on_all": ("all", "lower"),
}


def _corrupt_results(rank: int, world: int, where: str, how: str) -> None:
    """Corrupt element 3 of every MAX/MIN result this rank's engine decodes (as a flipped lane would)."""
    from luwu.dataplane.engine import reductions

    if where == "last" and rank != world - 1:
        return
    decode = reductions.AllreduceOp._decode_keys

    def corrupted(self, chunk, rows, sel, hdr_exps):
        decode(self, chunk, rows, sel, hdr_exps)
        if len(self.out) and (chunk == 0).any():
            big = self.op == "max" if how == "raise" else self.op == "min"
            if self.out.dtype == np.float32:
                self.out[0, 3] = np.float32(1e30 if big else -1e30)
            else:
                self.out[0, 3] = np.int32(2**30 if big else -(2**30))

    reductions.AllreduceOp._decode_keys = corrupted


def max_proof_on_rank(rank: int, world: int) -> dict:
    case = CASES[os.environ["CASE"]]
    gloo = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    stats = pg._sched.fallback.stats
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(N, generator=gen)
    x[torch.rand(N, generator=gen) < 0.05] = float("nan")
    xi = torch.randint(-1000, 1000, (N,), generator=gen, dtype=torch.int32)
    before = dict(stats)
    s = torch.ones(N)
    dist.all_reduce(s)  # SUM: no proof
    out = {"sum_proofs": stats["max_proofs"] - before["max_proofs"], "sum": s.numpy().copy()}
    if case is not None:
        _corrupt_results(rank, world, *case)
    before = dict(stats)
    for name, make, op, call in (
            ("max_f32", lambda: x.clone(), "MAX", "all_reduce"),
            ("min_f32", lambda: x.clone(), "MIN", "all_reduce"),
            ("min_i32", lambda: xi.clone(), "MIN", "all_reduce"),
            ("max_bf16", lambda: x.to(torch.bfloat16), "MAX", "all_reduce"),
            ("reduce_max", lambda: x.clone(), "MAX", "reduce"),
            ("rs_max_i32", lambda: xi[: 2 * world].clone(), "MAX", "reduce_scatter_tensor")):
        for backend, g in (("luwu", None), ("gloo", gloo)):
            t = make()
            rop = getattr(dist.ReduceOp, op)
            if call == "all_reduce":
                dist.all_reduce(t, op=rop, group=g)
            elif call == "reduce":
                dist.reduce(t, 0, op=rop, group=g)
                if rank != 0:
                    continue
            else:
                o = torch.empty(2, dtype=t.dtype)
                dist.reduce_scatter_tensor(o, t, op=rop, group=g)
                t = o
            out[(name, backend)] = t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().copy()
    out["stats"] = {k: stats[k] - before[k] for k in ("max_proofs", "max_proof_failures", "max_proof_lanes")}
    return out


@pytest.mark.parametrize(("case", "world", "engine"), [
    ("clean", 2, "embedded"), ("raised_on_one_rank", 2, "embedded"), ("raised_on_all", 3, "embedded"),
    ("lowered_on_all", 2, "embedded"), ("raised_on_one_rank", 3, "embedded"),
    ("clean", 2, "process")])  # the engine daemon's decode is not patched here: its proof round only
def test_max_min_results_are_proven_or_recomputed(tmp_path, case, world, engine):
    results = run_ranks(max_proof_on_rank, world, tmp_path, env={"CASE": case, "LUWU_ENGINE": engine},
                        pg_timeout=120.0)
    for rank, out in enumerate(results):
        assert out["sum_proofs"] == 0, "a SUM took the MAX proof's round"
        np.testing.assert_array_equal(out["sum"], np.full(N, world, np.float32))
        for key, want in out.items():
            if isinstance(key, tuple) and key[1] == "gloo":
                got = out[(key[0], "luwu")]
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, f"{case}, rank {rank}, {key[0]}: {bad.size} elements differ from Gloo's " \
                                      f"at {bad[:5]}: {got[bad[:5]]} vs {want[bad[:5]]}"
    for rank, out in enumerate(results):
        st = out["stats"]
        assert st["max_proofs"] == 6, st  # every MAX/MIN through the switch, none else
        # the proof's round: counts 16 to a lane for 2 or 3 ranks, plus 2 hash lanes a rank and 1
        assert st["max_proof_lanes"] < (5 * N + 2 * world) // 16 + 6 * (2 * world + 2), st
        # corrupted: the 5 collectives with element 3 (not the 2-element reduce_scatter) fail the proof
        # on every rank alike and are recomputed, whichever rank's copy was corrupted
        assert st["max_proof_failures"] == (0 if case == "clean" else 5), (case, rank, st)


@pytest.mark.parametrize("world", [2, 3, 4, 7, 255])
def test_won_counts_pack_without_carries(world):
    from luwu.worker.backend.max_proof import count_bits, pack_counts, unpack_counts

    rng = np.random.default_rng(world)
    won = [rng.integers(0, 2, 1003).astype(np.uint32) for _ in range(world)]
    won[0][:] = 1  # every count at its largest somewhere
    summed = sum(pack_counts(w, world).view(np.uint32).astype(np.uint64) for w in won) & 0xFFFFFFFF
    counts = unpack_counts(summed.astype(np.uint32).view(np.int32), 1003, world)
    np.testing.assert_array_equal(counts, np.sum(won, axis=0))
    assert pack_counts(won[0], world).size == -(-1003 // (32 // count_bits(world)))


def test_the_verdict_names_each_failure():
    from luwu.worker.backend.max_proof import keys, proof_lanes, verdict

    xs = [np.array([1, 5, -3, 7], np.int32), np.array([2, 4, -3, 9], np.int32)]
    right = np.maximum(xs[0], xs[1])

    def summed(results):
        lanes = [proof_lanes(keys(x, "max"), keys(r, "max"), i, 2) for i, (x, r) in enumerate(zip(xs, results))]
        return ((lanes[0].astype(np.int64) + lanes[1]) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)

    assert verdict(summed([right, right]), 4, 2) == ""
    raised = right.copy()
    raised[1] = 6
    assert "no rank's contribution" in verdict(summed([raised, raised]), 4, 2)
    lowered = right.copy()
    lowered[3] = 8
    assert "below their own" in verdict(summed([lowered, lowered]), 4, 2)
    assert "different results" in verdict(summed([right, raised]), 4, 2)


def test_keys_are_the_engines_ordered_keys():
    from luwu.dataplane.quantize import to_ordered
    from luwu.worker.backend.max_proof import ordered

    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1, -1, 1e-45, -3e38], np.float32)
    x = np.concatenate([special, np.random.default_rng(1).standard_normal(1000).astype(np.float32)])
    np.testing.assert_array_equal(ordered(x), to_ordered(x))
