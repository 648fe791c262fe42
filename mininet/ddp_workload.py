"""`luwu mininet run --workload ddp`, inside an emulated host: torch DDP over
`init_process_group("luwu")`, the string swap and nothing else, across the emulated network.

Each worker points the backend at its own endpoint plan (LUWU_PLAN, the planner's plan for this
host: its engine binds the host's address and talks to the emulated switches) -- or, when the run
has a controller, at the controller's job (LUWU_CONTROLLER/LUWU_JOB/LUWU_TOKEN, reached over the
management network: the backend joins at init_process_group from the host's address) -- and meets the
others through a FileStore in the run directory (every namespace sees the same file system). On
rail-only it also sets LOCAL_WORLD_SIZE/LOCAL_RANK, as torchrun would: the backend's allreduce goes
hierarchical (worker/backend/hierarchy.py: reduce-scatter over NVLink, the rail's in-network sum,
all-gather). The backend's point-to-point channel binds the host's rail address, which every GPU
reaches (server mates over NVLink, other servers through the rails, forwarded by a mate GPU when
the rails differ: topologies._cross_rail); `collectives` (--collectives) exercises that with
all_to_all, gather and send/recv after training.
It trains a small regression MLP with DDP and SGD with momentum on data that is a function of
(seed, step, rank), then trains the same model, data and seed without any network (one process,
the ranks' batches concatenated: DDP's averaged gradient is the full batch's) and compares.

The sums cross the switches in fixed point, so the parameters differ from the reference by
rounding only: `matches_reference` is true when the largest difference stays under
PARAM_TOLERANCE (the fixed-point sum of a float32 gradient is within 2^-22 of its largest element
per chunk, docs/protocol.md 5; summed over the steps and scaled by the learning rate and the
momentum that is far below 1e-4 here, while a lost or doubled contribution moves parameters by
about the learning rate times a gradient, >1e-3).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

IN, HIDDEN, OUT = 32, 64, 4
BATCH = 16  # samples per rank per step
LR, MOMENTUM = 0.05, 0.9
PARAM_TOLERANCE = 1e-4
BLOCK = 16384  # float32 elements of each (source, destination) block of --collectives: 64 KiB, many segments


def _model(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _batch(seed: int, step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    teacher = torch.Generator().manual_seed(seed)  # one target function for every rank and step
    w = torch.randn(IN, OUT, generator=teacher) / IN ** 0.5
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(BATCH, OUT, generator=g)


def _global_batch(seed: int, step: int, world: int):
    import torch

    parts = [_batch(seed, step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _eval_loss(model, seed: int, steps: int, world: int) -> float:
    import torch

    x, y = _global_batch(seed, steps, world)  # a step no one trained on
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def reference(seed: int, steps: int, world: int):
    """The same training without the network: (final model, eval loss)."""
    import torch

    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = _global_batch(seed, step, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, _eval_loss(model, seed, steps, world)


def train(rank: int, world: int, seed: int, steps: int):
    """DDP over the current default process group: (final model, eval loss, train losses)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(seed)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        x, y = _batch(seed, step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return model, _eval_loss(model, seed, steps, world), losses


def _block(seed: int, src: int, dst: int):
    """What rank `src` sends rank `dst` in --collectives: random bits, so any misplaced byte shows."""
    import torch

    return torch.randn(BLOCK, generator=torch.Generator().manual_seed(seed * 7919 + src * 131 + dst))


def _forwarding() -> dict:
    """This namespace's IPv4 forwarding and NVLink counters (/proc/net is per network namespace)."""
    snmp = Path("/proc/net/snmp").read_text().splitlines()
    ip_keys, ip_values = (line.split()[1:] for line in snmp if line.startswith("Ip:"))
    out = {"forwarded_packets": int(dict(zip(ip_keys, ip_values))["ForwDatagrams"])}
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "nv0":
            fields = rest.split()
            out.update(nvlink_rx_bytes=int(fields[0]), nvlink_tx_bytes=int(fields[8]))
    return out


def collectives(rank: int, world: int, seed: int) -> dict:
    """all_to_all_single, gather to every root in turn and send/recv with every peer over the default
    group, each result compared bit for bit with the blocks the other ranks sent; on rail-only the
    pairs on different servers and rails cross a mate GPU's NVLink and forwarding
    (topologies._cross_rail). Returns the checks and this host's forwarding counters around them."""
    import torch
    import torch.distributed as dist

    before = _forwarding()
    mismatches = 0
    out = torch.empty(world * BLOCK)
    dist.all_to_all_single(out, torch.cat([_block(seed, rank, d) for d in range(world)]))
    mismatches += sum(not torch.equal(out[s * BLOCK:(s + 1) * BLOCK], _block(seed, s, rank)) for s in range(world))
    for root in range(world):
        gathered = [torch.empty(BLOCK) for _ in range(world)] if rank == root else None
        dist.gather(_block(seed, rank, root), gathered, dst=root)
        if gathered is not None:
            mismatches += sum(not torch.equal(g, _block(seed, s, root)) for s, g in enumerate(gathered))
    for peer in range(world):
        if peer == rank:
            continue
        got = torch.empty(BLOCK)
        works = [dist.isend(_block(seed, rank, peer) * 2, peer), dist.irecv(got, peer)]
        for w in works:
            if w is None:  # torch returns no work for a rank outside the group
                raise RuntimeError(f"rank {rank} is not in the default process group")
            w.wait()
        mismatches += not torch.equal(got, _block(seed, peer, rank) * 2)
    # A completed isend only means the bytes are in the socket's send buffer; once every rank has
    # received everything (the barrier), every byte this host sent or forwarded has left nv0.
    dist.barrier()
    after = _forwarding()
    return {"collective_mismatches": int(mismatches), "collective_bytes": 3 * (world - 1) * BLOCK * 4,
            **{k: after[k] - before[k] for k in after}}


def run(cfg: dict, say, wait_line) -> int:
    """The worker's side of the runner's protocol (ready, go, result, stop) for --workload ddp."""
    w, d = cfg["worker"], cfg["worker"]["ddp"]
    rank, world, seed, steps, timeout = w["rank"], d["world"], cfg["seed"], d["steps"], cfg["timeout"]
    os.environ.pop("LUWU_NO_BACKEND", None)  # the runner's children skip the backend; this one is the point
    if w.get("controller"):  # the backend joins the controller's job itself (JoinJob at init_process_group)
        ctl = w["controller"]
        os.environ.update(LUWU_CONTROLLER=ctl["address"], LUWU_JOB=ctl["job"], LUWU_TOKEN=ctl["token"],
                          LUWU_ENDPOINT_HOST=ctl["endpoint"].rpartition(":")[0])
    else:
        plan_path = Path(d["dir"]) / f"ddp-plan-{rank}.json"
        plan_path.write_text(json.dumps(w["plan"]))
        os.environ["LUWU_PLAN"] = str(plan_path)
    # as torchrun would set them: LOCAL_WORLD_SIZE > 1 on rail-only makes the backend's allreduce
    # hierarchical, its intra-server steps over the point-to-point channel bound to the NVLink address
    os.environ.update(LUWU_ENGINE="embedded", LUWU_P2P_HOST=d["p2p_host"],
                      LUWU_WORKDIR=str(Path(d["dir"]) / f"ddp-rank{rank}"),
                      LOCAL_WORLD_SIZE=str(d["local_world_size"]), LOCAL_RANK=str(d["local_rank"]))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    say("ready", rank=rank)
    if wait_line(("go",), timeout) != "go":
        return 1
    t0 = time.monotonic()
    dist.init_process_group("luwu", init_method=f"file://{d['store']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        init_s = time.monotonic() - t0
        model, loss, losses = train(rank, world, seed, steps)
        seconds = time.monotonic() - t0 - init_s
        checks = collectives(rank, world, seed) if d.get("collectives") else {}
        link = getattr(dist.distributed_c10d._get_default_group(), "_link", None)  # the luwu group's engine
        stats = link.stats() if link is not None else None
    finally:
        gc.collect()  # DDP (train's, in a reference cycle) before its group: see luwu/demo/worker.py _leave_group
        dist.destroy_process_group()
    ref_model, ref_loss = reference(seed, steps, world)
    diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref_model.parameters()))
    matches = diff <= PARAM_TOLERANCE
    verified = matches and checks.get("collective_mismatches", 0) == 0
    say("result", rank=rank, host=cfg["host"], workload="ddp", steps=steps, loss=loss, reference_loss=ref_loss,
        first_train_loss=losses[0], last_train_loss=losses[-1], max_param_diff=diff, matches_reference=matches,
        verified=verified, init_seconds=init_s, seconds=seconds, engine=(stats or {}).get("engine"), **checks)
    wait_line(("stop",), timeout)
    return 0 if verified else 1
