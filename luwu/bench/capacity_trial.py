"""The processes of one `luwu bench capacity` trial: `python -m luwu.bench.capacity_trial SPEC ROLE [RANK]`.

Roles:

* ``net``: the luwu deployment on loopback (`LocalNetwork`: the software switch in its own process,
  the optimizer node(s) in this one, with `node_memory` bytes of RAM). Prints
  ``{"ready": true, "networks": [...]}``, waits for a line on stdin, then prints the node's
  statistics, its disk traffic (/proc/self/io) and its peak RSS, and exits. Not capped.
* ``luwu``, ``ddp``, ``fsdp``: one training worker (rank RANK of 2) that builds the model (FSDP2: on
  the meta device, sharded, then materialised, unless `fsdp_init` is "eager"), trains
  `steps` steps and prints ``{"done": true, ...}`` with its step times, losses, parameters and
  peak RSS (VmHWM: its own, and its own plus the processes it started, e.g. a luwu worker's engine
  daemon). Run capped (memcap.py); a MemoryError is reported as ``{"oom": "..."}``.

Every message is one JSON line on stdout; tracebacks go to stderr (the trial's log).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from luwu.bench.memcap import proc_io, vm_hwm
from luwu.dataplane.process.children import descendants


def _say(**msg: object) -> None:
    print(json.dumps(msg, default=float), flush=True)


def _tree_hwms() -> list[int]:
    """Peak RSS of this process, then of each process it started (a luwu worker's engine daemon)."""
    return [vm_hwm("self"), *(vm_hwm(p) for p in descendants(os.getpid()))]


def _batch(spec: dict, rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(int(spec["model"]["seed"]) * 7919 + rank * 104729 + step)
    return torch.randint(0, int(spec["model"]["vocab"]), (int(spec["batch"]), int(spec["model"]["seq"])), generator=g)


def _build_luwu_model(cfg: dict) -> tuple[Any, str]:
    """The model a luwu worker wraps: built on the meta device, so no worker ever holds it whole
    (ModelInNetwork initialises it unit by unit on the rank handing it over: materialize.py)."""
    from luwu.bench.capacity_model import build

    return build(cfg, meta=True), "meta"


def _train(spec: dict, role: str, rank: int) -> dict:
    import torch

    from luwu.bench.capacity_model import build, loss_of, materialise

    torch.set_num_threads(int(spec.get("threads", 1)))
    cfg, world, steps, backend = spec["model"], int(spec["world"]), int(spec["steps"]), spec["model"]["backend"]
    lr = float(spec.get("lr", 1e-4))
    close = []
    train_model: torch.nn.Module
    opt: torch.optim.Optimizer | None
    if role == "luwu":
        import luwu
        from luwu.train import ModelInNetwork

        model, init = _build_luwu_model(cfg)
        network = json.loads(Path(spec["networks"]).read_text())[rank]
        mnn = ModelInNetwork(model, optimizer=luwu.AdamW(lr=lr), network=network, engine="process",
                             served_dtype=spec.get("served_dtype", "bf16"))
        close.append(mnn.close)
        train_model, opt = mnn, None
    else:
        import torch.distributed as dist

        from luwu.bench.rendezvous import init_group

        init_group("gloo", spec["store"], rank, world)
        close.append(dist.destroy_process_group)
        meta = role == "fsdp" and spec.get("fsdp_init", "meta") == "meta"  # built sharded: never whole here
        model, init = build(cfg, meta=meta), ("meta" if meta else "eager")
        if role == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            train_model = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            blocks: Any = model.get_submodule("model.layers" if backend == "hf" else "layers")
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if meta:
                materialise(model, backend)
            train_model = model
        opt = torch.optim.AdamW(train_model.parameters(), lr=lr)
    _say(built=True, rank=rank, rss_bytes=vm_hwm("self"), init=init)
    times, losses = [], []
    try:
        for step in range(steps):
            ids = _batch(spec, rank, step)
            t0 = time.perf_counter()
            loss = loss_of(train_model, ids, backend)
            loss.backward()
            if opt is None:
                mnn.step()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            _say(step=step, rank=rank, seconds=times[-1], loss=losses[-1])
        report = {"rank": rank, "seconds": times, "losses": losses, "tokens_per_step": int(ids.numel()),
                  "peak_rss_bytes": vm_hwm("self"), "peak_rss_each_bytes": _tree_hwms()}
        if opt is None:
            report["mnn_memory"] = mnn.report().get("memory")
    finally:
        del train_model, opt, model  # DDP/FSDP before their group (luwu/demo/worker.py _leave_group says why)
        gc.collect()
        for fn in close:
            fn()
    return report


def _net(spec: dict) -> None:
    from luwu.worker.model_in_network.local import LocalNetwork

    io0 = proc_io("self")
    with LocalNetwork(int(spec["world"]), int(spec.get("nodes", 1)), mode="jumbo", state_dir=spec["state_dir"],
                      node_ram=int(spec["node_memory"])) as net:
        networks = [net.network(r).to_json() for r in range(int(spec["world"]))]
        Path(spec["networks"]).write_text(json.dumps(networks))
        _say(ready=True, networks=spec["networks"], switch_pid=net.switch.pid)
        sys.stdin.readline()  # the trial is over (or EOF: the bench is gone)
        stats = net.node_stats()
    io1 = proc_io("self")
    io = {k: io1.get(k, 0) - io0.get(k, 0) for k in ("read_bytes", "write_bytes", "rchar", "wchar")}
    node_io = [s["node"].get("io", {}) for s in stats]
    _say(event="done", proc_io=io, node_io=node_io, peak_rss_bytes=vm_hwm("self"),
         node_stats=[{"published": s["node"]["node"].get("published"), "store": s["node"].get("store")} for s in stats])


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    role = argv[1]
    if role == "net":
        _net(spec)
        return 0
    rank = int(argv[2])
    try:
        report = _train(spec, role, rank)
    except MemoryError as e:  # RLIMIT_AS (or an allocator that says so): the size does not fit
        traceback.print_exc()
        _say(oom=f"MemoryError: {e}", rank=rank, peak_rss_bytes=vm_hwm("self"))
        return 3
    except RuntimeError as e:  # torch reports a failed allocation as RuntimeError ("can't allocate memory")
        if "alloc" not in str(e).lower():
            raise
        traceback.print_exc()
        _say(oom=f"RuntimeError: {str(e)[:300]}", rank=rank, peak_rss_bytes=vm_hwm("self"))
        return 3
    _say(done=True, **report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
