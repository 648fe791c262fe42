"""The optimizer node process stays within its RAM budget (issue 26): a real `luwu node` daemon
with a 16 MiB budget trains a job whose optimizer state is 12x that through two worker engines,
and its peak RSS (VmHWM in /proc/<pid>/status, the daemon's own process) stays below the budget
plus `NODE_RSS_OVERHEAD`, the fixed part every node process holds (Python, torch, numba, its
rings). A node that kept the state in RAM would pass that bound by 190 MiB of state.

The budget is also below what the node used to accept for these layers (twice a 4M-element
shard's record, 48 MiB, plus two served copies): the node now cuts the job's shards smaller
instead of refusing it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from node_daemon import NodeDaemon

from luwu.dataplane.engine import Engine
from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.dataplane.optimizer import JobSpec, LayerSpec, OptimizerSpec
from luwu.dataplane.optimizer.control import ControlClient
from luwu.dataplane.optimizer.spec import NODE_RSS_OVERHEAD

BUDGET = 16 << 20
LAYERS, NUMEL, STEPS = 16, 1 << 20, 3  # 16 x 1M parameters: 192 MiB of AdamW state (master, exp_avg, exp_avg_sq)
WAIT = 120.0


def _status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc/<pid>/status (Linux)")
def test_the_node_process_peak_rss_stays_within_its_budget_plus_the_fixed_overhead(tmp_path):
    plan = StarPlan(workers=2, nodes=1)
    sid = plan.node_session(0)
    layers = [LayerSpec(i, {"w": (NUMEL,)}) for i in range(LAYERS)]
    spec = JobSpec("rss", OptimizerSpec("adamw", lr=1e-3), layers, served_dtype="bf16")
    grad = np.full(NUMEL, 0.01, np.float32)
    with LoopbackSwitch(plan):
        node = NodeDaemon(tmp_path, plan.node_plan(0).to_json(), "node", "--ram-budget", str(BUDGET))
        engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
        try:
            client = ControlClient(node.control, token=node.token)
            client.add_job(sid, 2, spec.to_json(), initial=3)  # seeded on the node: no 64 MiB of initial values
            for step in range(STEPS):
                for ly in layers:
                    for e in engines:
                        e.pull(sid, ly.layer_id, step).wait(WAIT)
                pushes = [e.push(sid, ly.layer_id, grad) for ly in reversed(layers) for e in engines]
                for h in pushes:
                    h.wait(WAIT)
            pulled = [e.pull(sid, 0, STEPS).wait(WAIT) for e in engines]
            mem = _status(node.proc.pid)
            stats = client.call({"op": "stats"})["stats"]["node"]
            client.close()
        finally:
            for e in engines:
                e.close()
            node.stop()
    state = 12 * NUMEL * LAYERS
    print(f"node peak RSS {mem['VmHWM'] / 2**20:.0f} MiB ({ {k: round(v / 2**20) for k, v in mem.items()} } MiB), "
          f"budget {BUDGET >> 20} MiB, {stats['store']['shards']} shards")
    assert state >= 12 * BUDGET
    assert stats["store"]["writebacks"] > 0 and stats["io"]["read_bytes"] >= STEPS * state // 2  # out of core
    assert stats["store"]["shards"] > LAYERS  # cut below the 4M-element default to fit the budget
    assert stats["node"]["published"] == STEPS * LAYERS and np.array_equal(pulled[0], pulled[1])
    assert mem["VmHWM"] <= BUDGET + NODE_RSS_OVERHEAD, (
        f"node peak RSS {mem['VmHWM'] >> 20} MiB > budget {BUDGET >> 20} MiB + overhead {NODE_RSS_OVERHEAD >> 20} MiB "
        f"({ {k: v >> 20 for k, v in mem.items()} } MiB)")
