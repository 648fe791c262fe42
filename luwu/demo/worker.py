"""One training worker of the demo, as its own process: `python -m luwu.demo.worker SPEC.json RANK`.

Mode "mnn" trains the model with ModelInNetwork (parameters and AdamW on the optimizer node,
gradients summed by the switch); mode "ddp" trains the same model on the same data with
DistributedDataParallel over Gloo and torch.optim.AdamW (the baseline). The model is the demo's GPT
(model.py) or an OPT (hf_model.py): built on the meta device in mode "mnn" (the network initialises
it), whole in mode "ddp" with the values the network gives it. The report carries the process's own
peak RSS (`vm_hwm_bytes`, rss.py). The worker writes one
JSON object per line on stdout: `{"event": "metrics", "address": HOST:PORT}` when the spec asks
for a Prometheus endpoint, `{"event": "step", ...}` per step, then `{"event": "done", "report":
...}` (or `{"event": "error", ...}`); the launcher (launch.py) reads them.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
DDP_TIMEOUT = 300.0  # s the DDP baseline's rendezvous or a gloo collective may take before the rank fails, named


def _emit(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _optimizer_groups(model, weight_decay: float):
    """torch.optim.AdamW groups with the node's `no_decay="auto"` rule: tensors of fewer than two
    dimensions (norms, biases) get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _ddp_state_bytes(model, optimizer) -> dict:
    params = _tensor_bytes(p for p in model.parameters())
    grads = _tensor_bytes(p.grad for p in model.parameters())
    state = _tensor_bytes(v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel"))
    return {"params": params, "grads": grads, "optimizer_state": state, "total": params + grads + state}


def _build(spec: dict, vocab: int, meta: bool):
    """The spec's model (spec["model"]["kind"]: "gpt", the demo's own, or "opt", hf_model.py) and
    the forward that gives its logits; `meta`: an OPT model on the meta device (ModelInNetwork
    initialises it), else built normally with the values the network would give it."""
    m = dict(spec["model"])
    kind, seed = m.pop("kind", "gpt"), int(spec["seed"])
    if kind == "gpt":
        from .model import GPTConfig, build

        cfg = GPTConfig(vocab=m.pop("vocab", None) or vocab, **m)
        return build(cfg, seed), cfg.context, (lambda runner, x: runner(x))
    from . import hf_model

    model = hf_model.build(m["config"], meta=meta, seed=seed, checkpointing=bool(m.get("checkpointing")))
    if not meta:
        hf_model.network_initial_values(model, m["config"], seed)
    return model, int(m["context"]), (lambda runner, x: runner(input_ids=x, use_cache=False).logits)


def train(spec: dict, rank: int) -> dict:
    import torch

    from .data import CharCorpus, shard
    from .model import loss_fn
    from .rss import vm_hwm_bytes

    torch.set_num_threads(1)
    world = int(spec["workers"])
    corpus = CharCorpus.load(spec.get("corpus"))
    meta = spec["mode"] == "mnn" and spec["model"].get("kind") == "opt"  # never whole on a luwu worker
    model, context, forward = _build(spec, corpus.vocab, meta)
    built_rss = vm_hwm_bytes()
    steps, batch, seed = int(spec["steps"]), int(spec["batch"]), int(spec["seed"])
    start = int(spec.get("start_step", 0))  # > 0: resuming from optimizer nodes restored at that version
    runner: torch.nn.Module  # the model as trained: ModelInNetwork (mode "mnn") or DDP around it
    mnn: ModelInNetwork | None = None  # set in mode "mnn" only
    opt: torch.optim.Optimizer | None = None  # set in mode "ddp" only
    if spec["mode"] == "mnn":
        from luwu.worker import metrics as worker_metrics
        from luwu.worker.model_in_network import AdamW, ModelInNetwork

        if spec.get("metrics"):  # HOST:0: ModelInNetwork's engine serves /metrics on a port of its own
            os.environ["LUWU_METRICS"] = spec["metrics"]

        network, watch = _network(spec, rank)
        store = None
        if spec.get("store"):  # rail-only: the NVLink channel's ranks meet in this file (and the barriers use it)
            from torch.distributed import FileStore

            store = FileStore(spec["store"], world)
        runner = mnn = ModelInNetwork(model, AdamW(lr=spec["lr"], weight_decay=spec["weight_decay"]), network,
                                      served_dtype=spec.get("served_dtype", "bf16"),
                                      grad_format=spec.get("grad_format"),
                                      engine=spec.get("engine", "process"), keep_last=int(spec.get("keep_last", 1)),
                                      prefetch=int(spec.get("prefetch", 1)), start_version=start, store=store,
                                      p2p_host=spec.get("p2p_host", "127.0.0.1"), seed=int(spec["seed"]))
        served = worker_metrics.address()
        if served is not None:
            _emit({"event": "metrics", "rank": rank, "address": f"{served[0]}:{served[1]}"})
    elif spec["mode"] == "ddp":
        watch = None
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        # SIGTERM's default again: a DDP rank has no engine to close, and a Python handler would never run
        # while a gloo call blocks (a stopped or orphaned rank has to end even there)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=float(spec.get("ddp_timeout", DDP_TIMEOUT))))
        runner = DistributedDataParallel(model)
        opt = torch.optim.AdamW(_optimizer_groups(model, spec["weight_decay"]), lr=spec["lr"])
    else:
        raise ValueError(f"mode {spec['mode']!r}: 'mnn' or 'ddp'")
    report: dict = {"rank": rank, "mode": spec["mode"], "losses": [], "step_seconds": [], "compute_seconds": [],
                    "start_step": start, "built_on": "meta" if meta else "cpu", "built_vm_hwm_bytes": built_rss}
    ddp_state = None
    try:
        for step in range(start, steps):  # the batches are a function of the step: a resumed run sees the same
            x, y = shard(*corpus.batch(step, batch, context, seed), rank, world)
            t0 = time.perf_counter()
            waited0 = sum(mnn.wait_seconds.values()) if mnn is not None else 0.0
            loss = loss_fn(forward(runner, x), y)
            loss.backward()
            if mnn is not None:
                mnn.step()
            elif opt is not None:
                opt.step()
                if step == min(1, steps - 1):  # the optimizer state exists after the first step
                    ddp_state = _ddp_state_bytes(model, opt)
                opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            # the worker's own time this step (forward, backward, staging the gradient, the loss): the step
            # less what it spent blocked on the network; the demo's plan prediction takes it from the first steps
            # (DDP's step overlaps its allreduce with backward: no such split, None)
            compute = dt - (sum(mnn.wait_seconds.values()) - waited0) if mnn is not None else None
            value = loss.item()
            report["losses"].append(value)
            report["step_seconds"].append(dt)
            report["compute_seconds"].append(compute)
            _emit({"event": "step", "rank": rank, "step": step, "loss": value, "tokens": int(x.numel()),
                   "seconds": dt, "compute_seconds": compute,
                   "pushed_bytes": int(getattr(runner, "stats", {}).get("pushed_bytes", 0))
                   if spec["mode"] == "mnn" else 0})
        report["vm_hwm_bytes"] = vm_hwm_bytes()  # this process's own peak RSS (the embedded engine's included)
        if mnn is not None:
            report["mnn"] = mnn.report()
            report["setup_memory"] = mnn.setup_memory
            if spec.get("gather"):
                report["params"] = {k: v.reshape(-1).tolist() for k, v in mnn.gather().items()}
        else:
            from luwu.worker.model_in_network.memory import peak_rss_bytes

            report["ddp"] = {"state_bytes": ddp_state, "peak_rss_bytes": peak_rss_bytes()}
            if spec.get("gather"):
                report["params"] = {k: v.detach().reshape(-1).tolist() for k, v in model.named_parameters()}
    finally:
        if watch is not None:
            watch.stop()
            report["controller_events"] = [{"time": t, "state": st, "message": m} for t, st, m in watch.events]
        if mnn is not None:
            mnn.close()
        else:
            group = _leave_group()  # held here until DDP is gone (_leave_group says why)
            del runner  # DDP, and with it its reducer's hold on the group
            gc.collect()  # whatever of DDP a reference cycle kept: its reducer would free the group later
            del group  # the last holder, from Python: torch releases the GIL before destroying the group
    return report


def _leave_group():
    """`destroy_process_group()`, handing back the default (gloo) group for the caller to free once
    DDP is gone.

    torch destroys a gloo group by joining its worker threads. Freed with DDP's reducer (its last
    holder once DDP goes) that happens with the GIL held, while a gloo thread may still be freeing
    its last work, whose saved thread-local state needs the GIL: both wait for ever. The caller frees
    DDP first and the group last, from Python, whose holder releases the GIL before destroying it,
    so the gloo thread takes the GIL, ends, and the join returns. Seen as a rare
    hang of the demo's DDP baseline at exit (issue 26: 2 runs in 14 of the OPT baseline alone on the
    loaded 2-core machine, 1 in 24 without activation checkpointing; py-spy: `~Reducer -> ~ProcessGroupGloo -> thread::join` in the main thread,
    `runLoop -> ~AsyncWork -> ~ThreadLocalState -> gil_scoped_acquire` in gloo's)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    dist.destroy_process_group()
    return group


def _network(spec: dict, rank: int):
    """This rank's JobNetwork (given in the spec, or from the controller by JoinJob) and, with a
    controller, the watch that reports its death as a warning event (training goes on without it)."""
    from luwu.worker.model_in_network import JobNetwork

    if "networks" in spec:
        return JobNetwork.from_json(spec["networks"][rank]), None
    from luwu.controller.client import ControllerClient
    from luwu.dataplane.loopback import free_udp_port

    ctl = spec["controller"]
    client = ControllerClient(ctl["address"], ctl["token"])
    try:
        endpoint, info = client.join_job(ctl["job_id"], rank, f"127.0.0.1:{free_udp_port()}")
    finally:
        client.close()
    from luwu.controller.watch import ControllerWatch

    watch = ControllerWatch(ctl["address"], ctl["job_id"], ctl["token"],
                            on_change=lambda state, msg: _emit({"event": "warning", "rank": rank, "state": state,
                                                                "message": msg}))
    network = JobNetwork.from_controller(endpoint, info, ctl["node_controls"], job_id=ctl["job_id"],
                                         job_token=ctl["token"])
    return network, watch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m luwu.demo.worker SPEC.json RANK", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally` blocks: the engine goes too
    with open(argv[0]) as f:
        spec = json.load(f)
    rank = int(argv[1])
    from luwu.dataplane.observe import trace

    trace.start(f"worker {rank} ({spec.get('mode', '')})")
    try:
        report = train(spec, rank)
    except BaseException as e:  # noqa: BLE001 - report, then fail
        _emit({"event": "error", "rank": rank, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()})
        return 1
    _emit({"event": "done", "rank": rank, "report": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
