"""A training process for the crash tests: runs an optimizer node on deterministic gradients,
reports events on stdout (one per line, flushed), and saves the final state.

    python optimizer_child.py --state DIR --ckpt DIR --steps K [--checkpoint-steps 1,3]
        [--rate BYTES_PER_S] [--resume] [--stop-at STEP] [--hold-checkpoint SEQ] --out FILE.npz

--resume restores the newest committed checkpoint and continues from its version.
--stop-at: the first layer published at version STEP + 1 stops the publish thread (prints HALF):
    the step's other layers are still in the pipeline when the parent kills the process.
--hold-checkpoint: the checkpoint writer stops after the first file of checkpoint SEQ (prints
    HOLD): the checkpoint is half written when the parent kills the process.
Either way the process exits by itself after STOP_WAIT_S if nobody kills it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from optimizer_reference import initial_values, model_layers, summed_grad

from luwu.dataplane.optimizer import JobSpec, NodeConfig, OptimizerNode, OptimizerSpec, ScheduleSpec

LAYERS = 8
STOP_WAIT_S = 120  # a stopped child exits by itself if nobody kills it


def spec() -> JobSpec:
    layers = model_layers(LAYERS, rows=96, cols=80)
    opt = OptimizerSpec("adamw", lr=1e-2, weight_decay=0.05, clip_grad_norm=1.0,
                        schedule=ScheduleSpec("cosine", warmup_steps=2, total_steps=10))
    return JobSpec("crash", opt, layers, "bf16", initial_values(layers, seed=11))


_SAY_LOCK = threading.Lock()


def say(*words) -> None:
    # one write per line under a lock: the publish and checkpoint listeners run on different
    # threads, and print() writes each word separately, so lines could interleave
    line = " ".join(str(w) for w in words) + "\n"
    with _SAY_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checkpoint-steps", default="")
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--budget", type=int, default=240_000)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--hold-checkpoint", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = NodeConfig(a.state, ram_budget=a.budget, max_shard_elems=4096, checkpoint_dir=a.ckpt,
                     checkpoint_rate=a.rate, checkpoint_chunk=4096)
    js = spec()
    if a.resume:
        path = OptimizerNode.latest_checkpoint(a.ckpt)
        node = OptimizerNode.restore(cfg, path)
        start = node.version("crash", 0)
        say("RESUMED", path.name, start)
    else:
        node = OptimizerNode(cfg)
        node.add_job(js)
        start = 0
    def on_publish(job, lid, v):
        say("PUB", lid, v)
        if a.stop_at is not None and v == a.stop_at + 1:
            say("HALF", a.stop_at)
            time.sleep(STOP_WAIT_S)
            os._exit(3)

    def on_checkpoint(event, info):
        name = Path(info["checkpoint"]).name
        say("CKPT", event, name)
        if event == "file" and a.hold_checkpoint is not None and name == f"ckpt-{a.hold_checkpoint:06d}":
            say("HOLD", name)
            time.sleep(STOP_WAIT_S)
            os._exit(3)

    node.add_listener(on_publish)
    node.add_checkpoint_listener(on_checkpoint)
    ck_steps = {int(s) for s in a.checkpoint_steps.split(",") if s}
    backward = list(reversed(js.layers))
    for step in range(start, a.steps):
        if step in ck_steps:
            node.request_checkpoint(step)
            say("REQ", step)
        for ly in backward:
            node.submit_gradient("crash", ly.layer_id, step, summed_grad(ly, step, 2), contributors=2)
        for ly in js.layers:
            node.params("crash", ly.layer_id, step + 1, timeout=120)
        say("STEP", step)
    states = {}
    for ly in js.layers:
        st = node.layer_state("crash", ly.layer_id)
        for k, v in st.items():
            states[f"{ly.layer_id}/{k}"] = np.asarray(v)
    node.close(timeout=120)
    tmp = a.out.with_suffix(".tmp.npz")
    np.savez(tmp, **states)
    os.replace(tmp, a.out)
    say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
