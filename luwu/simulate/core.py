"""`simulate(cfg)`: every system's iteration on its own timeline, and the figures a user reads:
tokens/s, MFU, per-resource utilisation and the bottleneck, memory per worker, the largest
trainable model, and luwu's speedup over each alternative.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from luwu.simulate import systems
from luwu.simulate.events import Timeline
from luwu.simulate.hardware import LADDER, MODELS, Config
from luwu.simulate.workload import RECOMPUTE, LayerCost, layer_costs, micro_batches, model_flops_per_token

RESOURCES = {  # resource -> what it is, for the report
    "gpu": "worker GPU", "nic_rx": "worker NIC in", "nic_tx": "worker NIC out", "nvlink": "NVLink",
    "node_tx": "optimizer node link out", "node_rx": "optimizer node link in", "node_cpu": "optimizer node AdamW",
    "node_disk_r": "optimizer node SSD reads", "node_disk_w": "optimizer node SSD writes",
    "pcie_h2d": "PCIe host to GPU", "pcie_d2h": "PCIe GPU to host", "host_cpu": "worker host CPU-Adam",
    "host_nvme": "worker host NVMe",
}


@dataclass
class SystemResult:
    system: str
    feasible: bool
    reason: str = ""
    micro_batch: int = 0
    iteration_s: float = 0.0
    tokens_per_s_per_worker: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    utilisation: dict | None = None
    bottleneck: str = ""
    memory_gib_per_worker: float = 0.0
    prefetch: bool = True
    recompute: str = ""  # workload.RECOMPUTE: the mode of the fastest layout that fits
    timeline: Timeline | None = None
    window: tuple[float, float] = (0.0, 0.0)
    # with pipelining or gradient accumulation (Config.pp, Config.micro_batches): the timeline is
    # one micro-batch; the iteration is (m + p - 1) micro-batch slots plus the optimizer's tail
    micro_batches: int = 1
    micro_batch_s: float = 0.0  # one micro-batch's slot without the optimizer step (p2p included)
    step_tail_s: float = 0.0  # what the optimizer step adds once per iteration
    bubble: float = 0.0  # the pipeline's idle fraction of the micro-batch slots: (p - 1) / (m + p - 1)

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("feasible", "reason", "micro_batch", "iteration_s",
                                              "tokens_per_s_per_worker", "tokens_per_s", "mfu", "hfu",
                                              "utilisation", "bottleneck", "memory_gib_per_worker", "prefetch",
                                              "recompute")}
        if self.micro_batches > 1:  # only where pipelining or accumulation is on: the default JSON stays as it was
            out.update({k: getattr(self, k) for k in ("micro_batches", "micro_batch_s", "step_tail_s", "bubble")})
        return out


def recompute_modes(cfg: Config) -> tuple[str, ...]:
    """The recomputation modes to try: all of them, cheapest first ("auto"), or the configured one."""
    if cfg.recompute == "auto":
        return RECOMPUTE
    if cfg.recompute not in RECOMPUTE:
        raise ValueError(f"recompute {cfg.recompute!r}: one of auto, {', '.join(RECOMPUTE)}")
    return (cfg.recompute,)


def candidates(system: str, cfg: Config) -> tuple[list[tuple[int, systems.Memory]], str]:
    """What may run: the largest fitting micro-batch (up to the configured one) for each memory
    layout (luwu: with and without the prefetch buffer) and recomputation mode, leaving out a
    mode when a cheaper one fits the same micro-batch. Empty with the reason when nothing fits."""
    out, why = [], ""
    for prefetch in ((True, False) if system == "luwu" else (True,)):
        best = 0  # the largest micro-batch a cheaper recomputation mode fitted
        for recompute in recompute_modes(cfg):
            for b in range(cfg.micro_batch or 1, best, -1):
                mem = systems.memory(system, cfg, b, prefetch, recompute)
                ok, why = mem.fits(cfg)
                if ok:
                    out.append((b, mem))
                    best = b
                    break
    return out, why


def run_system(system: str, cfg: Config) -> SystemResult:
    """The fastest fitting layout of `system`: the micro-batch, recomputation mode and (luwu)
    prefetch buffer that give the most tokens/s."""
    options, why = candidates(system, cfg)
    if not options:
        return SystemResult(system, False, reason=f"does not fit at micro-batch 1: {why}")
    runs = [_run(system, cfg, b, mem) for b, mem in options]
    return max(runs, key=lambda r: r.tokens_per_s)


def _timeline(system: str, cfg: Config, costs: list[LayerCost], mem: systems.Memory,
              step: bool) -> tuple[Timeline, float, float]:
    tl = Timeline()
    starts = systems.schedule(system, tl, cfg, costs, mem, step)
    t0, t1 = starts[-2], starts[-1]
    if t1 <= t0:  # the last iteration's start is its predecessor's end
        raise AssertionError("simulated iteration has no duration")
    return tl, t0, t1


def p2p_seconds(cfg: Config, b: int) -> float:
    """Seconds one micro-batch spends sending and receiving between pipeline stages: its b s h
    activations forward and their gradient backward, each GPU its 1/tp (Megatron's scatter/gather
    optimisation, Narayanan et al. 2021 section 4.1), over the worker NIC; not overlapped with
    compute (0 without pipelining)."""
    if cfg.pp == 1:
        return 0.0
    m = cfg.model
    nbytes = cfg.dtype_bytes * b * m.seq * m.hidden / cfg.tp
    return 2 * (nbytes / (cfg.net.link * systems.luwu_wire_efficiency(cfg)) + cfg.net.latency)


def _run(system: str, cfg: Config, b: int, mem: systems.Memory) -> SystemResult:
    costs = layer_costs(cfg, b, mem.recompute)
    tl, t0, t1 = _timeline(system, cfg, costs, mem, step=True)
    m, p = micro_batches(cfg), cfg.pp
    if m == 1 and p == 1:
        dt, slot, tail = t1 - t0, t1 - t0, 0.0
    else:  # (m + p - 1) slots of a micro-batch without the step, then the step once (1F1B or GPipe alike)
        _, a0, a1 = _timeline(system, cfg, costs, mem, step=False)
        slot = a1 - a0 + p2p_seconds(cfg, b)
        tail = max(0.0, (t1 - t0) - (a1 - a0))
        dt = (m + p - 1) * slot + tail
    tokens = m * b * cfg.model.seq  # per data-parallel replica, i.e. per tp x pp GPUs
    gpus = cfg.tp * cfg.pp
    busy = tl.busy(t0, t1)
    util = {r: busy.get(r, 0.0) / (t1 - t0) for r in RESOURCES if r in busy}
    bottleneck = max(util, key=util.__getitem__)
    hw = sum(c.hw_flops for c in costs) * m
    return SystemResult(
        system, True, micro_batch=b, iteration_s=dt, tokens_per_s_per_worker=tokens / dt / gpus,
        tokens_per_s=tokens / dt * cfg.workers,
        mfu=model_flops_per_token(cfg) * tokens / dt / gpus / cfg.gpu.peak_flops,
        hfu=hw / dt / cfg.gpu.peak_flops, utilisation=util, bottleneck=RESOURCES[bottleneck],
        memory_gib_per_worker=mem.gpu / 2**30, prefetch=mem.prefetch, recompute=mem.recompute, timeline=tl,
        window=(t0, t1), micro_batches=m, micro_batch_s=slot, step_tail_s=tail,
        bubble=(p - 1) / (m + p - 1))


def largest_trainable(system: str, cfg: Config) -> str | None:
    """The largest preset model shape this system can train at micro-batch 1 (memory only)."""
    best = None
    for m in sorted((MODELS[k] for k in LADDER), key=lambda m: m.params):
        if candidates(system, cfg.with_(model=m, micro_batch=1))[0]:
            best = m.name
    return best


def simulate(cfg: Config, which: tuple[str, ...] = systems.SYSTEMS,
             progress: Callable[[str], object] | None = None) -> dict:
    """Simulate one steady-state training iteration of each system in `which`.

    Args:
        cfg: the hardware, model and job (hardware.Config; hardware.PRESETS has the paper's testbed).
        which: systems to run (systems.SYSTEMS names); luwu is always included.
        progress: optional callable(str) told what is being simulated.

    Returns:
        A dict with `results` (system -> SystemResult), `speedup_over_<system>` keys (luwu's
        tokens/s over the system's; None where the system cannot run the model) and
        `largest_trainable` (system -> preset model name or None).

    Examples::

        >>> from luwu.simulate import PRESETS, MODELS, simulate
        >>> out = simulate(PRESETS["paper-testbed"].with_(model=MODELS["opt-1.3b"]))
        >>> out["speedup_over_zero_3"] > 1
        True
    """
    which = tuple(dict.fromkeys(("luwu",) + tuple(which)))
    results = {}
    for s in which:
        if progress:
            progress(f"simulating {systems.LABELS[s]}")
        results[s] = run_system(s, cfg)
    out: dict = {"results": results}
    base = results["luwu"]
    for s, r in results.items():
        if s != "luwu":
            out[f"speedup_over_{s}"] = (base.tokens_per_s / r.tokens_per_s
                                        if base.feasible and r.feasible else None)
    if progress:
        progress("largest trainable models")
    out["largest_trainable"] = {s: largest_trainable(s, cfg) for s in which}
    return out
