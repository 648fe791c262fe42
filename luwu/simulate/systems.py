"""One training iteration of each system, layer by layer, on the event timeline (events.py).

Each `schedule_*` issues work in the order the system's runtime does: luwu (model in network:
pull, forward, pull again unless kept, recompute + backward, push; the optimizer node's
step-centric pipeline per shard and its served-copy cache), ZeRO-3/FSDP, ZeRO-Offload, ZeRO-Infinity (CPU and NVMe), DDP with NCCL
ring allreduce and DDP with ATP/SwitchML-style in-network allreduce. `memory_*` gives each
system's bytes per worker GPU (and per host where it offloads). docs/simulator.md derives
every duration.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from luwu.controller.planner import wire_efficiency
from luwu.dataplane import integrity, protocol
from luwu.simulate.events import Timeline
from luwu.simulate.hardware import Config, Host
from luwu.simulate.workload import (
    LayerCost,
    activation_bytes,
    block_activations,
    offloaded_activation_bytes,
    stage_layers,
)

COLLECTIVES = ("ring", "pat", "sharp")  # the baselines' NCCL algorithm (docs/simulator.md "Collectives")
SYSTEMS = ("luwu", "zero_3", "zero_offload", "zero_infinity_cpu", "zero_infinity", "ddp_ring", "ddp_atp")
LABELS = {"luwu": "luwu", "zero_3": "ZeRO-3/FSDP", "zero_offload": "ZeRO-Offload",
          "zero_infinity_cpu": "ZeRO-Infinity (CPU)", "zero_infinity": "ZeRO-Infinity (NVMe)",
          "ddp_ring": "DDP + ring allreduce (NCCL)", "ddp_atp": "DDP + ATP in-network allreduce"}

PARAM_BYTES = protocol.DTYPE_ITEMSIZE[protocol.Dtype.BF16]  # PARAM packets: the served bf16 copy
GRAD_BYTES = protocol.DTYPE_ITEMSIZE[protocol.Dtype.FIXED32]  # luwu's GRAD/AGG lanes: 32-bit fixed point
NODE_STATE_BYTES = 12 + PARAM_BYTES  # fp32 master, m, v + the served copy (docs/optimizer.md)
ATP_PAYLOAD, ATP_PACKET = 62 * 4, 306  # ATP: 62 int32 per packet, 306 B on the wire before the frame gap
NODE_CHUNKS = 8  # shards per layer in the node's pipeline (enough to show the pipelining)


# ----------------------------------------------------------------------------- rates

def luwu_wire_efficiency(cfg: Config) -> float:
    """Payload bytes per byte on the wire for luwu packets of `cfg.net.payload` bytes."""
    return wire_efficiency(cfg.net.payload, cfg.net.frame_overhead)


def nccl_bandwidth(cfg: Config) -> float:
    """Bytes/s a NCCL ring moves per worker and direction while GEMMs run beside it: luwu's own
    collective bandwidth (the link at luwu's wire efficiency) divided by the paper's measured
    ratio of LuWu's to NCCL's collective bandwidth next to a GEMM. The ratio is to LuWu's
    bandwidth, not to the line rate, so NCCL's own framing is already inside it."""
    pts = cfg.net.nccl_contention
    n = cfg.workers
    if cfg.host_shared_by >= n > 1:  # the whole data-parallel group is one server: NCCL over NVLink
        return cfg.net.nvlink * cfg.net.nvlink_efficiency
    if n <= pts[0][0]:
        ratio = pts[0][1]
    elif n >= pts[-1][0]:
        ratio = pts[-1][1]
    else:  # linear in log2(N) between the measured points
        for (n0, r0), (n1, r1) in itertools.pairwise(pts):
            if n0 <= n <= n1:
                ratio = r0 + (r1 - r0) * (math.log2(n) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
                break
    return cfg.net.link * luwu_wire_efficiency(cfg) / ratio


def collective(cfg: Config, op: str, nbytes: float) -> tuple[float, float, float]:
    """(seconds on the worker NIC out, seconds on it in, latency) of one NCCL collective among the
    `workers` data-parallel GPUs over `nbytes` per worker (the whole buffer; `op`: allgather,
    reduce_scatter or allreduce), by `cfg.collective`:

    * ring: (N-1)/N of the buffer each way (2(N-1)/N for allreduce) at `nccl_bandwidth`, 2(N-1)
      steps of `nccl_alpha`;
    * pat (NCCL 2.23's parallel aggregated trees for allgather and reduce-scatter, one GPU per
      node): the ring's bytes, 2 ceil(log2 N) steps; allreduce = reduce-scatter + allgather;
    * sharp (NVIDIA SHARP in the InfiniBand switches, NCCL's CollNet): a reduction sends the
      buffer once and receives the sum (allreduce) or its 1/N (reduce-scatter), at the link rate
      with no GPU reduction kernels (luwu's own collective bandwidth), through the switch and
      back; an allgather stays a ring.
    """
    n, net = cfg.workers, cfg.net
    bw = nccl_bandwidth(cfg)
    if cfg.collective == "sharp" and op != "allgather":
        rate = net.link * luwu_wire_efficiency(cfg)
        back = nbytes if op == "allreduce" else nbytes / n
        return nbytes / rate, back / rate, 2 * hops(cfg) * net.latency
    share = (2 if op == "allreduce" else 1) * nbytes * (n - 1) / n
    alpha = net.nvlink_alpha if cfg.host_shared_by >= n > 1 else net.nccl_alpha
    if cfg.collective == "pat" and n > 1:
        steps = (2 if op == "allreduce" else 1) * 2 * math.ceil(math.log2(n))
    else:
        steps = 2 * (n - 1)
    return share / bw, share / bw, steps * alpha * hops(cfg)


def host_of(cfg: Config) -> Host:
    """One GPU's share of its worker host: CPU cores, memory bandwidth, RAM and NVMe divided by the
    GPUs that share the host (`host_shared_by`); each GPU keeps its own PCIe x16 link."""
    h, k = cfg.host, cfg.host_shared_by
    if k == 1:
        return h
    return Host(cores=h.cores / k, memory_bw=h.memory_bw / k, ram=h.ram / k, nvme=h.nvme / k,
                nvme_capacity=h.nvme_capacity / k, pcie=h.pcie, cpu_adam_params_per_core=h.cpu_adam_params_per_core)


def gpu_params(cfg: Config) -> int:
    """Parameters one GPU works on: its pipeline stage's blocks and the tied embedding, split
    over the tp GPUs (the model's parameters when tp = pp = 1)."""
    m = cfg.model
    return (stage_layers(cfg) * m.block_params + m.embed_params) // cfg.tp


def node_share(cfg: Config) -> int:
    """Distinct parameter shards a luwu node serves at once: one per GPU of a replica (tp x pp),
    each multicast to the data-parallel workers; a GPU's timeline sees 1/share of the node."""
    return cfg.tp * cfg.pp


def grad_bytes(cfg: Config) -> float:
    """Payload bytes per gradient element on luwu's wire: the configured figure, else the format's:
    4 for fixed32; for fixed16 the packet's 4L bytes over its data elements, two per lane (an exponent
    slot per FIXED16_BLOCK elements and 4 check lanes ride along: 2.29 at 1024-byte payloads, 2.03 at 32000)."""
    if cfg.grad_wire_bytes:
        return cfg.grad_wire_bytes
    if cfg.grad_format == "fixed16":
        lanes = cfg.net.payload // 4
        return 4 * lanes / integrity.data_lanes(lanes, protocol.Dtype.FIXED16)
    return GRAD_BYTES


def node_adam_rate(cfg: Config) -> float:
    """Parameters/s of AdamW on the optimizer node: cores x per-core speed, capped by memory bandwidth."""
    nd = cfg.node
    return min(nd.cores * nd.adam_params_per_core, nd.memory_bw / nd.adam_bytes_per_param)


def host_adam_rate(cfg: Config) -> float:
    h = host_of(cfg)
    return min(h.cores * h.cpu_adam_params_per_core, h.memory_bw / cfg.node.adam_bytes_per_param)


def rail_width(cfg: Config) -> int:
    """GPUs that share the network through NVLink (rail-only), else 1."""
    return max(1, min(cfg.net.rack_size, cfg.workers)) if cfg.net.topology == "rail-only" else 1


def hops(cfg: Config) -> int:
    return 2 if cfg.net.topology == "multi-rack" and cfg.workers > cfg.net.rack_size else 1


# ----------------------------------------------------------------------------- memory

@dataclass
class Memory:
    gpu: float  # bytes per worker GPU
    host: float = 0.0  # bytes of the worker's host RAM the system needs
    nvme: float = 0.0  # bytes of the worker's NVMe
    node_ram: float = 0.0
    node_disk: float = 0.0
    prefetch: bool = True
    recompute: str = "full"  # workload.RECOMPUTE
    keep: int = 0  # luwu: blocks kept on the GPU from forward to backward besides the last (never pulled twice)
    micro_batch: int = 0  # the micro-batch this layout holds

    def fits(self, cfg: Config) -> tuple[bool, str]:
        if self.gpu > cfg.gpu.memory:
            return False, f"GPU memory {self.gpu / 2**30:.1f} GiB > {cfg.gpu.memory / 2**30:.0f} GiB"
        host = host_of(cfg)
        if self.host > host.ram:
            return False, f"host RAM {self.host / 1e9:.0f} GB > {host.ram / 1e9:.0f} GB"
        if self.nvme > host.nvme_capacity:
            return False, f"host NVMe {self.nvme / 1e12:.1f} TB > {host.nvme_capacity / 1e12:.1f} TB"
        if self.node_disk > cfg.node.ssds * cfg.node.ssd_capacity * cfg.node.nodes:
            return False, "optimizer node SSDs too small"
        return True, ""


def memory(system: str, cfg: Config, b: int, prefetch: bool = True, recompute: str = "full") -> Memory:
    """Bytes per worker GPU (and host, node) of `system` at micro-batch b; with
    `activation_offload` the checkpointed activations take host RAM instead (workload.py)."""
    mem = _memory(system, cfg, b, prefetch, recompute)
    mem.micro_batch = b
    if cfg.activation_offload:
        mem.host += offloaded_activation_bytes(cfg, b, recompute)
    return mem


def _memory(system: str, cfg: Config, b: int, prefetch: bool, recompute: str) -> Memory:
    m, B = cfg.model, cfg.dtype_bytes
    P, layer, n = gpu_params(cfg), m.block_params // cfg.tp, cfg.workers
    kept, working = activation_bytes(cfg, b, recompute)
    act = kept + working + cfg.gpu.reserved
    if system == "luwu":
        unit = max(layer, m.embed_params // cfg.tp)  # the tied embedding is pulled like a block, not kept
        bufs = (2 if prefetch else 1) * unit * PARAM_BYTES + unit * B  # params (+ the prefetched next), grads
        state = NODE_STATE_BYTES * m.params  # the whole model's, whatever one GPU works on
        # what memory is left keeps the blocks before the last for backward (ModelInNetwork's
        # keep_last / keep_budget): the design pulls a layer again only when it was dropped
        keep = int(min(stage_layers(cfg) - 1, max(0.0, cfg.gpu.memory - bufs - act) // (layer * PARAM_BYTES)))
        return Memory(gpu=bufs + act + keep * layer * PARAM_BYTES, node_ram=min(state, cfg.node.ram),
                      node_disk=max(0.0, state - cfg.node.ram * cfg.node.nodes), prefetch=prefetch,
                      recompute=recompute, keep=keep)
    gathered = 2 * layer * B + layer * B  # a gathered layer, the prefetched next, its gradient
    if system == "zero_3":
        return Memory(gpu=16 * P / n + gathered + act, recompute=recompute)
    if system == "zero_offload":
        return Memory(gpu=B * P + 2 * layer * B + act, host=16 * P / n, recompute=recompute)
    if system == "zero_infinity_cpu":
        return Memory(gpu=gathered + act, host=(B + 12 + 4) * P / n, recompute=recompute)
    if system == "zero_infinity":
        return Memory(gpu=gathered + act, host=4 * P / n + 8 * layer * 4, nvme=(B + 12 + B) * P / n,
                      recompute=recompute)
    if system in ("ddp_ring", "ddp_atp"):
        return Memory(gpu=16 * P + 2 * 25e6 + act, recompute=recompute)
    raise ValueError(system)


# ----------------------------------------------------------------------------- luwu

def schedule_luwu(tl: Timeline, cfg: Config, costs: list[LayerCost], iterations: int, mem: Memory,
                  step: bool = True) -> list[float]:
    """Model in network. Returns the GPU start time of every iteration. `step` False: the node
    only accumulates the pushed gradients (a micro-batch before the last of an iteration)."""
    nd, K, g = cfg.node, rail_width(cfg), node_share(cfg)
    net = cfg.net.link * luwu_wire_efficiency(cfg)
    lat = 2 * hops(cfg) * cfg.net.latency  # a pull's request and first packet
    state = NODE_STATE_BYTES * cfg.model.params
    on_disk = state > nd.ram * nd.nodes
    cached = served_cached(cfg, costs)
    # the node serves g shards at once (tensor and pipeline parallelism): this GPU's share of it
    disk_r = nd.ssds * nd.ssd_read * nd.disk_efficiency * nd.nodes / g
    disk_w = nd.ssds * nd.ssd_write * nd.disk_efficiency * nd.nodes / g
    adam = node_adam_rate(cfg) * nd.nodes / g
    node_link = cfg.net.link * luwu_wire_efficiency(cfg) * nd.nodes / g
    act_io = _activation_io(cfg, mem)
    depth = 2 if mem.prefetch else 1
    ready = [0.0] * len(costs)  # when each unit's new version can be served
    starts = []
    gpu_free = 0.0

    last_start = {"pull": 0.0, "push": 0.0}  # when the latest transfer of each kind began

    def transfer(kind: str, u: int, nbytes: float, after: float, from_ram: bool = True) -> float:
        # a worker NIC carries 1/K of the layer when K GPUs share it over NVLink (rail-only)
        res = {"nic_rx" if kind == "pull" else "nic_tx": nbytes / K / net,
               "node_tx" if kind == "pull" else "node_rx": nbytes / node_link}
        read_end = 0.0
        nvlink = {"nvlink": nbytes * (K - 1) / K / cfg.net.nvlink}
        if kind == "push" and K > 1:  # reduce-scatter inside the server first, then 1/K per rail
            after = tl.run(nvlink, after, f"nvlink {u}")
        if kind == "pull" and not from_ram:  # read the served copy from the SSDs, stream it out
            read_end = tl.run({"node_disk_r": nbytes / disk_r}, after, f"read served {u}")
            after = tl.tasks[-1].start
        end = max(tl.run(res, after, f"{kind} {u}"), read_end) + lat
        last_start[kind] = tl.tasks[-1].start
        if kind == "pull" and K > 1:  # each GPU pulled 1/K on its rail: allgather inside the server
            end = tl.run(nvlink, end, f"nvlink {u}")
        return end

    # accumulating micro-batches pull nothing when every block of the stage stays on the GPU
    resident = not step and mem.keep >= len(costs) - 2
    for it in range(iterations):
        tl.iteration = it
        L = len(costs) - 1
        # (unit, GPU seconds, push its gradient after): the embedding lookup, the blocks, the tied
        # head (forward and backward at once), then the blocks in reverse
        steps = ([(0, 0.0, False)] + [(u, costs[u].fwd, False) for u in range(1, L + 1)]
                 + [(0, costs[0].fwd + costs[0].bwd, True)] + [(u, costs[u].bwd, True) for u in range(L, 0, -1)])
        buffers: list[tuple[int, float]] = []  # (unit held, when its last use ends), oldest first
        keep = set(range(L - mem.keep, L))  # kept in their own memory from forward to backward
        kept: dict[int, float] = {}  # unit -> when its forward ended
        reads: dict[int, list[float]] = {}  # step -> when each shard of its state is in the node's RAM
        for n_step, (u, secs, push) in enumerate(steps):
            held = [k for k, (v, _) in enumerate(buffers) if v == u]
            if resident:  # a micro-batch that only accumulates, with the whole stage on the GPU
                got = gpu_free
            elif push and u in kept:  # kept since its forward: no second pull
                got = kept.pop(u)
                last_start["pull"] = got
            elif held:  # still in a buffer (the last block between forward and backward)
                got = buffers.pop(held[0])[1]
                last_start["pull"] = got
            else:
                free_at = buffers.pop(0)[1] if len(buffers) >= depth else 0.0
                got = transfer("pull", u, PARAM_BYTES * costs[u].params, max(ready[u], free_at),
                               u in cached["bwd" if push else "fwd"])
            if n_step == 0:
                starts.append(max(gpu_free, got))
            if push and step and n_step not in reads:
                reads[n_step] = _read_state(tl, u, costs[u].params, got, on_disk, disk_r)
            if step and n_step + 1 < len(steps) and steps[n_step + 1][2]:
                # the node reads the next gradient's layer state while this step computes: after
                # this pull in the disk's queue, so the served copies go first
                nu = steps[n_step + 1][0]
                reads[n_step + 1] = _read_state(tl, nu, costs[nu].params, last_start["pull"], on_disk, disk_r)
            state_in = reads.pop(n_step, None)
            if push and u and act_io:  # the block's checkpoint back from the host, fetched ahead
                got = max(got, tl.run({"pcie_h2d": act_io}, got - secs, f"h2d act {u}"))
            gpu_free = tl.run({"gpu": secs}, got, ("bwd " if push else "fwd ") + str(u))
            if not push and u and act_io:  # its checkpoint out to the host while the next computes
                tl.run({"pcie_d2h": act_io}, gpu_free, f"d2h act {u}")
            if not push and u in keep:
                kept[u] = gpu_free  # its own memory: the rotating buffer is free again
            else:
                buffers.append((u, gpu_free))
            if push and not step:  # accumulated at the node: the served version does not change
                transfer("push", u, grad_bytes(cfg) * costs[u].params, gpu_free)
            elif push:  # the embedding's own lookup gradient (b*s rows) is left out: see docs
                ready[u] = _node_step(tl, cfg, u, costs[u].params,
                                      transfer("push", u, grad_bytes(cfg) * costs[u].params, gpu_free),
                                      on_disk, cached["all"], disk_w, adam, state_in)
    return starts


def served_cached(cfg: Config, costs: list[LayerCost]) -> dict:
    """Which units' served copies a pull finds in the node's RAM, as luwu's node keeps them: all
    of them when the whole state fits in RAM; else `served_fraction` of the RAM holds the k most
    recently used (LRU). Forward pulls run 1..L and backward pulls L..1, and each new version
    replaces its old one, so the forward finds the k blocks stepped last (1..k) and the backward
    the k pulled last (L-k+1..L); the embedding, used first in both, only when all fit.
    Returns {"fwd": units, "bwd": units, "all": every copy stays in RAM (none is written)}."""
    nd, L = cfg.node, len(costs) - 1
    units = set(range(L + 1))
    if NODE_STATE_BYTES * cfg.model.params <= nd.ram * nd.nodes:
        return {"fwd": units, "bwd": units, "all": True}
    cache = nd.served_fraction * nd.ram * nd.nodes
    if cache >= PARAM_BYTES * cfg.model.params:
        return {"fwd": units, "bwd": units, "all": True}
    k = min(L, int(cache // (PARAM_BYTES * cfg.model.block_params)))  # blocks whose copies fit
    k = k * L // cfg.model.layers  # this pipeline stage's share of them (all of them when pp = 1)
    return {"fwd": set(range(1, k + 1)), "bwd": set(range(L - k + 1, L + 1)), "all": False}


def _activation_io(cfg: Config, mem: Memory) -> float:
    """PCIe seconds of one block's checkpoint to or from the host (`activation_offload`), else 0."""
    if not cfg.activation_offload:
        return 0.0
    return block_activations(cfg, mem.micro_batch, mem.recompute)[0] / host_of(cfg).pcie


def _read_state(tl, u, params, after, on_disk, disk_r) -> list[float]:
    """Read a layer's optimizer state (12 B per parameter) shard by shard; when each shard is in RAM."""
    share = params / NODE_CHUNKS
    if not on_disk:
        return [after] * NODE_CHUNKS
    return [tl.run({"node_disk_r": share * 12 / disk_r}, after, f"read {u}") for _ in range(NODE_CHUNKS)]


def _node_step(tl, cfg, u, params, grad_at, on_disk, served_in_ram, disk_w, adam, state_in) -> float:
    """The node's step-centric pipeline for one layer, shard by shard: AdamW once the shard's state
    is in RAM and the summed gradient has arrived, then write the state back (with the served copy
    unless every served copy stays in RAM: a copy evicted later is written back once). Returns when
    the new version can be served: after the AdamW, which publishes it in RAM."""
    share = params / NODE_CHUNKS
    served = 0.0
    for r in state_in:
        a = tl.run({"node_cpu": share / adam}, max(r, grad_at), f"adam {u}")
        if on_disk:  # written behind the AdamW: the new version is served from RAM meanwhile
            tl.run({"node_disk_w": share * (12 + (0 if served_in_ram else PARAM_BYTES)) / disk_w}, a, f"write {u}")
        served = max(served, a)
    return served


# ----------------------------------------------------------------------------- the alternatives

def schedule_sharded(tl: Timeline, cfg: Config, costs: list[LayerCost], iterations: int, system: str,
                     mem: Memory | None = None, step: bool = True) -> list[float]:
    """ZeRO-3/FSDP and ZeRO-Infinity (CPU or NVMe): per layer, fetch the worker's partition (from
    GPU, host RAM or NVMe), allgather it, compute; in backward also reduce-scatter the gradient
    (and copy its partition to the host when offloading); the optimizer step runs after the
    backward pass (DeepSpeed's order)."""
    n, B = cfg.workers, cfg.dtype_bytes
    h = host_of(cfg)
    act_io = _activation_io(cfg, mem) if mem else 0.0
    offload = system != "zero_3"
    nvme = system == "zero_infinity"
    starts, gpu_free = [], 0.0

    def fetch(u: int, after: float) -> float:
        part = B * costs[u].params / n
        t = after
        if nvme:
            t = tl.run({"host_nvme": part / h.nvme}, t, f"nvme read {u}")
        if offload:
            t = tl.run({"pcie_h2d": part / h.pcie}, t, f"h2d {u}")
        tx, rx, lat = collective(cfg, "allgather", B * costs[u].params)
        return tl.run({"nic_rx": rx, "nic_tx": tx}, t, f"allgather {u}") + lat

    for it in range(iterations):
        tl.iteration = it
        order = list(range(len(costs)))
        done: dict[int, float] = {}
        starts.append(gpu_free)
        for j, u in enumerate(order):
            got = fetch(u, done[order[j - 2]] if j >= 2 else gpu_free)
            gpu_free = tl.run({"gpu": costs[u].fwd}, got, f"fwd {u}")
            done[u] = gpu_free
            if u and act_io:
                tl.run({"pcie_d2h": act_io}, gpu_free, f"d2h act {u}")
        back = order[::-1]
        bdone: dict[int, float] = {}
        last_grad = gpu_free
        for j, u in enumerate(back):
            got = done[u] if j == 0 else fetch(u, bdone[back[j - 2]] if j >= 2 else gpu_free)
            if u and act_io:
                got = max(got, tl.run({"pcie_h2d": act_io}, got - costs[u].bwd, f"h2d act {u}"))
            gpu_free = tl.run({"gpu": costs[u].bwd}, got, f"bwd {u}")
            bdone[u] = gpu_free
            tx, rx, lat = collective(cfg, "reduce_scatter", B * costs[u].params)
            t = tl.run({"nic_rx": rx, "nic_tx": tx}, gpu_free, f"reduce-scatter {u}") + lat
            if offload:
                t = tl.run({"pcie_d2h": B * costs[u].params / n / h.pcie}, t, f"d2h {u}")
            last_grad = max(last_grad, t)
        part = gpu_params(cfg) / n
        if not step:  # gradients accumulate until the iteration's last micro-batch
            continue
        if not offload:  # AdamW on the GPU shard: memory bound, 36 B per parameter through HBM
            gpu_free = tl.run({"gpu": part * 36 / (cfg.gpu.hbm * cfg.gpu.hbm_efficiency)}, last_grad, "adam (GPU)")
        else:
            gpu_free = _host_step(tl, cfg, part, last_grad, nvme)
    return starts


def _host_step(tl, cfg, part, after, nvme) -> float:
    """CPU-Adam on the worker's partition, in sub-groups; from NVMe it reads 12 B and writes
    12 B + the 2 B parameter per element through the one drive (reads and writes share it)."""
    h, k = host_of(cfg), NODE_CHUNKS
    rate = host_adam_rate(cfg)
    end = after
    for _ in range(k):
        share = part / k
        r = tl.run({"host_nvme": share * 12 / h.nvme}, after, "nvme read state") if nvme else after
        a = tl.run({"host_cpu": share / rate}, r, "cpu adam")
        end = tl.run({"host_nvme": share * (12 + cfg.dtype_bytes) / h.nvme}, a, "nvme write state") if nvme else a
    return end


def schedule_offload(tl: Timeline, cfg: Config, costs: list[LayerCost], iterations: int,
                     step: bool = True, mem: Memory | None = None) -> list[float]:
    """ZeRO-Offload (ZeRO-2 + CPU optimizer): parameters stay on every GPU; gradients are
    reduce-scattered during backward and their partition copied to the host; CPU-Adam; the new
    partition goes back over PCIe and is allgathered."""
    n, B, h = cfg.workers, cfg.dtype_bytes, host_of(cfg)
    act_io = _activation_io(cfg, mem) if mem else 0.0
    starts, gpu_free = [], 0.0
    for it in range(iterations):
        tl.iteration = it
        starts.append(gpu_free)
        for u in range(len(costs)):
            gpu_free = tl.run({"gpu": costs[u].fwd}, gpu_free, f"fwd {u}")
            if u and act_io:  # the block's checkpoint out to the host (activation_offload)
                tl.run({"pcie_d2h": act_io}, gpu_free, f"d2h act {u}")
        last = gpu_free
        for u in reversed(range(len(costs))):
            got = gpu_free
            if u and act_io:  # and back, fetched while the block before computes
                got = max(got, tl.run({"pcie_h2d": act_io}, got - costs[u].bwd, f"h2d act {u}"))
            gpu_free = tl.run({"gpu": costs[u].bwd}, got, f"bwd {u}")
            tx, rx, lat = collective(cfg, "reduce_scatter", B * costs[u].params)
            t = tl.run({"nic_rx": rx, "nic_tx": tx}, gpu_free, f"reduce-scatter {u}") + lat
            last = max(last, tl.run({"pcie_d2h": B * costs[u].params / n / h.pcie}, t, f"d2h {u}"))
        if not step:  # gradients accumulate until the iteration's last micro-batch
            continue
        part = gpu_params(cfg) / n
        t = _host_step(tl, cfg, part, last, nvme=False)
        t = tl.run({"pcie_h2d": B * part / h.pcie}, t, "h2d params")
        tx, rx, lat = collective(cfg, "allgather", B * gpu_params(cfg))
        gpu_free = tl.run({"nic_rx": rx, "nic_tx": tx}, t, "allgather params") + lat
    return starts


def schedule_ddp(tl: Timeline, cfg: Config, costs: list[LayerCost], iterations: int, atp: bool,
                 step: bool = True, mem: Memory | None = None) -> list[float]:
    """DDP: every GPU holds the model and the optimizer; gradients are allreduced layer by layer
    during backward, by a NCCL ring (2(N-1)/N of the bf16 gradient each way, slowed next to the
    GEMMs) or by an ATP/SwitchML-style switch (the int32 gradient up and the sum down, at ATP's
    packet efficiency); AdamW runs on the GPU after the backward pass."""
    B = cfg.dtype_bytes
    act_io = _activation_io(cfg, mem) if mem else 0.0
    starts, gpu_free = [], 0.0
    for it in range(iterations):
        tl.iteration = it
        starts.append(gpu_free)
        for u in range(len(costs)):
            gpu_free = tl.run({"gpu": costs[u].fwd}, gpu_free, f"fwd {u}")
            if u and act_io:  # the block's checkpoint out to the host (activation_offload)
                tl.run({"pcie_d2h": act_io}, gpu_free, f"d2h act {u}")
        last = gpu_free
        for u in reversed(range(len(costs))):
            got = gpu_free
            if u and act_io:  # and back, fetched while the block before computes
                got = max(got, tl.run({"pcie_h2d": act_io}, got - costs[u].bwd, f"h2d act {u}"))
            gpu_free = tl.run({"gpu": costs[u].bwd}, got, f"bwd {u}")
            if atp:
                eff = ATP_PAYLOAD / (ATP_PACKET + 24)
                rx = tx = 4 * costs[u].params / (cfg.net.link * eff)
                lat = 2 * hops(cfg) * cfg.net.latency
            else:
                tx, rx, lat = collective(cfg, "allreduce", B * costs[u].params)
            last = tl.run({"nic_rx": rx, "nic_tx": tx}, gpu_free, f"allreduce {u}") + lat
        if not step:  # gradients accumulate until the iteration's last micro-batch
            continue
        gpu_free = tl.run({"gpu": gpu_params(cfg) * 36 / (cfg.gpu.hbm * cfg.gpu.hbm_efficiency)}, last,
                          "adam (GPU)")
    return starts


def schedule(system: str, tl: Timeline, cfg: Config, costs: list[LayerCost], mem: Memory,
             step: bool = True) -> list[float]:
    """Issue `cfg.iterations` iterations of `system`; returns when each starts on the GPU. `step`
    False leaves out the optimizer step (a micro-batch that only accumulates gradients)."""
    it = cfg.iterations
    if system == "luwu":
        return schedule_luwu(tl, cfg, costs, it, mem, step)
    if system in ("zero_3", "zero_infinity_cpu", "zero_infinity"):
        return schedule_sharded(tl, cfg, costs, it, system, mem, step)
    if system == "zero_offload":
        return schedule_offload(tl, cfg, costs, it, step, mem)
    if system in ("ddp_ring", "ddp_atp"):
        return schedule_ddp(tl, cfg, costs, it, atp=system == "ddp_atp", step=step, mem=mem)
    raise ValueError(system)
