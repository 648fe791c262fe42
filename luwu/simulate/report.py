"""What `luwu simulate` hands back: the JSON object, the text lines, the timeline PNG of one
iteration per system, and the comparison with the LuWu/DisDP paper's published figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from luwu.simulate import acks, systems
from luwu.simulate.core import RESOURCES, simulate
from luwu.simulate.hardware import MODELS, PRESETS, Config
from luwu.simulate.workload import micro_batches

COLOURS = {"pull": "tab:blue", "push": "tab:orange", "fwd": "tab:green", "bwd": "tab:olive", "head": "tab:green",
           "adam": "tab:red", "read": "tab:purple", "write": "tab:brown", "allgather": "tab:cyan",
           "reduce-scatter": "tab:pink", "allreduce": "tab:pink", "h2d": "tab:gray", "d2h": "tab:gray",
           "nvme": "tab:purple", "cpu": "tab:red", "nvlink": "tab:gray"}


# Config fields beyond plain data parallelism and their defaults (docs/simulator.md)
PARALLELISM = {"tp": 1, "pp": 1, "schedule": "1f1b", "micro_batches": None, "collective": "ring",
               "host_shared_by": 1, "activation_offload": False}


def to_json(cfg: Config, out: dict, preset: str | None) -> dict:
    """The JSON object of a simulation: inputs, per-system figures, speedups, largest models."""
    m = cfg.model
    doc = {
        "preset": preset,
        "model": {"name": m.name, "params": m.params, "layers": m.layers, "hidden": m.hidden, "heads": m.heads,
                  "seq": m.seq, "vocab": m.vocab},
        "workers": cfg.workers, "micro_batch": cfg.micro_batch, "recompute": cfg.recompute,
        "topology": cfg.net.topology, "link_gbps": cfg.net.link * 8 / 1e9, "payload_bytes": cfg.net.payload,
        "grad_wire_bytes": systems.grad_bytes(cfg), "gpu": cfg.gpu.name,
        "optimizer_nodes": cfg.node.nodes, "node_ssds": cfg.node.ssds,
        "node_adam_params_per_s": systems.node_adam_rate(cfg), "node_disk_efficiency": cfg.node.disk_efficiency,
        "systems": {s: r.to_json() for s, r in out["results"].items()},
        "largest_trainable": out["largest_trainable"],
        "flow_control_node_goodput_gbps": {
            str(n): {"per_packet_ack": acks.node_goodput(cfg, n, "ack") * 8 / 1e9,
                     "heartbeat": acks.node_goodput(cfg, n, "heartbeat") * 8 / 1e9}
            for n in sorted({cfg.workers, 32, 64})},
    }
    doc.update({k: v for k, v in out.items() if k.startswith("speedup_over_")})
    par = {k: getattr(cfg, k) for k in PARALLELISM if getattr(cfg, k) != PARALLELISM[k]}
    if par:  # only where an issue-30 option is set: the default JSON stays as it was
        doc["parallelism"] = {k: getattr(cfg, k) for k in PARALLELISM} | {"micro_batches": micro_batches(cfg)}
    return doc


def lines(doc: dict) -> list[str]:
    """grep-able `key: value` lines of the headline figures."""
    out = [(f"model: {doc['model']['name']} ({doc['model']['params'] / 1e9:.1f}B params), "
            f"{doc['workers']} workers, {doc['topology']}")]
    for s, r in doc["systems"].items():
        if r["feasible"]:
            out.append(f"{s}: {r['tokens_per_s']:.4g} tokens/s ({r['tokens_per_s_per_worker']:.4g} per worker), "
                       f"MFU {r['mfu']:.3f}, micro-batch {r['micro_batch']}, {r['recompute']} recompute, "
                       f"{r['memory_gib_per_worker']:.1f} GiB "
                       f"per GPU, bottleneck: {r['bottleneck']}")
        else:
            out.append(f"{s}: cannot run: {r['reason']}")
    for k, v in doc.items():
        if k.startswith("speedup_over_"):
            out.append(f"{k}: {v:.3f}" if v is not None else f"{k}: n/a")
    out.append("largest_trainable: " + ", ".join(f"{s}={m}" for s, m in doc["largest_trainable"].items()))
    return out


def plot(out: dict, path: Path, title: str) -> None:
    """One panel per system that can run: its resources over one steady-state iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in out["results"].values() if r.feasible]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.2 + 1.6 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        t0, t1 = r.window
        rows = [k for k in RESOURCES if r.utilisation and k in r.utilisation]
        for y, res in enumerate(rows):
            by_kind: dict[str, list] = {}
            for t in r.timeline.tasks:
                secs = t.resources.get(res)
                if secs and t.start < t1 and t.start + secs > t0:
                    kind = t.label.split()[0]
                    by_kind.setdefault(kind, []).append((max(t.start, t0) - t0, min(t.start + secs, t1) - max(t.start, t0)))
            for kind, bars in by_kind.items():
                ax.broken_barh(bars, (y - 0.4, 0.8), color=COLOURS.get(kind, "tab:gray"), label=kind)
        ax.set_yticks(range(len(rows)), [RESOURCES[k] for k in rows], fontsize=7)
        ax.set_xlim(0, t1 - t0)
        ax.set_title(f"{systems.LABELS[r.system]}: {r.iteration_s:.3g} s per iteration, "
                     f"{r.tokens_per_s:.4g} tokens/s, bottleneck {r.bottleneck}", fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlabel("seconds into the iteration")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The paper's figures (../shared/reference/paper-figures.md; arXiv 2409.00918), per worker where
# the paper gives tokens/s (its ZeRO-Infinity "15% MFU" at 175B holds only per worker).
# keys: a figure's name, or for "ack_gbps" a worker count
PAPER: dict[str, dict[Any, float]] = {
    "175b": {"luwu_tokens_per_s_per_worker": 134, "speedup_over_zero_infinity": 3.98, "zero_infinity_mfu": 0.15},
    "opt-1.3b": {"luwu_tokens_per_s_per_worker": 14100, "speedup_over_zero_infinity": 2.90,
                 "speedup_over_zero_3": 2.33, "speedup_over_ddp_atp": 6.28},
    "ack_gbps": {32: 30.0, 64: 18.0},
}
# figures of the paper added with issue 30 (paper-figures.md): the node budget at 100 Gbit/s and
# its growth at 200, the traffic per layer of S bytes per worker, rail-only against a Clos
NODE_BUDGET = {"gflops": 99.0, "memory_gbps": 349.0, "ssd_gbps_each_way": 81.4}
TRAFFIC = {"luwu in": 2.0, "luwu out": 1.0, "zero_3 each way": 3 * 7 / 8}


def paper_comparison(cfg: Config | None = None) -> list[dict]:
    """Rows (figure, paper, simulated, ratio) for the paper's published figures, simulated with
    the testbed preset (or `cfg` with its model and workers replaced)."""
    base = (cfg or PRESETS["paper-testbed"]).with_(workers=8)
    rows = []

    def row(name: str, paper: float | str, sim: object) -> None:
        rows.append({"figure": name, "paper": paper, "simulated": sim,
                     "ratio": (sim / paper) if isinstance(sim, (int, float)) and isinstance(paper, (int, float)) and sim
                     else None})  # no ratio of model names (the largest-trainable rows)

    for model, figs in (("175b", PAPER["175b"]), ("opt-1.3b", PAPER["opt-1.3b"])):
        out = simulate(base.with_(model=MODELS[model]))
        res = out["results"]
        for key, paper in figs.items():
            if key == "luwu_tokens_per_s_per_worker":
                sim = res["luwu"].tokens_per_s_per_worker
            elif key == "zero_infinity_mfu":
                sim = res["zero_infinity"].hfu  # FLOPs executed, recompute included
            else:
                sim = out[key]
            row(f"{model}: {key}", paper, sim)
        if model == "175b":
            for s, paper_model in (("luwu", "1t"), ("zero_infinity", "175b"), ("ddp_atp", "opt-1.3b")):
                row(f"largest trainable, 8 workers: {s}", paper_model, out["largest_trainable"][s])
    big = simulate(base.with_(model=MODELS["1t"], workers=256), which=("luwu",))
    row("largest trainable, 256 workers: luwu", "1t", big["largest_trainable"]["luwu"])
    for n, paper in PAPER["ack_gbps"].items():
        row(f"per-packet ACKs, {n} workers: node goodput (Gbps)", paper, acks.node_goodput(base, n, "ack") * 8 / 1e9)
    rows.extend(extra_rows(base))
    return rows


def traffic_per_model_byte(system: str, cfg: Config) -> dict[str, float]:
    """Bytes one worker's NIC receives and sends in an iteration, over the model's bf16 bytes:
    read back from the timeline (each NIC's busy seconds at the rate that system's transfers use)."""
    from luwu.simulate.core import run_system

    r = run_system(system, cfg)
    t0, t1 = r.window
    busy = r.timeline.busy(t0, t1) if r.timeline else {}
    rate = (cfg.net.link * systems.luwu_wire_efficiency(cfg) if system == "luwu"
            else systems.nccl_bandwidth(cfg))
    model = cfg.dtype_bytes * cfg.model.params
    return {"in": busy.get("nic_rx", 0.0) * rate / model, "out": busy.get("nic_tx", 0.0) * rate / model}


def extra_rows(base: Config) -> list[dict]:
    """The rows added with issue 30: the node budget (plan.node_budget), the traffic per layer
    read back from the timeline, and rail-only against a star (the rail-only paper's "same
    training performance")."""
    from dataclasses import replace

    from luwu.simulate.core import run_system
    from luwu.simulate.plan import node_budget

    rows = []

    def row(name: str, paper: float | str, sim: float | str | None) -> None:
        rows.append({"figure": name, "paper": paper, "simulated": sim,
                     "ratio": sim / paper if isinstance(sim, float) and isinstance(paper, float) else None})

    b100 = node_budget(base)
    for key, paper in NODE_BUDGET.items():
        row(f"node budget at 100 Gbps: {key}", paper, b100[key])
    b200 = node_budget(base.with_(net=replace(base.net, link=2 * base.net.link)))
    row("node budget at 200 Gbps over 100 Gbps", 2.0, b200["params_per_s"] / b100["params_per_s"])
    luwu = traffic_per_model_byte("luwu", base.with_(model=MODELS["175b"]))
    zero = traffic_per_model_byte("zero_3", base.with_(model=MODELS["opt-1.3b"]))
    row("175b: luwu in per worker (x S)", TRAFFIC["luwu in"], luwu["in"])
    row("175b: luwu out per worker (x S)", TRAFFIC["luwu out"], luwu["out"])
    row("opt-1.3b: zero_3 each way per worker (x S)", TRAFFIC["zero_3 each way"], (zero["in"] + zero["out"]) / 2)
    cfg = base.with_(model=MODELS["175b"], workers=64)
    star = run_system("luwu", cfg)
    rail = run_system("luwu", cfg.with_(net=replace(cfg.net, topology="rail-only", rack_size=8)))
    row("175b, 64 workers: luwu rail-only over star", 1.0, rail.tokens_per_s / star.tokens_per_s)
    # the ZeRO papers' machine: ZeRO-Offload trains 13B on one V100, ZeRO-Infinity 1T on one DGX-2
    from luwu.simulate.core import largest_trainable

    dgx = PRESETS["dgx-2"]
    row("dgx-2, 1 GPU: zero_offload's largest", "opt-13b",
        largest_trainable("zero_offload", dgx.with_(workers=1, host_shared_by=1)))
    row("dgx-2, 16 GPUs on one host: zero_infinity's largest", "1t", largest_trainable("zero_infinity", dgx))
    return rows
