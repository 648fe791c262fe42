"""Work and Future semantics of the luwu process group, on real ranks: `wait()`, `get_future()` (its value
is the list of output tensors, `then` callbacks see the result), many collectives in flight completed
in order whatever order they are waited in, the collective call returning before the collective is
done, and saturated sums (recomputed exactly, worker/backend/fallback.py) in flight among ordinary ones
without a warning."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist
from backend_harness import run_ranks


def semantics_on_rank(rank: int, world: int) -> dict:
    from luwu.worker.backend import LuwuWork

    out: dict = {}
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    out["work_type"] = type(work).__name__
    fut = work.get_future()
    import threading

    seen = []
    called = threading.Event()
    doubled = fut.then(lambda f: (seen.append(f.value()), f.value()[0] * 2)[1])
    fut.add_done_callback(lambda f: called.set())
    out["wait"] = work.wait()
    out["completed"] = work.is_completed() and work.is_success()
    value = fut.wait()
    out["value_is_list_of_outputs"] = isinstance(value, list) and len(value) == 1 and value[0] is t
    out["allreduced"] = t.numpy().copy()
    out["doubled"] = doubled.wait().numpy()  # completes after its callback ran
    out["callbacks_ran"] = called.wait(30) and len(seen) == 1 and seen[0][0] is t

    # a collective returns before it has completed: this rank submits, the other ranks wait a moment
    big = torch.ones(200_000)
    if rank == 0:
        w = dist.all_reduce(big, async_op=True)
        out["returned_before_done"] = not w.is_completed()
        w.wait()
    else:
        import time

        time.sleep(1.0)
        dist.all_reduce(big)
    out["big_sum"] = float(big[0])

    # many in flight, waited in reverse order, values per op
    tensors = [torch.full((1000 * k + 1,), float(k + rank)) for k in range(10)]
    works = [dist.all_reduce(x, async_op=True) for x in tensors]
    for w in reversed(works):
        w.wait()
    out["in_flight"] = [float(x[0]) for x in tensors]
    out["in_flight_sizes_ok"] = all(x.numel() == 1000 * k + 1 for k, x in enumerate(tensors))

    # many in flight, waited in call order: a waiter may assemble its own result (hand_to_waiter), but
    # only the earliest incomplete one's, so they still complete in call order
    order: list[int] = []
    tensors = [torch.full((4000 * k + 1,), float(k + rank)) for k in range(8)]
    works = [dist.all_reduce(x, async_op=True) for x in tensors]
    for k, w in enumerate(works):
        w._done_future.add_done_callback(lambda _f, k=k: order.append(k))
    for w in works:
        w.wait()
    out["forward_order"] = order
    out["forward_values"] = [float(x[-1]) for x in tensors]

    # broadcast's and barrier's futures
    b = torch.full((3,), float(rank))
    bf = dist.broadcast(b, src=0, async_op=True).get_future()
    out["broadcast_future"] = [v.numpy().copy() for v in bf.wait()]
    out["barrier_future"] = dist.barrier(async_op=True).get_future().wait()
    out["is_luwu_work"] = isinstance(work, LuwuWork)

    # saturated sums (inf on rank 0) in flight among ordinary ones, waited in reverse order: each is
    # recomputed exactly on its own, with no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixed = []
        for k in range(4):
            s = torch.ones(777)
            if k % 2 == 0:
                s[5] = float("inf") if rank == 0 else 1.0
                s[700] = 2.5
            mixed.append(s)
        for w in reversed([dist.all_reduce(s, async_op=True) for s in mixed]):
            w.wait()
    out["mixed"] = [s.numpy().copy() for s in mixed]
    out["warnings"] = [str(w.message) for w in caught]
    return out


def test_work_and_future_semantics(tmp_path):
    world = 2
    results = run_ranks(semantics_on_rank, world, tmp_path)
    for _rank, out in enumerate(results):
        assert out["work_type"] == "LuwuWork" and out["is_luwu_work"]
        assert out["wait"] is True and out["completed"]
        assert out["value_is_list_of_outputs"], "the future's value must be the list of output tensors"
        expected = np.arange(6, dtype=np.float32) * sum(r + 1 for r in range(world))
        np.testing.assert_allclose(out["allreduced"], expected, rtol=1e-6)
        np.testing.assert_allclose(out["doubled"], 2 * expected, rtol=1e-6)
        assert out["callbacks_ran"]
        assert out["big_sum"] == world
        assert out["in_flight"] == [float(world * k + sum(range(world))) for k in range(10)]
        assert out["in_flight_sizes_ok"]
        assert out["forward_order"] == list(range(8)), "collectives completed out of call order"
        assert out["forward_values"] == [float(world * k + sum(range(world))) for k in range(8)]
        for v in out["broadcast_future"]:
            np.testing.assert_array_equal(v, np.zeros(3, np.float32))
        assert out["barrier_future"] == []
        for k, m in enumerate(out["mixed"]):
            want = np.full(777, float(world), np.float32)
            if k % 2 == 0:
                want[5], want[700] = np.inf, 2.5 * world
            np.testing.assert_array_equal(m, want)
        assert not [w for w in out["warnings"] if "satur" in w.lower()], out["warnings"]
    assert results[0]["returned_before_done"], "the collective call blocked until the collective completed"


def test_hand_to_waiter_runs_the_assembly_on_the_waiting_thread():
    """A blocked wait() runs a handed-off assembly on its own thread; with no waiter, after a
    timeout or once complete, nothing is handed off (the completion thread keeps it)."""
    import threading
    import time

    from luwu.worker.backend import LuwuWork

    work = LuwuWork("all_reduce", [])
    assert not work.hand_to_waiter(lambda: None), "handed off with no thread waiting"
    ran_on: list[int] = []
    waited: list[object] = []

    def assembly() -> None:
        ran_on.append(threading.get_ident())
        work._complete()

    waiter = threading.Thread(target=lambda: waited.append(work.wait(timeout=30)))
    waiter.start()
    deadline = time.monotonic() + 30
    while work._waiters == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert work.hand_to_waiter(assembly)
    waiter.join(30)
    assert not waiter.is_alive() and waited == [True]
    assert ran_on == [waiter.ident], "the assembly did not run on the waiting thread"
    assert not work.hand_to_waiter(assembly) and ran_on == [waiter.ident], "handed off after completion"

    late = LuwuWork("all_reduce", [])
    try:
        late.wait(timeout=0.01)
        raise AssertionError("wait() returned before the work completed")
    except RuntimeError as e:
        assert "not complete after wait" in str(e)
    assert late._waiters == 0 and not late.hand_to_waiter(lambda: None)
