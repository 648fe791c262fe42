"""What a run reports: one dict (printed as JSON with --json) and its grep-able `key: value` lines.

Per worker the allreduce is checked bit for bit; goodput is the tensor's bytes over the slowest
worker's time (one tensor per worker in, the sum out). Switch counters come from each switch's
last report: COMPLETED / ABSORBED / RESENT events, FORWARDED (plain IPv4 routed by `ipv4_lpm`: rail-only
GPU-to-GPU TCP) and every non-zero drop reason.
"""

from __future__ import annotations

from pathlib import Path

from . import links

EVENTS_SHOWN = ("COMPLETED", "ABSORBED", "RESENT", "FALLBACK", "MULTICAST", "FORWARDED")
BITS_PER_BYTE = 8


def _count(counters: dict, family: str, name: str) -> int:
    v = counters.get(family, {}).get(name)
    return int(v[0]) if v else 0


def summary(args, spec, job, opts, result, run_dir: Path, compared: dict | None = None) -> dict:
    """`compared`: --workload train's comparison with the single-process reference (train_workload.compare)."""
    workers = sorted(result.workers, key=lambda w: w.get("rank", 0))
    secs = [w["seconds"] for w in workers if "seconds" in w]
    nbytes = 4 * opts.elements
    info = {
        "topology": args.topo, "run_id": spec.run_id, "backend": opts.backend, "switch": opts.switch,
        "workers": len(job.worker_host), "nodes": len(job.plan.nodes) if opts.push_pull else 0,
        "switches": [s.name for s in spec.switches], "lanes": job.plan.lanes, "elements": opts.elements,
        "bytes_per_worker": nbytes, "drop": args.drop, "bw_mbit": args.bw, "mtu": spec.mtu,
        "allreduce": {"verified": sum(1 for w in workers if w.get("verified")), "of": len(job.worker_host),
                      "seconds_max": max(secs) if secs else None, "seconds_min": min(secs) if secs else None,
                      "goodput_gbps": nbytes * BITS_PER_BYTE / max(secs) / 1e9 if secs else None,
                      "per_worker": workers},
        "counters": {}, "errors": result.errors, "leftovers": result.leftovers,
        "passed": result.passed, "run_dir": str(run_dir),
    }
    if opts.workload == "ddp":  # the training's figures instead of the int32 check's
        info.pop("allreduce")
        done = [w for w in workers if "max_param_diff" in w]
        first = done[0] if done else {}
        info.update(workload="ddp", steps=opts.steps, loss=first.get("loss"), reference_loss=first.get("reference_loss"),
                    max_param_diff=max((w["max_param_diff"] for w in done), default=None),
                    matches_reference=len(done) == len(job.worker_host) and all(w["matches_reference"] for w in done),
                    ddp={"per_worker": workers, "seconds_max": max((w["seconds"] for w in done), default=None),
                         "init_seconds_max": max((w["init_seconds"] for w in done), default=None)})
    elif opts.workload == "train":
        from .train_workload import summary as train_summary

        info.pop("allreduce")
        info.update(workload="train", steps=opts.steps, **train_summary(workers, compared or {}))
        info["passed"] = info["passed"] and bool(info.get("matches_reference"))
    else:
        info["workload"] = "allreduce"
    if opts.push_pull:
        pp = [w.get("pushpull", {}) for w in workers]
        info["pushpull"] = {"verified": sum(1 for p in pp if p.get("verified")), "of": len(job.worker_host),
                            "seconds_max": max((p.get("seconds", 0.0) for p in pp), default=None),
                            "node_gradients": sum(n.get("gradients", 0) for n in result.nodes)}
    info["links"] = links.traffic(spec, opts.port_drops, result.switches)
    for name, c in result.switches.items():
        info["counters"][name] = {
            "events": {e: _count(c, "events", e) for e in EVENTS_SHOWN},
            "drops": {k: int(v[0]) for k, v in c.get("drops", {}).items() if v and v[0]},
        }
    return info


def summary_lines(info: dict) -> list[str]:
    lines = [
        f"topology: {info['topology']}",
        f"backend: {info['backend']}",
        f"switch: {info['switch']}",
        f"switch_nodes: {' '.join(info['switches'])}",
        f"workers: {info['workers']}",
        f"lanes: {info['lanes']}",
        f"elements_per_worker: {info['elements']}",
        f"drop: {info['drop']:g}",
        f"workload: {info['workload']}",
    ]
    if info["workload"] in ("ddp", "train"):
        for key in ("steps", "loss", "reference_loss", "max_param_diff", "matches_reference"):
            v = info.get(key)
            lines.append(f"{key}: {v:.6g}" if isinstance(v, float) else f"{key}: {v}")
    if info["workload"] == "train" and info["train"]["seconds_max"] is not None:
        lines.append(f"train_seconds_max: {info['train']['seconds_max']:.3f}")
    if info["workload"] == "ddp" and info["ddp"]["seconds_max"] is not None:
        lines.append(f"ddp_train_seconds_max: {info['ddp']['seconds_max']:.3f}")
        lines.append(f"ddp_init_seconds_max: {info['ddp']['init_seconds_max']:.3f}")
    ar = info.get("allreduce")
    if ar is not None:
        lines.append(f"allreduce_verified: {ar['verified']}/{ar['of']}")
    if ar is not None and ar["seconds_max"] is not None:
        lines += [f"allreduce_seconds_max: {ar['seconds_max']:.3f}", f"allreduce_seconds_min: {ar['seconds_min']:.3f}",
                  f"allreduce_goodput_gbps: {ar['goodput_gbps']:.4f}"]
    if "pushpull" in info:
        pp = info["pushpull"]
        lines.append(f"pushpull_verified: {pp['verified']}/{pp['of']}")
        lines.append(f"pushpull_node_gradients: {pp['node_gradients']}")
    for name, c in info["counters"].items():
        ev = " ".join(f"{k.lower()}={v}" for k, v in c["events"].items() if v)
        drops = " ".join(f"{k.lower()}={v}" for k, v in c["drops"].items()) or "none"
        lines.append(f"switch_{name}_events: {ev or 'none'}")
        lines.append(f"switch_{name}_drops: {drops}")
    for lk in info.get("links", []):
        shaped = f" bw={lk['bw_mbit']:g}mbit" if lk["bw_mbit"] else ""
        lossy = f" drop={lk['drop']:g}" if lk["drop"] else ""
        seen = f" rx={lk['rx_packets']} tx={lk['tx_packets']}" if lk["rx_packets"] is not None else ""
        lines.append(f"link_{lk['switch']}_{lk['port']}: peer={lk['peer'] or '-'}{shaped}{lossy}{seen}")
    for e in info["errors"]:
        lines.append(f"error: {e}")
    for left in info["leftovers"]:
        lines.append(f"leftover: {left}")
    if not info["passed"]:
        lines.append(f"logs: {info['run_dir']}")
    if info.get("trace"):
        lines.append(f"trace: {info['trace']}")
    lines.append(f"result: {'PASS' if info['passed'] else 'FAIL'}")
    return lines
