"""Test helper: a real `luwu node` daemon in a child process, and a small job that worker engines
train through it (pull every layer, push every layer's gradient, per step).

Used by the failure tests (kill -9 the node or the switch) and the restore test (stop the node
after K steps, restart it with `--restore latest`).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from luwu.dataplane.optimizer import JobSpec, LayerSpec, OptimizerSpec

BIN = Path(sys.executable).parent
READY_TIMEOUT = 90.0  # s for the node to print its ready line (shared, slow machine)
SHAPES = {0: {"w": (24, 16), "b": (16,)}, 1: {"w": (16, 5)}}


def job_spec(job_id: str = "restore") -> JobSpec:
    opt = OptimizerSpec("adamw", lr=0.01, weight_decay=0.1)
    return JobSpec(job_id, opt, [LayerSpec(lid, shapes, frozenset({"b"} & set(shapes))) for lid, shapes in SHAPES.items()],
                   served_dtype="fp32")


def initial(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {lid: {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} for lid, shapes in SHAPES.items()}


def grad(rank: int, step: int, lid: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 10 * step + lid)
    return np.concatenate([(rng.standard_normal(s) * 0.1).astype(np.float32).reshape(-1)
                           for s in SHAPES[lid].values()])


class NodeDaemon:
    """`luwu node --plan FILE --state-dir ... --control unix:...` as a child; kill() is SIGKILL."""

    def __init__(self, tmp: Path, plan_json: str, name: str, *extra: str):
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "plan.json").write_text(plan_json)
        self.control = f"unix:{self.dir}/control.sock"
        self.token = "node-control-token"  # the control channel takes only authenticated clients
        (self.dir / "control.token").write_text(self.token)
        self.log_path = self.dir / "node.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(BIN / "luwu"), "node", "--plan", str(self.dir / "plan.json"), "--state-dir", str(self.dir / "state"),
             "--ram-budget", "64MiB", "--control", self.control, "--control-token-file", str(self.dir / "control.token"),
             *extra],
            stdout=subprocess.PIPE, stderr=self.log, env=dict(os.environ, OMP_NUM_THREADS="1", LUWU_NO_BACKEND="1"))
        self.ready = self._ready_line()

    def _ready_line(self) -> dict:
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + READY_TIMEOUT
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                raise AssertionError(f"luwu node did not get ready: {self.log_path.read_text()[-3000:]}")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    continue
                buf += chunk
        return json.loads(buf.split(b"\n")[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def train_steps(engines, sid: int, first: int, last: int, timeout: float = 60.0) -> None:
    """Steps first..last-1: every worker pulls every layer at the step's version, then pushes its
    gradients (last layer first, as a backward pass does)."""
    for step in range(first, last):
        for lid in SHAPES:
            for e in engines:
                e.pull(sid, lid, step).wait(timeout)
        pushes = [e.push(sid, lid, grad(r, step, lid)) for lid in reversed(list(SHAPES)) for r, e in enumerate(engines)]
        for h in pushes:
            h.wait(timeout)


def pull_all(engines, sid: int, version: int, timeout: float = 60.0) -> dict[int, list[np.ndarray]]:
    return {lid: [e.pull(sid, lid, version).wait(timeout) for e in engines] for lid in SHAPES}
