"""A restarted optimizer node daemon lets the job continue bit-identically: `luwu node` is stopped
with SIGKILL after K steps (a checkpoint taken over its control channel), restarted with
`--restore latest`, and the workers' final parameters equal those of a run never interrupted.
A corrupt checkpoint given to `--restore` is one line on stderr, not a traceback."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
from node_daemon import BIN, SHAPES, NodeDaemon, initial, job_spec, pull_all, train_steps
from test_user_errors import assert_one_line_error

from luwu.dataplane.engine import Engine
from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.dataplane.optimizer.control import ControlClient

STEPS, K = 4, 2


def _segment(tmp, name: str, first: int, last: int, *node_args: str, checkpoint: bool = False,
             periodic: Path | None = None):
    """Steps first..last-1 through a fresh switch, node daemon and worker engines; returns the
    parameters at version `last` (per layer, per worker)."""
    plan = StarPlan(workers=2, nodes=1, mode="tofino", node_pool=64, param_window=64)
    sid = plan.node_session(0)
    with LoopbackSwitch(plan):
        node = NodeDaemon(tmp, plan.node_plan(0).to_json(), name, *node_args)
        engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
        try:
            client = ControlClient(node.control, token=node.token)
            client.add_job(sid, 2, job_spec().to_json(), initial=initial())  # a restored job is bound, not re-added
            train_steps(engines, sid, first, last)
            final = pull_all(engines, sid, last)
            if checkpoint:
                client.checkpoint()
                node.kill()  # SIGKILL: nothing but the checkpoint survives
            if periodic is not None:  # the node's own lazy checkpoint of version `last`: wait for its commit
                for _ in range(600):  # bounded: 60 s
                    if any(periodic.glob("ckpt-*/manifest.json")):
                        break
                    time.sleep(0.1)
                node.kill()
            client.close()
        finally:
            for e in engines:
                e.close()
            node.stop()
    return final


def test_restarted_node_daemon_continues_bit_identically(tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = _segment(tmp_path, "whole", 0, STEPS, "--checkpoint-dir", str(tmp_path / "ckpt-whole"))
    _segment(tmp_path, "first", 0, K, "--checkpoint-dir", str(ckpt), checkpoint=True)
    assert any(ckpt.glob("ckpt-*/manifest.json")), list(ckpt.iterdir())
    resumed = _segment(tmp_path, "resumed", K, STEPS, "--checkpoint-dir", str(ckpt), "--restore", "latest")
    for lid in SHAPES:
        for a, b in zip(whole[lid], resumed[lid]):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), lid
    assert not np.array_equal(whole[0][0], np.concatenate([x.reshape(-1) for x in initial()[0].values()]))

    # the same checkpoint, corrupted: one clear line naming the damaged file
    victim = sorted(p for p in next(ckpt.glob("ckpt-*")).rglob("*") if p.is_file() and p.name != "manifest.json")[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    (tmp_path / "plan.json").write_text((tmp_path / "resumed" / "plan.json").read_text())
    proc = subprocess.run([str(BIN / "luwu"), "node", "--plan", str(tmp_path / "plan.json"), "--state-dir",
                           str(tmp_path / "s2"), "--checkpoint-dir", str(ckpt), "--restore", "latest"],
                          capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(proc, "--restore")
    print(line)


def test_periodic_lazy_checkpoints_restore_bit_identically(tmp_path):
    """`luwu node --checkpoint-every K` (what `luwu demo` runs): no checkpoint request from anyone,
    SIGKILL after K steps, `--restore latest` resumes at version K, bit-identical to a whole run."""
    ckpt = tmp_path / "ckpt"
    whole = _segment(tmp_path, "whole", 0, STEPS)
    _segment(tmp_path, "first", 0, K, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(K), periodic=ckpt)
    manifests = list(ckpt.glob("ckpt-*/manifest.json"))
    assert len(manifests) == 1, manifests
    state = json.loads(manifests[0].read_text())["jobs"][0]["state"]
    assert sorted(layer["version"] for layer in state) == [K] * len(SHAPES), state  # one consistent version
    resumed = _segment(tmp_path, "resumed", K, STEPS, "--checkpoint-dir", str(ckpt), "--restore", "latest")
    for lid in SHAPES:
        for a, b in zip(whole[lid], resumed[lid]):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), lid
