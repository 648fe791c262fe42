"""`luwu bench capacity`: the largest LLaMA-shaped model each system trains with every worker held
to `--worker-memory`, measured in the same run:

* ``luwu``: ModelInNetwork, 2 workers on loopback (`LocalNetwork`: the software switch and an
  optimizer node with `--node-memory` bytes of RAM, not capped: its disk traffic and RSS are
  reported apart);
* ``ddp``: DistributedDataParallel + torch AdamW, 2 ranks over Gloo;
* ``fsdp``: FSDP2 (`torch.distributed.fsdp.fully_shard` on each decoder layer and the root),
  2 ranks over Gloo on the CPU, torch AdamW; the model built on the meta device, sharded, then
  initialised (`--fsdp-init meta`: never whole on a rank), or built whole first (`eager`).

luwu's workers build the model on the meta device (ModelInNetwork initialises it unit by unit, so
no worker holds it whole: worker/model_in_network/materialize.py); DDP's ranks build it whole.

The model has a fixed `--hidden` size and a growing number of layers (`capacity_model.py`:
transformers' `LlamaForCausalLM` when installed, else a built-in module of the same shapes),
activation checkpointing on for every system (a recomputed forward pulls its unit again in luwu).
Each trial trains `--steps` steps in fresh
processes. Per system the layers double from 1 until a size does not fit (or `--max-layers`),
then bisect, within the system's share of `--time-budget`; `--layers N` runs that one size per system
instead (a fixed model: `largest_params` is then its size where it fit).

The cap (memcap.py) is a cgroup where this process may create one (one per worker: the worker and
what it starts, a luwu worker's engine daemon, are charged together, each page once), else
RLIMIT_AS (per process), else the peak RSS measured afterwards (`enforced` in the output). A trial
fits only if, besides that, each worker process's peak RSS (VmHWM: shared libraries included, which
a cgroup does not charge when another cgroup loaded them) stays under the cap; with no enforcement,
each worker's peak summed with the processes it started (`peak_held_to_cap` says which).

Prints grep-able `key: value` lines; `--json` prints one JSON object (`largest_params`,
`ratio_to_ddp`, `ratio_to_fsdp`, `tokens_per_s`, `enforced`, `trials`, ...); `--out DIR` writes
capacity.json and capacity.png.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from luwu.bench.capacity_search import SYSTEMS, search, summarise
from luwu.bench.memcap import KINDS, MemoryCap
from luwu.dataplane.process.usage import UserError, positive_float, positive_int, size


def add_arguments(p) -> None:
    p.add_argument("--worker-memory", type=size, default="2GiB", help="cap on each worker process's memory (default 2GiB)")
    p.add_argument("--node-memory", type=size, default="1GiB",
                   help="RAM budget of luwu's optimizer node (state and served copies; the rest on disk)")
    p.add_argument("--hidden", type=positive_int, default=256, help="hidden size of the model (fixed; layers grow)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default: hidden / 64, at least 1)")
    p.add_argument("--vocab", type=positive_int, default=32000, help="vocabulary size")
    p.add_argument("--intermediate", type=positive_int, default=None,
                   help="MLP width (default: LLaMA's 8/3 x hidden, rounded up to 64)")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=2, help="sequences per worker per step")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps per trial (tokens/s leaves out the first)")
    p.add_argument("--max-layers", type=positive_int, default=4096, help="the most layers tried")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="no search: one trial of this many layers per system (a fixed model's worker and node "
                        "memory compared in one run, e.g. --hidden 768 --layers 12: LLaMA-shaped, 134M parameters)")
    p.add_argument("--time-budget", type=positive_float, default=3600.0,
                   help="seconds for the whole search, shared by the systems (a started trial finishes)")
    p.add_argument("--systems", default="ddp,fsdp,luwu", help="comma-separated, of luwu, ddp, fsdp")
    p.add_argument("--enforce", choices=("auto", *KINDS), default="auto",
                   help="how the cap is held: auto (the strongest possible here), or one kind")
    p.add_argument("--model", choices=("auto", "hf", "builtin"), default="auto",
                   help="transformers' LlamaForCausalLM (hf), the built-in LLaMA-shaped module, or hf when installed")
    p.add_argument("--fsdp-init", choices=("meta", "eager"), default="meta",
                   help="FSDP2's model: built on the meta device, sharded, then initialised (its recipe for models "
                        "no rank holds whole; the default), or built whole on every rank first")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key: value lines")
    p.add_argument("--out", type=Path, help="directory for capacity.json and capacity.png")
    p.add_argument("--keep", type=Path, help="keep the trials' specs and logs in this directory")


def _config(args) -> dict:
    from luwu.bench.capacity_model import has_transformers, intermediate_for

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise UserError(f"--systems {args.systems!r}: a comma-separated list of {', '.join(SYSTEMS)}")
    heads = args.heads or max(1, args.hidden // 64)
    if args.hidden % heads:
        raise UserError(f"--hidden {args.hidden} is not a multiple of --heads {heads}")
    backend = args.model
    if backend == "auto":
        backend = "hf" if has_transformers() else "builtin"
    elif backend == "hf" and not has_transformers():
        raise UserError("--model hf needs transformers: pip install transformers (or --model builtin)")
    model = {"vocab": args.vocab, "hidden": args.hidden, "heads": heads,
             "intermediate": args.intermediate or intermediate_for(args.hidden), "seq": args.seq, "seed": 1,
             "backend": backend}
    return {"world": 2, "steps": args.steps, "batch": args.batch, "node_memory": args.node_memory, "threads": 1,
            "lr": 1e-4, "model": model, "systems": list(dict.fromkeys(systems)), "fsdp_init": args.fsdp_init}


def run(args) -> int:
    base = _config(args)
    allow = KINDS if args.enforce == "auto" else (args.enforce,)
    try:
        cap = MemoryCap.detect(args.worker_memory, allow)
    except ValueError as exc:
        raise UserError(f"--enforce {args.enforce}: {exc}") from None
    from rich.console import Console

    console = Console(stderr=True)
    work = Path(tempfile.mkdtemp(prefix="luwu-capacity-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    try:
        trials = search(base, cap, work, args.max_layers, args.time_budget, console, layers=args.layers)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    res = summarise(base, cap, trials)
    res["cores"] = len(os.sched_getaffinity(0))
    res["time_budget_s"] = args.time_budget
    res["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.out:
        _write(args.out, res)
    if args.json:
        print(json.dumps(res, default=float))
    else:
        _print(res)
    return 1 if res["errors"] else 0


def _print(res: dict) -> None:
    print(f"enforced: {res['enforced']}\nworker_memory: {res['worker_memory']}\nmodel: {res['model_kind']}")
    for sys_ in res["systems"]:
        print(f"largest_layers_{sys_}: {res['largest_layers'][sys_]}")
        print(f"largest_params_{sys_}: {res['largest_params'][sys_]}")
        tps = res["tokens_per_s"][sys_]
        print(f"tokens_per_s_{sys_}: {tps:.1f}" if tps is not None else f"tokens_per_s_{sys_}: None")
        print(f"worker_peak_rss_{sys_}: {res['worker_peak_rss_bytes'][sys_]}")
        print(f"worker_cgroup_peak_{sys_}: {res['worker_cgroup_peak_bytes'][sys_]}")
        print(f"checkpointing_{sys_}: {res['checkpointing'][sys_]}")
        print(f"init_{sys_}: {res['init'][sys_]}")
    for k in ("ratio_to_ddp", "ratio_to_fsdp", "node_peak_rss_bytes", "node_disk_read_bytes", "node_disk_write_bytes",
              "node_disk_source", "trials_run", "errors"):
        if k in res:
            v = res[k]
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


def _write(out: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(res, indent=2, default=float))
    names = res["systems"]
    colors = {"luwu": "tab:blue", "ddp": "tab:orange", "fsdp": "tab:green"}
    # a search that ended on a failure other than memory says so under its bar (its size is a lower bound)
    labels = [n + ("\n(search ended on an error)" if any(e.startswith(n + " ") for e in res["errors"]) else "")
              for n in names]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    ax[0].bar(labels, [(res["largest_params"][n] or 0) / 1e6 for n in names], color=[colors[n] for n in names])
    ax[0].set_ylabel("largest model trained (M params)")
    ax[1].bar(labels, [res["tokens_per_s"][n] or 0.0 for n in names], color=[colors[n] for n in names])
    ax[1].set_ylabel("tokens/s at that size")
    fig.suptitle(f"capacity: every worker under {res['worker_memory_bytes'] / 2**30:.2f} GiB ({res['enforced']}), "
                 f"hidden {res['config']['model']['hidden']}")
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)
    plt.close(fig)
