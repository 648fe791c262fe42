"""DDP training through the luwu switch: the same script as its Gloo version but for the backend string.

    torchrun --standalone --nproc-per-node 2 examples/ddp_luwu.py                  # luwu (in-network allreduce)
    torchrun --standalone --nproc-per-node 2 examples/ddp_luwu.py --backend gloo   # the Gloo baseline

No `import luwu`: installing luwu registers the backend with torch. With nothing configured, rank 0 starts a software switch on loopback and every rank
runs its engine in a thread (LUWU_ENGINE=process runs it as a daemon beside the rank; LUWU_CONTROLLER uses a controller's
plan; see luwu/worker/backend/config.py). A small MLP learns a fixed random linear map from
per-rank synthetic data; rank 0 prints the loss and can write the final parameters as JSON
(--out) so that two runs can be compared.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="luwu", choices=["luwu", "gloo"], help="torch.distributed backend")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--out", help="rank 0 writes losses and final parameters here (JSON)")
    return p.parse_args(argv)


def make_model(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # identical initial parameters on every rank (DDP also broadcasts them)
    return torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 4))


def batches(args, rank: int):
    target = torch.Generator().manual_seed(args.seed + 1)
    w = torch.randn(16, 4, generator=target)
    g = torch.Generator().manual_seed(args.seed + 1000 + rank)  # every rank sees different data
    for _ in range(args.steps):
        x = torch.randn(args.batch, 16, generator=g)
        yield x, x @ w + 0.01 * torch.randn(args.batch, 4, generator=g)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model(args))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for step, (x, y) in enumerate(batches(args, rank)):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP allreduces the gradient buckets here (through the switch with luwu)
        opt.step()
        losses.append(loss.item())
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.6f}", flush=True)
    params = {n: p.detach().reshape(-1).tolist() for n, p in model.module.named_parameters()}
    digest = hashlib.sha256(json.dumps(params).encode()).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)  # the replicas must be identical
    if rank == 0:
        print(f"backend {args.backend}, {world} ranks: replicas identical: {len(set(digests)) == 1}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"backend": args.backend, "world_size": world, "losses": losses, "digests": digests,
                           "params": params}, f)
    dist.barrier()  # nobody tears the group down while a peer still talks to it (Gloo aborts on that)
    del model, opt  # DDP before its group: freed last by DDP's reducer, Gloo's group can hang at exit
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
