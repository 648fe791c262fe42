"""Engine buffer names (dataplane/engine/shm.py) stay clear of files an earlier process left behind:
pids are reused, and a worker killed before it unlinked its buffers leaves their names in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys

from luwu.dataplane.engine import shm

PID = 4_000_000  # above any real pid: the two processes below share it, as a reused pid would

LEAK = f"""
import os
from luwu.dataplane.engine import shm
os.getpid = lambda: {PID}
for _ in range(4):
    print(shm.ShmBuffer.create(64, prefix="luwu-test-reuse").path)  # never closed: left behind
"""


def test_a_reused_pid_does_not_collide_with_buffers_left_behind(monkeypatch):
    left = subprocess.run([sys.executable, "-c", LEAK], capture_output=True, text=True, check=True,
                          timeout=60).stdout.split()
    mine = []
    try:
        assert len(left) == 4 and all(os.path.exists(p) for p in left)
        monkeypatch.setattr(shm.os, "getpid", lambda: PID)
        mine = [shm.ShmBuffer.create(64, prefix="luwu-test-reuse") for _ in range(4)]
        assert not {b.path for b in mine} & set(left)
        mine[0].view("uint8", 64)[:] = 7  # a working buffer, not just a name
        assert int(mine[0].view("uint8", 64).sum()) == 7 * 64
    finally:
        monkeypatch.undo()
        for b in mine:
            b.close()
        for p in left:
            os.unlink(p)
