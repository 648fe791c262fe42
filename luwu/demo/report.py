"""The demo's results: report.json and the plots beside it (loss, memory, throughput, traffic).

Traffic is counted from the engines' socket statistics (UDP payload bytes each worker's engine
sent and received, luwu headers, heartbeats, pulls and retransmissions included) and set beside
what FSDP/ZeRO-3 moves per worker and step for the same model: all-gather of the parameters for
forward and again for backward, reduce-scatter of the gradients, 3(N-1)S/N each way in total
with S the model's fp32 bytes (docs/architecture.md; the paper's comparison). luwu's ideal per
worker and step is S_grad out (one push) and 2 S_served in (forward and backward pulls).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from luwu.dataplane.protocol import lanes_for_mode

from . import push_bytes


def mean_losses(reports: dict[int, dict]) -> list[float]:
    """The global batch's loss per step: the mean of the ranks' losses (equal shards)."""
    ranks = sorted(reports)
    return np.mean([reports[r]["losses"] for r in ranks], axis=0).tolist()


def step_throughput(reports: dict[int, dict], tokens_per_step: int) -> list[float]:
    """Tokens per second per step (the slowest rank sets the pace)."""
    secs = np.max([reports[r]["step_seconds"] for r in sorted(reports)], axis=0)
    return (tokens_per_step / np.maximum(secs, 1e-9)).tolist()


WIRE_OVERHEAD = 42  # bytes of UDP (8), IPv4 (20) and Ethernet (14) headers per packet


def traffic(reports: dict[int, dict], steps: int, workers: int, model_bytes: int, served_itemsize: int) -> dict:
    per_worker = []
    for r in sorted(reports):
        sock = reports[r]["mnn"]["engine"]["socket"]
        per_worker.append({"rank": r, "tx_bytes": int(sock["tx_bytes"]), "rx_bytes": int(sock["rx_bytes"]),
                           "tx_packets": int(sock["tx_packets"]), "rx_packets": int(sock["rx_packets"])})
    served = model_bytes // 4 * served_itemsize
    fsdp_each_way = 3 * (workers - 1) * model_bytes / workers
    tx = float(np.mean([w["tx_bytes"] for w in per_worker])) / steps
    rx = float(np.mean([w["rx_bytes"] for w in per_worker])) / steps
    # bytes per parameter each way as a wire would carry them: every luwu packet (gradients, the
    # exponent agreement, heartbeats, pulls) plus its UDP/IPv4/Ethernet headers
    params = max(1, model_bytes // 4)
    tx_pk = float(np.mean([w["tx_packets"] for w in per_worker])) / steps
    rx_pk = float(np.mean([w["rx_packets"] for w in per_worker])) / steps
    return {"per_worker_totals": per_worker, "steps": steps, "model_bytes_fp32": model_bytes,
            "push_bytes_per_param": (tx + WIRE_OVERHEAD * tx_pk) / params,
            "pull_bytes_per_param": (rx + WIRE_OVERHEAD * rx_pk) / params,
            "wire_overhead_per_packet": WIRE_OVERHEAD,
            "luwu_measured_per_step": {"out": tx, "in": rx},
            "luwu_ideal_per_step": {"out": model_bytes, "in": 2 * served},
            "fsdp_per_step": {"out": fsdp_each_way, "in": fsdp_each_way}}


def build(args: dict, fabric: dict, mnn: dict[int, dict], ddp: dict[int, dict] | None, model_info: dict,
          switch_counters: dict, node_stats: list, tokens_per_step: int) -> dict:
    steps = len(mnn[0]["losses"])
    out: dict[str, Any]
    out = {"settings": args, "control_plane": fabric, "model": model_info, "steps": steps,
           "luwu": {"losses": mean_losses(mnn), "tokens_per_second": step_throughput(mnn, tokens_per_step),
                    "final_loss": mean_losses(mnn)[-1],
                    "memory": {r: mnn[r]["mnn"]["memory"] for r in sorted(mnn)},
                    "counters": {r: mnn[r]["mnn"]["counters"] for r in sorted(mnn)},
                    "wait_seconds": {r: mnn[r]["mnn"]["wait_seconds"] for r in sorted(mnn)},
                    "units": mnn[0]["mnn"]["units"], "kept_units": mnn[0]["mnn"]["keep"],
                    "largest_unit_bytes": mnn[0]["mnn"]["largest_unit_bytes"],
                    # what each worker held before training (ModelInNetwork.setup_memory): a meta-built model's
                    # initialisation makes one unit at a time on the rank that hands the nodes their layers
                    "setup_memory": {r: mnn[r].get("setup_memory") for r in sorted(mnn)},
                    # steps an optimizer node skipped for a unit (its summed gradient was non-finite or
                    # saturated): None when no rank could ask the nodes
                    "skipped_steps": mnn[0]["mnn"].get("skipped_steps"),
                    "saturated_sums": int((switch_counters.get("events", {}).get("SATURATED") or [0])[0])},
           "traffic": traffic(mnn, steps, len(mnn), model_info["bytes_fp32"], model_info["served_itemsize"]),
           "switch_counters": switch_counters, "optimizer_nodes": node_stats}
    if args.get("packet_mode") and model_info.get("units"):  # where the push bytes go (push_bytes.py)
        out["traffic"]["push_breakdown"] = push_bytes.breakdown(
            mnn, steps, [int(u["numel"]) for u in model_info["units"]], lanes_for_mode(args["packet_mode"]),
            args.get("grad_format") or "fixed32")
    if ddp:
        out["ddp"] = {"losses": mean_losses(ddp), "tokens_per_second": step_throughput(ddp, tokens_per_step),
                      "final_loss": mean_losses(ddp)[-1],
                      "memory": {r: ddp[r]["ddp"] for r in sorted(ddp)}}
        out["final_loss_difference"] = out["luwu"]["final_loss"] - out["ddp"]["final_loss"]
    return out


def write(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return plot(report, out)


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ddp = report.get("ddp")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(report["luwu"]["losses"], label="luwu: switch + optimizer node")
    if ddp:
        ax.plot(ddp["losses"], label="DDP + Gloo + AdamW", linestyle="--")
    ax.set(xlabel="step", ylabel="training loss (global batch)", title="Loss")
    ax.legend()
    paths.append(_save(fig, out / "loss.png"))

    labels, state = ["luwu"], [_peak_state(report["luwu"]["memory"])]
    if ddp:
        labels.append("DDP")
        state.append(max(m["state_bytes"]["total"] for m in ddp["memory"].values()))
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(12, 4))
    left.bar(labels, np.array(state) / 2**20, color=["tab:blue", "tab:orange"][: len(labels)])
    left.set(ylabel="MiB", title="model state held by a worker\n(params, grads, optimizer, staging)")
    _rss_panel(middle, right, report.get("memory") or {})
    paths.append(_save(fig, out / "memory.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(report["luwu"]["tokens_per_second"], label="luwu")
    if ddp:
        ax.plot(ddp["tokens_per_second"], label="DDP + Gloo", linestyle="--")
    ax.set(xlabel="step", ylabel="tokens / s", title="Throughput (all workers)")
    ax.legend()
    paths.append(_save(fig, out / "throughput.png"))

    t = report["traffic"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["luwu measured", "luwu ideal", "FSDP"]
    keys = ["luwu_measured_per_step", "luwu_ideal_per_step", "fsdp_per_step"]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [t[k]["in"] / 2**20 for k in keys], 0.4, label="into the worker")
    ax.bar(x + 0.2, [t[k]["out"] / 2**20 for k in keys], 0.4, label="out of the worker")
    ax.set_xticks(x, names)
    ax.set(ylabel="MiB per worker per step", title="Network traffic per worker")
    ax.legend()
    paths.append(_save(fig, out / "traffic.png"))
    if "predicted_s" in (report.get("prediction") or {}):
        paths.append(plot_prediction(report["prediction"], out / "iteration.png"))
    return paths


def plot_prediction(p: dict, path: Path) -> Path:
    """iteration.png: each step's iteration time and worker compute (slowest rank) against the plan's
    prediction, the steps it took the compute time from shaded (luwu/demo/prediction.py)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    ms = 1000.0
    ax.axvspan(p["compute_steps"][0] - 0.5, p["compute_steps"][-1] + 0.5, color="tab:gray", alpha=0.15,
               label="steps the prediction's compute time comes from")
    ax.plot(np.array(p["iteration_seconds"]) * ms, label="measured iteration (slowest rank)")
    ax.plot(np.array(p["compute_seconds"]) * ms, label="measured worker compute (not waiting on the network)",
            linestyle=":")
    ax.axhline(p["predicted_s"] * ms, color="tab:red", linestyle="--",
               label=f"predicted {p['predicted_s'] * ms:.0f} ms ({p['bottleneck']})")
    ax.axhline(p["measured_s"] * ms, color="tab:green", linestyle="-.",
               label=f"measured {p['measured_s'] * ms:.0f} ms (median, steps {p['measured_steps'][0]}+)")
    ax.set_ylim(0, 2 * max(p["predicted_s"], p["measured_s"]) * ms)  # the warm-up step and spikes: clipped
    ax.set(xlabel="step", ylabel="ms", title=f"Iteration time: predicted / measured = {p['ratio'] or 0:.2f}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: the series stay visible
    return _save(fig, path)


def _rss_panel(workers, nodes, memory: dict) -> None:
    """Every luwu worker's peak RSS next to every DDP worker's (VmHWM, rss.py); each optimizer node's
    beside its --node-memory budget."""
    bars = [(f"luwu w{r}", v, "tab:blue") for r, v in (memory.get("luwu_workers") or {}).items()]
    bars += [(f"DDP w{r}", v, "tab:orange") for r, v in (memory.get("ddp_workers") or {}).items()]
    bars = [(n, v, c) for n, v, c in bars if v is not None]
    workers.bar([n for n, _, _ in bars], [v / 2**20 for _, v, _ in bars], color=[c for _, _, c in bars])
    workers.set(ylabel="MiB", title="worker peak RSS (VmHWM)\n(incl. torch and activations)")
    node = [(n, m["peak_rss_bytes"]) for n, m in (memory.get("nodes") or {}).items() if m["peak_rss_bytes"]]
    nodes.bar([n for n, _ in node], [v / 2**20 for _, v in node], color="tab:green")
    if memory.get("node_budget_bytes"):
        nodes.axhline(memory["node_budget_bytes"] / 2**20, color="tab:red", linestyle="--", label="--node-memory")
        if memory.get("node_rss_overhead_bytes"):
            nodes.axhline((memory["node_budget_bytes"] + memory["node_rss_overhead_bytes"]) / 2**20, color="tab:gray",
                          linestyle=":", label="+ the node's stated fixed overhead")
        nodes.legend(fontsize=8)
    nodes.set(ylabel="MiB", title="optimizer node peak RSS\n" + ("(VmHWM) and its budget" if node else
                                                                 "(in the demo's process: not measured)"))


def _peak_state(memory: dict) -> int:
    return max(int(m["peak_bytes"]) for m in memory.values())


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
