"""Failure named in seconds: when the switch or the optimizer node dies (SIGKILL, real processes on
loopback), every pending operation of every worker fails with `LuwuPeerDead` naming the dead
component and its address, after the engine's peer_timeout (5 s) rather than a caller's long
timeout; and a merely slow peer is not called dead.

The tests bound their waits (WAIT_BOUND) but do not assert on the time: they print it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from node_daemon import NodeDaemon, initial, job_spec, train_steps

from luwu.dataplane.engine import Engine
from luwu.dataplane.engine.liveness import DEFAULT_PEER_TIMEOUT, LuwuPeerDead
from luwu.dataplane.engine.transport import switch_name
from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.dataplane.optimizer.control import ControlClient

WAIT_BOUND = 30.0  # s a test waits for the error (the contract is 10 s; the machine is shared)


def _wait_error(handles) -> list[tuple[BaseException, float]]:
    t0 = time.monotonic()
    out = []
    for h in handles:
        with pytest.raises(LuwuPeerDead) as err:
            h.wait(WAIT_BOUND)
        out.append((err.value, time.monotonic() - t0))
    return out


@pytest.mark.parametrize("transport", ["shm", "udp"])
def test_switch_killed_mid_allreduce_is_named_by_every_worker(tmp_path, transport):
    plan = StarPlan(workers=2, mode="tofino", transport=transport)
    with LoopbackSwitch(plan, process=True, log_path=str(tmp_path / "switch.log")) as sw:
        engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
        try:
            first = [e.allreduce(np.ones(1000, np.float32)) for e in engines]
            assert all(np.array_equal(h.wait(60), np.full(1000, 2.0, np.float32)) for h in first)
            pending = [engines[0].allreduce(np.ones(200_000, np.float32))]  # rank 1 never joins: mid-allreduce
            sw.kill()
            pending.append(engines[1].allreduce(np.ones(50, np.float32)))
            for rank, (err, seconds) in enumerate(_wait_error(pending)):
                name = switch_name(plan.worker_plan(rank).wiring)  # each worker's own switch port
                assert err.component == "switch", err
                assert f"switch {name} stopped answering" in str(err), err
                if transport == "shm":  # no ICMP on a ring: the switch's exited pid says it
                    assert f"switch process (pid {sw.pid})" in str(err), err
                print(f"named after {seconds:.1f} s: {err}")
        finally:
            for e in engines:
                e.close()


def test_a_slow_peer_is_not_called_dead(tmp_path):
    """Rank 1 joins the allreduce after more than the peer timeout: silence, but the switch lives."""
    plan = StarPlan(workers=2, mode="tofino")
    with LoopbackSwitch(plan) as _sw:
        engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
        try:
            h0 = engines[0].allreduce(np.arange(100, dtype=np.float32))
            late = threading.Event()
            late.wait(DEFAULT_PEER_TIMEOUT + 1.5)
            h1 = engines[1].allreduce(np.arange(100, dtype=np.float32))
            for h in (h0, h1):
                np.testing.assert_array_equal(h.wait(60), 2 * np.arange(100, dtype=np.float32))
        finally:
            for e in engines:
                e.close()


@pytest.mark.parametrize("victim", ["node", "switch"])
def test_node_or_switch_killed_mid_training_is_named(tmp_path, victim):
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=64, param_window=64)
    sid = plan.node_session(0)
    with LoopbackSwitch(plan, process=True, log_path=str(tmp_path / "switch.log")) as sw:
        node = NodeDaemon(tmp_path, plan.node_plan(0).to_json(), "node")
        engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
        try:
            client = ControlClient(node.control, token=node.token)
            client.add_job(sid, 2, job_spec().to_json(), initial=initial())
            client.close()
            train_steps(engines, sid, 0, 2)
            (node.kill if victim == "node" else sw.kill)()
            pending = [e.pull(sid, lid, 2) for e in engines for lid in (0, 1)]
            errors = _wait_error(pending)
        finally:
            for e in engines:
                e.close()
            node.stop()
    for i, (err, seconds) in enumerate(errors):
        name = switch_name(plan.worker_plan(i // 2).wiring)  # two pulls per worker
        if victim == "node":
            assert err.component == "optimizer node", err
            assert f"optimizer node of session {sid} (behind switch {name}) stopped answering" in str(err), err
        else:
            assert err.component == "switch" and f"switch {name} stopped answering" in str(err), err
        print(f"{victim} named after {seconds:.1f} s: {err}")
