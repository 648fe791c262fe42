"""Peak resident set sizes of the demo's processes, and the report's memory block built from them.

The figure is VmHWM of /proc/PID/status: the process's own peak since its exec. Not ru_maxrss: a
child's ru_maxrss starts from the RSS of the process it was forked (or vforked) from, so a worker
started by a demo that had built a large model would report the demo's pages as its own.
"""

from __future__ import annotations

from luwu.dataplane.optimizer.spec import NODE_RSS_OVERHEAD

SOURCE = "VmHWM of /proc/PID/status (each process's own peak RSS)"


def vm_hwm_bytes(pid: int | str = "self") -> int | None:
    """A process's peak resident set size, VmHWM of /proc/PID/status (this process's own pages since its
    exec, unlike ru_maxrss, which a child inherits from the process it was forked from); None where
    /proc does not say (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def block(mnn: dict[int, dict], ddp: dict[int, dict] | None, nodes: dict[str, int | None], node_budget: int,
          engine: str) -> dict:
    """report.json's "memory": every luwu worker's and DDP worker's peak RSS (VmHWM, by rank), the
    largest of each and their ratio, each optimizer node's peak RSS beside its --node-memory budget,
    and where the luwu workers built their model."""
    luwu = {r: mnn[r].get("vm_hwm_bytes") for r in sorted(mnn)}
    out: dict = {"source": SOURCE, "luwu_workers": luwu,
                 "luwu_engine": "in the worker (counted above)" if engine == "embedded" else
                 "an engine daemon beside each worker (not counted above)",
                 "luwu_built_on": sorted({str(mnn[r].get("built_on")) for r in mnn}),
                 "luwu_built_vm_hwm_bytes": {r: mnn[r].get("built_vm_hwm_bytes") for r in sorted(mnn)},
                 "ddp_workers": {r: ddp[r].get("vm_hwm_bytes") for r in sorted(ddp)} if ddp else None,
                 "nodes": {n: {"peak_rss_bytes": v, "budget_bytes": node_budget,
                               "within_budget_and_overhead": None if v is None else v <= node_budget + NODE_RSS_OVERHEAD}
                           for n, v in nodes.items()},
                 "node_budget_bytes": node_budget,
                 # what a `luwu node` holds beyond its budget whatever the model (dataplane/optimizer/spec.py)
                 "node_rss_overhead_bytes": NODE_RSS_OVERHEAD}
    known = [v for v in luwu.values() if v is not None]
    out["luwu_worker_peak_rss_bytes"] = max(known) if known else None
    dknown = [v for v in (out["ddp_workers"] or {}).values() if v is not None]
    out["ddp_worker_peak_rss_bytes"] = max(dknown) if dknown else None
    out["luwu_to_ddp"] = (out["luwu_worker_peak_rss_bytes"] / out["ddp_worker_peak_rss_bytes"]
                          if known and dknown else None)
    if not nodes:
        out["nodes_note"] = "the optimizer nodes ran in the demo's own process (--no-controller): no RSS of their own"
    return out
