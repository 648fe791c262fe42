"""One rank of tests/backend/test_backend_cleanup.py: joins a 2-rank luwu group (FileStore), writes
its pid, its engine daemon's and (rank 0) its switch's to `<dir>/pids-<rank>.json`, then exits the way
`MODE` says: `clean` (destroy_process_group, return), `error` (an exception escapes the script),
`sigterm` (all-reduces until the test sends SIGTERM), `sigterm-user` (the same, with the script's own
SIGTERM handler set before init: it exits with status 7, and must still be called), `sigkill` (the
same loop, until the test sends SIGKILL). `clean` and `error` wait for the test's `<dir>/go` first, so
that the test sees the rank's files before the rank removes them."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    rank, mode, where = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "sigterm-user":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    dist.init_process_group("luwu", init_method=f"file://{where}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(1000)
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    link = pg._link
    pids = {"rank": os.getpid(), "engine": getattr(getattr(link, "proc", None), "pid", None),
            "switch": pg._lease.switch.pid if pg._lease.switch is not None else None, "workdir": pg.workdir}
    with open(os.path.join(where, f"pids-{rank}.json.tmp"), "w") as f:
        json.dump(pids, f)
    os.rename(os.path.join(where, f"pids-{rank}.json.tmp"), os.path.join(where, f"pids-{rank}.json"))
    if mode in ("clean", "error"):  # the test has seen this rank's files first (else they may be gone already)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(where, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)
    if mode == "clean":
        dist.barrier()
        dist.destroy_process_group()
        return
    if mode == "error":
        dist.barrier()
        raise RuntimeError("the training script failed")
    deadline = time.monotonic() + 120  # sigterm: the test signals both ranks while they all-reduce
    while time.monotonic() < deadline:
        dist.all_reduce(t)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
