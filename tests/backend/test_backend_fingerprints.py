"""Every collective that crosses the switch is fingerprinted (worker/backend/fingerprint.py KINDS):
ranks that call it with different sizes, dtypes, ops or roots all raise CollectiveMismatchError
naming what differs (never a result, never a wait for the group's timeout), also under
TORCH_DISTRIBUTED_DEBUG=DETAIL; and a disagreement that only corruption in flight can explain
(every rank describes the same call) is named as such (issue 27)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from backend_harness import run_ranks

from luwu.dataplane.engine.handles import CollectiveMismatch
from luwu.worker.backend.fingerprint import (
    KINDS,
    MISMATCH_KEY,
    CollectiveMismatchError,
    CorruptedAgreementError,
    Fingerprint,
    mismatch_error,
)

# kind -> (what differs on the last rank, the words of the error)
CASES = {
    "all_reduce": ("element count", "all_reduce of 8 x torch.float32, MAX"),
    "reduce": ("root", "reduce of 4 x torch.float32, SUM, root 0"),
    "reduce_scatter": ("element count", "reduce_scatter of 6 x torch.float32"),
    "reduce_scatter_tensor": ("dtype", "reduce_scatter_tensor of 4 x torch.int32, SUM"),
    "broadcast": ("element count", "broadcast of 8 x torch.float32, root 0"),
    "all_gather": ("element count", "all_gather of 6 x torch.float32"),
    "all_gather_into_tensor": ("dtype", "all_gather_into_tensor of 1 x torch.int32"),
    "barrier": ("collective", "barrier of 0 x no tensor"),
}


def mismatched_kind_on_rank(rank: int, world: int) -> dict:
    import os

    kind = os.environ["KIND"]
    odd = rank == world - 1
    dist.all_reduce(torch.ones(2))  # #0: agreed
    try:
        if kind == "all_reduce":
            dist.all_reduce(torch.ones(8 if odd else 4), op=dist.ReduceOp.MAX)
        elif kind == "reduce":
            dist.reduce(torch.ones(4), dst=0 if odd else 1)
        elif kind == "reduce_scatter":
            n = 3 if odd else 2
            dist.reduce_scatter(torch.empty(n), [torch.ones(n) for _ in range(world)])
        elif kind == "reduce_scatter_tensor":
            dt = torch.int32 if odd else torch.float32
            dist.reduce_scatter_tensor(torch.empty(2, dtype=dt), torch.ones(2 * world, dtype=dt))
        elif kind == "broadcast":
            dist.broadcast(torch.ones(8 if odd else 4), src=0)
        elif kind == "all_gather":
            n = 3 if odd else 2
            dist.all_gather([torch.empty(n) for _ in range(world)], torch.ones(n))
        elif kind == "all_gather_into_tensor":
            dt = torch.int32 if odd else torch.float32
            dist.all_gather_into_tensor(torch.empty(world, dtype=dt), torch.ones(1, dtype=dt))
        else:  # barrier against an all_reduce
            if odd:
                dist.barrier()
            else:
                dist.all_reduce(torch.ones(4))
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_every_fingerprinted_kind_refuses_a_mismatch_on_every_rank(tmp_path, kind):
    differs, last = CASES[kind]
    assert kind in KINDS
    # a generous group timeout: a rank that waited for it would fail with a timeout, not this error
    results = run_ranks(mismatched_kind_on_rank, 2, tmp_path, env={"KIND": kind, "LUWU_ENGINE": "embedded"},
                        pg_timeout=120.0)
    for rank, res in enumerate(results):
        err = res["error"]
        assert err is not None, f"{kind}: rank {rank} got a result"
        assert err.startswith("CollectiveMismatchError: luwu "), err
        assert f"(differing: {differs}" in err, err
        assert f"rank 1 has {last}" in err, err


@pytest.mark.parametrize("kind", ["broadcast", "reduce_scatter_tensor", "barrier"])
def test_detail_names_mismatches_of_every_kind(tmp_path, kind):
    results = run_ranks(mismatched_kind_on_rank, 2, tmp_path,
                        env={"KIND": kind, "LUWU_ENGINE": "embedded", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
                        pg_timeout=120.0)
    for res in results:
        err = res["error"]
        assert err is not None and "Detected mismatch between collectives on ranks" in err, err
        assert "Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=1" in err, err
        assert "Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=1" in err, err


def _published(fp: Fingerprint) -> str:
    return json.dumps({"describe": fp.describe(), "torch": fp.torch_words(), "seq": fp.seq})


@pytest.mark.parametrize("same", [True, False])
def test_a_disagreement_every_rank_denies_is_named_corruption(same):
    """mismatch_error reads each rank's own description through the store: when they are all the
    same, the fingerprints disagreed only on the wire (a corrupted lane that passed its tag)."""
    store = dist.HashStore()
    fp = Fingerprint.of("all_reduce", [torch.ones(4)], "sum")
    fp.seq = 5
    theirs = fp if same else Fingerprint.of("all_reduce", [torch.ones(8)], "sum")
    theirs.seq = 5
    store.set(MISMATCH_KEY.format(check=9, rank=1), _published(theirs))
    err = mismatch_error(store, 9, 0, 2, fp, CollectiveMismatch("differ", [1, 4], [1, 8], [1, 4]))
    if same:
        assert isinstance(err, CorruptedAgreementError) and not isinstance(err, CollectiveMismatchError)
        assert "corrupted on the way" in str(err) and "not at fault" in str(err), err
    else:
        assert isinstance(err, CollectiveMismatchError)
        assert "rank 1 has all_reduce of 8 x torch.float32, SUM" in str(err), err


def corrupted_agreement_on_rank(rank: int, world: int) -> dict:
    """The last rank's copy of every fingerprint agreement has a bit flipped in one lane (as a
    corrupted RESULT from the switch to it would): counted, never a mismatch, results exact; a
    true mismatch in another field is still refused on every rank."""
    import numpy as np

    from luwu.dataplane.engine.reductions import AllreduceOp

    if rank == world - 1:
        agreed = AllreduceOp._agreed

        def flipped(self, lanes, meta_op):
            u = np.array(lanes, dtype=np.int32).view(np.uint32)
            u[1] ^= np.uint32(1 << 21)  # field 0's low half: a value bit
            return agreed(self, u.view(np.int32), meta_op)

        AllreduceOp._agreed = flipped
    out: dict = {}
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)  # a float sum: the fingerprint rides in its exponent agreement
    out["sum"] = t.tolist()
    t = torch.tensor([float(rank), 5.0 - rank])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t.tolist()
    t = torch.tensor([rank + 1], dtype=torch.int32)
    dist.all_reduce(t)
    out["int"] = t.tolist()
    t = torch.tensor([7.0, 8.0]) if rank == 0 else torch.zeros(2)
    dist.broadcast(t, src=0)
    out["broadcast"] = t.tolist()
    dist.barrier()
    stats = dist.distributed_c10d._get_default_group()._link.engine.session_stats()
    out["corrupt"] = sum(v.get("agreement.corrupt", 0) for v in stats.values())
    try:
        dist.all_reduce(torch.ones(8 if rank == world - 1 else 4))
        out["mismatch"] = None
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        out["mismatch"] = f"{type(e).__name__}: {e}"
    return out


def test_a_corrupted_agreement_lane_is_counted_not_a_mismatch(tmp_path):
    world = 2
    results = run_ranks(corrupted_agreement_on_rank, world, tmp_path,
                        env={"LUWU_ENGINE": "embedded", "LUWU_EAGER_START": "1"}, pg_timeout=120.0)
    for rank, out in enumerate(results):
        assert out["sum"] == [3.0] * 5 and out["max"] == [1.0, 5.0] and out["int"] == [3], out
        assert out["broadcast"] == [7.0, 8.0], out
        # sum, max, int, broadcast, barrier: each agreement read once (the start-up barrier came before:
        # LUWU_EAGER_START, else the group's deferred start-up may run it after the patch, or before)
        assert out["corrupt"] == (5 if rank == world - 1 else 0), out
        assert out["mismatch"] is not None and out["mismatch"].startswith("CollectiveMismatchError"), out
        assert "(differing: element count)" in out["mismatch"], out
