"""`LoopbackSwitch.prestart`: the switch process launched before its plan is known (what the torch
backend's rank 0 does first thing) is the one the next start uses, it switches, a spare that died
waiting is replaced, and one nobody took is stopped by `discard_prestarted`."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from luwu.dataplane.engine import Engine
from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.dataplane.loopback.launch import _spare

DEADLINE = 30.0  # s, an upper bound for any wait (never an assertion on speed)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def _sum_through(plan: StarPlan) -> list[float]:
    engines = [Engine(plan.worker_plan(r)).start() for r in range(plan.workers)]
    try:
        handles = [e.allreduce(np.full(100, r + 1, np.float32), "sum") for r, e in enumerate(engines)]
        return [float(h.wait(DEADLINE)[0]) for h in handles]
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("transport", ["shm", "udp"])
def test_start_takes_the_prestarted_process(tmp_path, transport):
    log = str(tmp_path / "switch.log")
    LoopbackSwitch.prestart(log)
    spare = _spare[log].pid
    LoopbackSwitch.prestart(log)  # idempotent while it lives
    assert _spare[log].pid == spare
    plan = StarPlan(workers=2, transport=transport)
    with LoopbackSwitch(plan, process=True, log_path=log) as sw:
        assert sw.pid == spare and log not in _spare
        assert _sum_through(plan) == [3.0, 3.0]


def test_a_spare_that_died_is_replaced(tmp_path):
    log = str(tmp_path / "switch.log")
    LoopbackSwitch.prestart(log)
    dead = _spare[log]
    dead.kill()
    dead.wait(DEADLINE)
    plan = StarPlan(workers=1)
    with LoopbackSwitch(plan, process=True, log_path=log) as sw:
        assert sw.pid != dead.pid and sw.alive()
        assert _sum_through(plan) == [1.0]


def test_discard_stops_a_spare_nobody_took(tmp_path):
    log = str(tmp_path / "switch.log")
    LoopbackSwitch.prestart(log)
    pid = _spare[log].pid
    LoopbackSwitch.discard_prestarted(log)
    assert log not in _spare
    deadline = time.monotonic() + DEADLINE
    while not _exited(pid):
        assert time.monotonic() < deadline, f"the discarded switch process {pid} is still running"
        time.sleep(0.01)
    LoopbackSwitch.discard_prestarted(log)  # nothing left: a no-op
    assert os.path.exists(log)


def test_a_clean_stop_leaves_no_log_of_its_own(tmp_path, monkeypatch):
    """A switch process whose log path luwu chose (the engine bench, local tools) removes that log
    after a clean stop; one killed keeps it for whoever looks into why; a caller's path is theirs."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    plan = StarPlan(workers=1)
    with LoopbackSwitch(plan, process=True) as sw:
        own = sw.log_path
        assert os.path.dirname(own) == str(tmp_path) and os.path.exists(own)
        assert _sum_through(plan) == [1.0]
    assert not os.path.exists(own), "a clean stop left its log behind"

    killed = LoopbackSwitch(StarPlan(workers=1), process=True).start()
    killed.kill()
    killed.stop()
    assert os.path.exists(killed.log_path), "a killed switch's log is evidence: keep it"

    theirs = str(tmp_path / "mine.log")
    with LoopbackSwitch(StarPlan(workers=1), process=True, log_path=theirs):
        pass
    assert os.path.exists(theirs)
