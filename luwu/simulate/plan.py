"""Capacity planning from the same model (`luwu simulate --plan`): how many optimizer nodes, how
much RAM and how many SSDs a luwu job needs so that the node never holds the workers back, and
what the network must carry.

Method: simulate luwu with an ideal node (infinitely fast cores and disks) to get the iteration
time the workers and links allow; derive the node work per second that keeps up with it (AdamW
parameters/s, SSD bytes/s each way, link bytes/s each way) over the backward pass, when the
steps happen; size nodes, SSDs and RAM from the configured node's figures; then simulate the
planned cluster and report its predicted iteration time next to the ideal one.
"""

from __future__ import annotations

import math
from dataclasses import replace

from luwu.simulate import systems
from luwu.simulate.core import run_system
from luwu.simulate.hardware import Config

MAX_SSDS_PER_NODE = 24  # NVMe drives one 2-socket server can attach at full PCIe 4.0 x4 each
READ_AHEAD_LAYERS = 4  # layers of state in the node's RAM at once: read ahead, stepping, written back


def _ideal(cfg: Config) -> Config:
    big = 1e18
    return cfg.with_(node=replace(cfg.node, adam_params_per_core=big, memory_bw=big, ssd_read=big, ssd_write=big))


def plan(cfg: Config) -> dict:
    """Size the optimizer nodes for a job.

    Args:
        cfg: the job (model, workers, micro-batch) and the hardware; `cfg.node` is the kind of
            node to buy (cores, memory bandwidth, SSD model), whose count is planned here.

    Returns:
        A dict: `optimizer_nodes`, `ssds_per_node`, `ram_gb_per_node` (minimum, for the
        pipeline), `ram_gb_per_node_served_in_ram`, `ram_gb_per_node_all_in_ram` and the RAM the
        planned cluster was simulated with, `ssd_tb_per_node`, the node rates needed,
        the network (`worker_link_gbps`, `node_link_gbps`, `switch_gbps`, `switch_slots`), the
        ideal and the planned iteration time (`predicted_iteration_s`), and `limits` naming
        what set each count.

    Examples::

        >>> from luwu.simulate import PRESETS, MODELS
        >>> from luwu.simulate.plan import plan
        >>> plan(PRESETS["paper-testbed"].with_(model=MODELS["175b"]))["optimizer_nodes"] >= 1
        True
    """
    ideal = run_system("luwu", _ideal(cfg))
    if not ideal.feasible:
        return {"feasible": False, "reason": ideal.reason}
    P, nd, net = cfg.model.params, cfg.node, cfg.net
    t_iter = ideal.iteration_s
    if ideal.timeline is None:  # run_system keeps the timeline of every feasible run
        raise AssertionError("a feasible simulated run has no timeline")
    bwd = [t for t in ideal.timeline.tasks if t.iteration == ideal.timeline.tasks[-1].iteration - 1
           and t.label.startswith("bwd")]
    t_bwd = (max(t.end for t in bwd) - min(t.start for t in bwd)) if bwd else t_iter
    # RAM that spares the SSDs the served-copy reads: the node caches them in served_fraction of its RAM
    served_in_ram_bytes = systems.PARAM_BYTES * P / nd.served_fraction
    adam_need = P / t_bwd
    disk_r_need = 12 * P / t_bwd + 2 * systems.PARAM_BYTES * P / t_iter  # state, and served copies if on disk
    disk_w_need = (12 + systems.PARAM_BYTES) * P / t_bwd
    link_in = systems.grad_bytes(cfg) * P / t_bwd
    link_out = 2 * systems.PARAM_BYTES * P / t_iter
    link = net.link * systems.luwu_wire_efficiency(cfg)
    per_ssd_r, per_ssd_w = nd.ssd_read * nd.disk_efficiency, nd.ssd_write * nd.disk_efficiency
    state = systems.NODE_STATE_BYTES * P
    if state <= nd.ram:  # everything stays in the node's RAM: the SSDs only take checkpoints
        disk_r_need = disk_w_need = 0.0
    ssd_bw = max(disk_r_need / per_ssd_r, disk_w_need / per_ssd_w)
    counts = {
        "AdamW (cores and memory bandwidth)": adam_need / systems.node_adam_rate(cfg),
        "node link": max(link_in, link_out) / link,
        "SSD bandwidth": ssd_bw / MAX_SSDS_PER_NODE,
        "SSD capacity (state and one checkpoint)": 2 * state / (MAX_SSDS_PER_NODE * nd.ssd_capacity),
    }
    nodes = max(1, math.ceil(max(counts.values()) - 1e-9))
    ssds = max(1, math.ceil(max(ssd_bw, 2 * state / nd.ssd_capacity) / nodes - 1e-9))
    ram_min = READ_AHEAD_LAYERS * 12 * cfg.model.block_params / nodes
    ram = state / nodes if state <= nd.ram else min(nd.ram, max(ram_min, served_in_ram_bytes / nodes))
    planned = cfg.with_(node=replace(nd, nodes=nodes, ssds=ssds, ram=ram))
    got = run_system("luwu", planned)
    rtt = 2 * systems.hops(cfg) * net.latency + 2 * net.payload / net.link  # base RTT plus one packet each way
    slots = math.ceil(net.link * max(rtt, 10e-6) / net.payload) * 2  # bandwidth-delay product, two sets
    return {
        "feasible": True,
        "optimizer_nodes": nodes,
        "limits": {k: round(v, 3) for k, v in counts.items()},
        "ssds_per_node": ssds,
        "ssd_tb_per_node": 2 * state / nodes / 1e12,
        "ram_gb_per_node": ram_min / 1e9,
        "ram_gb_per_node_served_in_ram": max(ram_min, served_in_ram_bytes / nodes) / 1e9,
        "ram_gb_per_node_all_in_ram": state / nodes / 1e9,
        "ram_gb_per_node_simulated": ram / 1e9,
        "adam_params_per_s_needed": adam_need,
        "ssd_read_gbps_needed": disk_r_need / 1e9,
        "ssd_write_gbps_needed": disk_w_need / 1e9,
        "node_flops_needed": adam_need * nd.adam_flops_per_param,
        "node_memory_gbps_needed": adam_need * nd.adam_bytes_per_param / 1e9,
        "worker_link_gbps": {"in": (2 * systems.PARAM_BYTES * P / t_iter) * 8 / 1e9,
                             "out": (systems.grad_bytes(cfg) * P / t_iter) * 8 / 1e9,
                             "line": net.link * 8 / 1e9},
        "node_link_gbps": {"in": link_in * 8 / 1e9 / nodes, "out": link_out * 8 / 1e9 / nodes},
        "switch_gbps": cfg.workers * net.link * 8 * 2 / 1e9,
        "switch_slots": slots,
        "ideal_iteration_s": t_iter,
        "predicted_iteration_s": got.iteration_s if got.feasible else None,
        "predicted_bottleneck": got.bottleneck if got.feasible else None,
    }


def node_budget(cfg: Config) -> dict:
    """What one optimizer node must sustain to keep up with its link (the paper's "node budget"):
    gradients arrive at `link x wire efficiency / gradient bytes` parameters/s, each needing
    `adam_flops_per_param` FLOPs, `adam_bytes_per_param` bytes of memory traffic and 14 B of SSD
    traffic each way (12 B of state and the 2-byte served copy). Returns params/s, GFLOP/s,
    memory GB/s and SSD GB/s each way."""
    rate = cfg.net.link * systems.luwu_wire_efficiency(cfg) / systems.grad_bytes(cfg)
    return {"params_per_s": rate, "gflops": rate * cfg.node.adam_flops_per_param / 1e9,
            "memory_gbps": rate * cfg.node.adam_bytes_per_param / 1e9,
            "ssd_gbps_each_way": rate * systems.NODE_STATE_BYTES / 1e9}
