"""Every /dev/shm and temp-dir file a rank of the luwu backend made is gone after it exits, however it
exits: a clean exit (destroy_process_group), an exception escaping the script, or SIGTERM (with
Python's default handler, or the user's own, which still runs). A rank killed by SIGKILL cannot
clean up; its engine daemon removes its shared buffers (its work directory stays). Each rank runs tests/backend/cleanup_rank.py
with TMPDIR set to a directory of the test's own, so its work directory (logs, sockets) is named
there; its shared buffers are /dev/shm/luwu-<its pid>-*, its switch's rings /dev/shm/luwu-sw-<switch pid>-*."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

RANK_SCRIPT = os.path.join(os.path.dirname(__file__), "cleanup_rank.py")
WAIT = 90.0  # s for a rank to reach a state or exit (bounded; the machine is shared)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited (its parent has not reaped it yet)
        return f.read().split(") ")[-1][0] != "Z"


def _leftovers(tmp: str, pids: list[dict]) -> list[str]:
    mine = {str(p[k]) for p in pids for k in ("rank", "switch") if p.get(k)}
    shm = [n for n in os.listdir("/dev/shm") if n.startswith("luwu-")
           and (n.split("-")[1] in mine or (n.startswith("luwu-sw-") and n.split("-")[2] in mine))]
    temp = [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith("luwu-")]
    return shm + temp


@pytest.mark.parametrize("mode", ["clean", "error", "sigterm", "sigterm-user", "sigkill"])
def test_a_rank_leaves_no_files_behind(tmp_path, mode):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LUWU_WORKDIR"}
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1", LUWU_TRANSPORT="shm")
    procs = [subprocess.Popen([sys.executable, RANK_SCRIPT, str(r), mode, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + WAIT
        while not all((tmp_path / f"pids-{r}.json").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate(timeout=30)[0][-3000:] for p in procs if p.poll() is not None]
            time.sleep(0.05)
        pids = [json.loads((tmp_path / f"pids-{r}.json").read_text()) for r in range(2)]
        assert all(os.path.dirname(p["workdir"]) == str(tmp) for p in pids), pids
        assert _leftovers(str(tmp), pids), "the ranks made no files: the test proves nothing"
        (tmp_path / "go").write_text("")  # clean, error: the ranks exit now (not before the check above)
        if mode.startswith("sig"):
            for p in procs:
                p.send_signal(signal.SIGKILL if mode == "sigkill" else signal.SIGTERM)
        outs = [p.communicate(timeout=WAIT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    codes = [p.returncode for p in procs]
    want = {"clean": 0, "error": 1, "sigterm": -signal.SIGTERM, "sigterm-user": 7, "sigkill": -signal.SIGKILL}[mode]
    assert codes == [want, want], (codes, [o[-3000:] for o in outs])
    if mode == "error":
        assert all("the training script failed" in o for o in outs), outs
    deadline = time.monotonic() + 30  # the children (engine daemons, the switch) exit once their rank has
    children = [p[k] for p in pids for k in ("engine", "switch")]
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in children), pids
    left = _leftovers(str(tmp), pids)
    if mode == "sigkill":  # only what others can remove for it: the shared buffers (its daemon), the rings (its switch)
        left = [n for n in left if not n.startswith(str(tmp))]
    assert left == [], f"left behind after a {mode} exit: {left}"
