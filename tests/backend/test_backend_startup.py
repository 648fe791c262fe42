"""Group creation's start-up sequence (docs/backend.md "Start-up"): rank 0 launches its switch process
before the plan is worked out; when set-up fails after that launch, the process is stopped (no
switch outlives a failed init_process_group) and the other ranks read rank 0's error from the
store instead of waiting for a plan."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from luwu.worker.backend.config import BackendConfig
from luwu.worker.backend.plan_source import PLAN_KEY
from luwu.worker.backend.process_group import LuwuProcessGroup

DEADLINE = 30.0  # s, an upper bound for a child to be gone (never an assertion on speed)


def _switch_processes(workdir) -> set[int]:
    """Pids of this process's children that log to a switch.log under `workdir` (the switch's stderr)."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != os.getpid():
                    continue
            err = os.readlink(f"/proc/{pid}/fd/2")
        except (OSError, ValueError):
            continue
        if err.startswith(str(workdir)) and err.endswith("switch.log"):
            pids.add(int(pid))
    return pids


@pytest.mark.parametrize("engine", ["embedded", "process"])
def test_rank0_set_up_failing_after_the_switch_launch_leaves_no_switch(tmp_path, engine):
    store = dist.HashStore()
    config = BackendConfig(workdir=str(tmp_path / "luwu"), engine=engine)
    with pytest.raises(ValueError, match="1..32 workers"):  # the plan fails after the switch process launched
        LuwuProcessGroup(store, 0, 33, timedelta(seconds=20), config=config)
    assert "rank 0 could not start the luwu switch" in json.loads(store.get(PLAN_KEY))["error"]
    deadline = time.monotonic() + DEADLINE
    while _switch_processes(tmp_path):
        assert time.monotonic() < deadline, f"switch processes left running: {_switch_processes(tmp_path)}"
        time.sleep(0.05)
    assert list(tmp_path.rglob("switch.log")), "rank 0 launched no switch process before the plan"


@pytest.mark.parametrize("eager", ["", "1"])
def test_the_registered_creator_launches_the_children_first_and_stops_them_on_failure(tmp_path, monkeypatch, eager):
    """`init_process_group("luwu")`'s creator launches rank 0's switch process and the engine process
    before importing the process group (worker/backend/startup.py); a set-up failing after that
    stops both. Deferred (the default) the group's first operation raises the error; with
    LUWU_EAGER_START=1 the creator does."""
    from luwu.worker import backend
    from luwu.worker.backend import LuwuError

    monkeypatch.setenv("LUWU_WORKDIR", str(tmp_path / "luwu"))
    monkeypatch.setenv("LUWU_ENGINE", "process")
    monkeypatch.setenv("LUWU_EAGER_START", eager)
    store = dist.HashStore()
    if eager:
        with pytest.raises(ValueError, match="1..32 workers"):
            backend._create_process_group(store, 0, 33, timedelta(seconds=20))
    else:
        pg = backend._create_process_group(store, 0, 33, timedelta(seconds=20))
        with pytest.raises(LuwuError, match="1..32 workers") as err:
            pg.barrier()
        assert isinstance(err.value.__cause__, ValueError), repr(err.value.__cause__)
    logs = list(tmp_path.rglob("switch.log"))
    assert len(logs) == 1, f"expected one switch process launched, logs: {logs}"
    assert list(logs[0].parent.glob("engine-*.log")), "the engine process was not launched in the same workdir"
    deadline = time.monotonic() + DEADLINE
    while _switch_processes(tmp_path):
        assert time.monotonic() < deadline, f"switch processes left running: {_switch_processes(tmp_path)}"
        time.sleep(0.05)
    from luwu.worker.engine_link import EngineHost

    assert EngineHost._current is None or EngineHost._current.proc.poll() is not None
