"""The loopback switch process and the engine daemon defer loading their compiled kernels (numba)
until the job's start-up is over, so that the loading thread does not compete with it (docs/backend.md
"Start-up"): the switch process until `LoopbackSwitch.load_kernels` (or `wait_kernels`), the engine
daemon until its first completed operation; both still load them after that."""

from __future__ import annotations

import time

import numpy as np
import pytest

from luwu.dataplane import kernels
from luwu.dataplane.engine.client import EngineClient
from luwu.dataplane.engine.daemon import KERNELS_DEFER as ENGINE_KERNELS_DEFER
from luwu.dataplane.loopback import KERNELS_DEFER, LoopbackSwitch, StarPlan

DEADLINE = 60.0  # s, an upper bound for a load to show (never an assertion on speed)

pytestmark = pytest.mark.skipif(not kernels.numba_available(), reason="numba is not installed")


def _numba_mapped(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "llvmlite" in f.read()  # numba's LLVM binding: mapped once its import has begun


def _until_mapped(pid: int) -> None:
    deadline = time.monotonic() + DEADLINE
    while not _numba_mapped(pid):
        assert time.monotonic() < deadline, f"process {pid} never loaded numba"
        time.sleep(0.05)


def test_the_switch_process_loads_its_kernels_when_told(monkeypatch):
    monkeypatch.setenv("LUWU_KERNELS", "auto")
    started = time.monotonic()
    with LoopbackSwitch(StarPlan(workers=2), process=True) as sw:
        early = _numba_mapped(sw.pid)
        if time.monotonic() - started < KERNELS_DEFER:  # still within its deferral: nothing loaded yet
            assert not early, "the switch process loaded numba during its start-up"
        sw.load_kernels()
        _until_mapped(sw.pid)
        assert sw.wait_kernels(DEADLINE) is True


def test_the_engine_daemon_loads_its_kernels_after_its_first_operation(tmp_path, monkeypatch):
    monkeypatch.setenv("LUWU_KERNELS", "auto")
    plan = StarPlan(workers=1)
    started = time.monotonic()
    with LoopbackSwitch(plan):
        proc, control, log = EngineClient.launch(None, str(tmp_path))
        client = EngineClient.connect(proc, control, log, DEADLINE)
        try:
            client.open(plan.worker_plan(0), DEADLINE)
            if time.monotonic() - started < ENGINE_KERNELS_DEFER:
                assert not _numba_mapped(proc.pid), "the engine daemon loaded numba before any operation"
            buf = client.buffer(1 << 16)
            x = buf.view(np.float32, 4)
            x[:] = [1, 2, 3, 4]
            client.allreduce(buf, x).wait(DEADLINE)
            assert list(x) == [1, 2, 3, 4]
            _until_mapped(proc.pid)
        finally:
            client.close()
            proc.wait(DEADLINE)


def test_an_embedded_engine_started_with_an_event_loads_its_kernels_once_it_is_set(monkeypatch):
    """The torch backend's embedded engine (open_engine(defer_kernels=True)): numba's import would hold
    the rank's own GIL during the group's start-up and first collective, so the load waits for
    `startup_over()` (the first collective done); the engine works meanwhile, on the reference."""
    import threading

    from luwu.dataplane import quantize
    from luwu.dataplane.engine.engine import KERNELS_DEFER as EMBEDDED_KERNELS_DEFER
    from luwu.worker.engine_link import open_engine

    monkeypatch.setenv("LUWU_KERNELS", "auto")
    loaded = threading.Event()
    monkeypatch.setattr(quantize, "warm_up", loaded.set)  # what Engine.start loads, recorded instead
    plan = StarPlan(workers=1)
    started = time.monotonic()
    with LoopbackSwitch(plan):
        link = open_engine("embedded", plan.worker_plan(0), "", defer_kernels=True)
        try:
            x = np.array([1, 2, 3, 4], dtype=np.float32)
            out = link.allreduce(x).wait(DEADLINE)
            assert list(out) == [1, 2, 3, 4]
            if time.monotonic() - started < EMBEDDED_KERNELS_DEFER:
                assert not loaded.is_set(), "the embedded engine loaded its kernels before startup_over()"
            link.startup_over()
            assert loaded.wait(DEADLINE), "the embedded engine never loaded its kernels after startup_over()"
        finally:
            link.close()
