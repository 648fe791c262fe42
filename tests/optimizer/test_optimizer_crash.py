"""Crash recovery with real processes: an optimizer node killed with SIGKILL in the middle of a
checkpoint, or in the middle of a step, restarts from the last complete checkpoint, continues,
and ends bit-identical to a run that was never interrupted."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from luwu.dataplane.optimizer import OptimizerNode

CHILD = Path(__file__).with_name("optimizer_child.py")
STEPS = 6
LAYERS = 8  # optimizer_child.LAYERS
EVENT_TIMEOUT_S = 180  # bound on waiting for one child event (the machine is shared and slow)


def _start(tmp: Path, out: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(CHILD), "--state", str(tmp / "state"), "--ckpt", str(tmp / "ckpt"),
           "--steps", str(STEPS), "--out", str(tmp / out), *args]
    # stderr to a file: an unread pipe could fill up and block the child (closed with the test's tmp dir)
    err = open(tmp / f"stderr-{time.monotonic_ns()}.txt", "w+b")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
    proc.err_file = err
    return proc


def _read_until(proc: subprocess.Popen, wanted: set[str]) -> list[str]:
    """Read the child's event lines until every line in `wanted` has been seen (raw reads of the
    pipe: a buffered reader would hide lines it has read ahead from select())."""
    lines, missing, pending = [], set(wanted), b""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while missing:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"child events {sorted(missing)} not seen in {EVENT_TIMEOUT_S} s; got {lines[-20:]}")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            proc.wait(30)
            raise AssertionError(f"child ended ({proc.returncode}) before {sorted(missing)}: "
                                 f"{lines[-20:]}\n{_stderr(proc)}")
        pending += chunk
        *done, pending = pending.split(b"\n")
        for raw in done:
            line = raw.decode().strip()
            lines.append(line)
            missing.discard(line)
    return lines


def _stderr(proc: subprocess.Popen) -> str:
    proc.err_file.seek(0)
    return proc.err_file.read().decode(errors="replace")[-4000:]


def _run_to_end(tmp: Path, out: str, *args: str) -> tuple[dict, list[str]]:
    proc = _start(tmp, out, *args)
    try:
        lines = _read_until(proc, {"DONE"})
        assert proc.wait(60) == 0, _stderr(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    with np.load(tmp / out) as z:
        return {k: z[k] for k in z.files}, lines


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # SIGKILL
        assert proc.wait(60) == -9


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        y = b[k]
        assert x.dtype == y.dtype and np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    state, _ = _run_to_end(tmp, "final.npz")
    assert len([k for k in state if k.endswith("/master")]) == LAYERS
    return state


def test_kill_in_the_middle_of_a_checkpoint(tmp_path, uninterrupted):
    # checkpoints of steps 1 and 3; the writer stops after the first file of the second one
    proc = _start(tmp_path, "final.npz", "--checkpoint-steps", "1,3", "--hold-checkpoint", "2", "--rate", "4e6")
    try:
        _read_until(proc, {"CKPT commit ckpt-000001", "HOLD ckpt-000002"})
    finally:
        _kill(proc)
    interrupted = tmp_path / "ckpt" / "ckpt-000002"
    assert list(interrupted.rglob("*.ckpt")) and not (interrupted / "manifest.json").exists()
    assert OptimizerNode.latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "ckpt-000001"
    resumed, lines = _run_to_end(tmp_path, "final.npz", "--checkpoint-steps", "1,3", "--resume")
    assert "RESUMED ckpt-000001 2" in lines
    _assert_bit_identical(uninterrupted, resumed)
    assert not interrupted.exists()  # the interrupted checkpoint is cleaned up after a newer one commits


def test_kill_in_the_middle_of_a_step(tmp_path, uninterrupted):
    # checkpoint of step 2; step 4 stops after its first layer is published, the rest in flight
    proc = _start(tmp_path, "final.npz", "--checkpoint-steps", "2", "--stop-at", "4")
    try:
        lines = _read_until(proc, {"CKPT commit ckpt-000001", "HALF 4"})
    finally:
        _kill(proc)
    published = [ln for ln in lines if ln.startswith("PUB ") and ln.endswith(" 5")]
    assert 1 <= len(published) < LAYERS, lines[-30:]  # mid-step: some layers at version 5, the others not
    resumed, lines = _run_to_end(tmp_path, "final.npz", "--checkpoint-steps", "2", "--resume")
    assert "RESUMED ckpt-000001 3" in lines
    _assert_bit_identical(uninterrupted, resumed)
