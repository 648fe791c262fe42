"""The simulator's inputs as plain dataclasses, and the presets: the LuWu/DisDP paper's testbed and
the OPT-family model shapes up to 1T parameters.

Every number here is a hardware figure with its source in docs/simulator.md ("Inputs"), or a
software speed that `luwu simulate --calibrate` replaces with a measurement on this machine.
Nothing here was adjusted to make a simulated result match a published one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from luwu.controller.planner import FRAME_OVERHEAD

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (OPT architecture): `layers` blocks of width `hidden`."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 50272
    seq: int = 1024

    @property
    def block_params(self) -> int:
        """Parameters of one block: QKV + output projection (4h^2 + 4h), MLP (8h^2 + 5h), two norms (4h)."""
        h = self.hidden
        return 12 * h * h + 13 * h

    @property
    def embed_params(self) -> int:
        """Token and learned position embeddings; the output head is tied to the token embedding."""
        return self.vocab * self.hidden + (self.seq + 2) * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.embed_params


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    memory: float  # bytes
    hbm: float  # bytes/s
    gemm_efficiency: float  # fraction of peak a large bf16 GEMM reaches
    hbm_efficiency: float  # fraction of HBM bandwidth an element-wise kernel reaches
    reserved: float  # bytes the CUDA context, allocator and workspaces keep


@dataclass(frozen=True)
class Network:
    link: float  # bytes/s per worker NIC, each direction
    latency: float  # seconds, one way through one switch
    payload: int  # bytes of luwu payload per packet (the packet size a deployment uses)
    frame_overhead: int = FRAME_OVERHEAD  # Ethernet/IPv4/UDP headers + preamble, FCS, inter-frame gap
    ack_frame: int = 84  # a minimum Ethernet frame on the wire (64 B + 20 B preamble and gap)
    switch_slots: int = 16384  # aggregation slots (SwitchML's register size)
    nccl_contention: tuple = ((2, 1.02), (4, 1.35), (8, 1.44))  # luwu/NCCL collective bandwidth next to a GEMM
    nccl_alpha: float = 20e-6  # seconds per ring step (RoCE)
    topology: str = "star"  # star | multi-rack | rail-only
    rack_size: int = 32  # workers per ToR (multi-rack) or GPUs per NVLink domain (rail-only)
    nvlink: float = 300 * GB  # bytes/s inside an NVLink domain, each direction (rail-only)
    nvlink_efficiency: float = 0.8  # NCCL's bus bandwidth over NVLink's (nccl-tests on DGX A100: ~230 of 300 GB/s)
    nvlink_alpha: float = 5e-6  # seconds per ring step inside a server (NVLink)


@dataclass(frozen=True)
class OptimizerNode:
    cores: int
    memory_bw: float  # bytes/s, both sockets (STREAM-achievable)
    ram: float  # bytes
    ssds: int
    ssd_read: float  # bytes/s per SSD
    ssd_write: float  # bytes/s per SSD
    ssd_capacity: float  # bytes per SSD
    disk_efficiency: float  # fraction of the SSDs' bandwidth the node's state store reaches (calibrated)
    adam_params_per_core: float  # AdamW params/s of one core (calibrated)
    adam_bytes_per_param: float = 60.0  # memory traffic of one AdamW step per parameter (paper: 349 GB/s / 5.8 G/s)
    adam_flops_per_param: float = 17.0  # paper
    nodes: int = 1
    # fraction of the RAM that caches served copies when the state does not fit in RAM: luwu's
    # node default (dataplane/optimizer/spec.py NodeConfig.served_fraction; a test checks they agree)
    served_fraction: float = 0.25


@dataclass(frozen=True)
class Host:
    """A worker's host CPU, RAM and NVMe (what ZeRO-Offload/Infinity offload to)."""

    cores: float  # a share of the host's cores when GPUs share it (Config.host_shared_by)
    memory_bw: float
    ram: float
    nvme: float  # bytes/s, read and write together (one drive)
    nvme_capacity: float
    pcie: float  # bytes/s host <-> GPU, each direction
    cpu_adam_params_per_core: float  # DeepSpeed CPU-Adam, params/s per core


@dataclass(frozen=True)
class Config:
    model: ModelShape
    gpu: Gpu
    net: Network
    node: OptimizerNode
    host: Host
    workers: int = 8
    micro_batch: int | None = None  # sequences per worker per iteration; None = the preset's
    # activation recomputation: "auto" runs each system with the least recomputation that fits its
    # memory (none, selective, full: workload.RECOMPUTE), or one of those for all
    recompute: str = "auto"
    dtype_bytes: int = 2  # bf16 training
    grad_wire_bytes: float | None = None  # bytes per gradient element a worker pushes; None = luwu's wire format
    grad_format: str = "fixed32"  # luwu's wire format when grad_wire_bytes is None: fixed32 | fixed16
    iterations: int = 3  # simulated back to back; the last is reported (steady state)
    extras: dict = field(default_factory=dict)
    # parallelism beyond data parallelism (docs/simulator.md "Tensor and pipeline parallelism"):
    # `workers` is the data-parallel degree; each data-parallel replica is tp x pp GPUs
    tp: int = 1  # tensor parallelism inside a server, over NVLink (Megatron-LM)
    pp: int = 1  # pipeline stages across servers
    schedule: str = "1f1b"  # pipeline schedule: 1f1b | gpipe (same bubble, different memory)
    micro_batches: int | None = None  # micro-batches per iteration and replica; None: 1, or 4 x pp with pp > 1
    collective: str = "ring"  # the baselines' NCCL algorithm: ring | pat | sharp
    host_shared_by: int = 1  # GPUs sharing one worker host (CPU, DRAM, NVMe) and its NVLink
    activation_offload: bool = False  # checkpointed activations kept in host RAM, not on the GPU

    def with_(self, **kw) -> Config:
        return replace(self, **kw)


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(name, layers, hidden, heads)


# OPT family (Zhang et al. 2022, table 1), the paper's custom 175B, and 530B/1T shapes
# (Megatron-Turing NLG 530B: 105 x 20480; 1T: Narayanan et al. 2021, 128 x 25600).
MODELS: dict[str, ModelShape] = {m.name: m for m in [
    _opt("opt-1.3b", 24, 2048, 32), _opt("opt-2.7b", 32, 2560, 32), _opt("opt-6.7b", 32, 4096, 32),
    _opt("opt-13b", 40, 5120, 40), _opt("opt-30b", 48, 7168, 56), _opt("opt-66b", 64, 9216, 72),
    _opt("175b", 96, 12288, 96), _opt("530b", 105, 20480, 128), _opt("1t", 128, 25600, 160),
    # the DisDP revision's larger shapes (issue 30): 128-dimensional heads
    _opt("276b", 112, 14336, 112), _opt("505b", 124, 18432, 144), _opt("1t-disdp", 172, 22016, 172),
]}
# the shapes `largest_trainable` climbs: the OPT family and the GPT-3-like ladder up to 1T (the
# paper's "largest trainable" rows); the DisDP shapes are --model choices (docs/simulator.md)
LADDER = ("opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "opt-30b", "opt-66b", "175b", "530b", "1t")
ALIASES = {"opt-175b": "175b", "custom-175b": "175b", "1.3b": "opt-1.3b", "13b": "opt-13b", "66b": "opt-66b"}

A100_40GB = Gpu("A100-40GB", peak_flops=312e12, memory=40 * 2**30, hbm=1.555e12, gemm_efficiency=0.75,
                hbm_efficiency=0.8, reserved=2 * 2**30)

# The paper's testbed: 8 workers (A100-40GB, 100 Gbps), one Tofino, one node with 2x Xeon Gold 5320
# (2 x 26 cores, 2 x 8 channels DDR4-2933) and 12 SSDs.
PAPER_TESTBED = Config(
    model=MODELS["175b"],
    gpu=A100_40GB,
    net=Network(link=100e9 / 8, latency=2e-6, payload=1024),
    node=OptimizerNode(cores=52, memory_bw=0.8 * 2 * 8 * 23.47 * GB, ram=512 * GB, ssds=12, ssd_read=6.8 * GB,
                       ssd_write=6.8 * GB, ssd_capacity=7.68e12, disk_efficiency=0.8, adam_params_per_core=0.25e9),
    host=Host(cores=52, memory_bw=0.8 * 2 * 8 * 23.47 * GB, ram=256 * GB, nvme=6.8 * GB, nvme_capacity=7.68e12,
              pcie=25 * GB, cpu_adam_params_per_core=0.1e9),
    workers=8,
    micro_batch=8,
    grad_wire_bytes=2,  # the paper's LuWu pushes S bytes per layer of S bf16 bytes (docs/simulator.md)
)

V100_32GB = Gpu("V100-32GB", peak_flops=125e12, memory=32 * 2**30, hbm=900e9, gemm_efficiency=0.75,
                hbm_efficiency=0.8, reserved=2 * 2**30)

# One NVIDIA DGX-2 (the ZeRO-Offload and ZeRO-Infinity papers' machine): 16 V100-32GB on NVSwitch
# (150 GB/s each way per GPU), one host for all of them: 2x Xeon Platinum 8168 (48 cores, 12
# channels DDR4-2666), 1.5 TB of DRAM, 8 NVMe drives of 3.84 TB (about 3 GB/s each), PCIe 3.0 x16
# per GPU (about 12 GB/s); 100 Gbit/s InfiniBand per GPU pair, modelled as 100 Gbit/s per GPU.
DGX_2 = Config(
    model=MODELS["opt-13b"],
    gpu=V100_32GB,
    net=Network(link=100e9 / 8, latency=2e-6, payload=1024, nvlink=150 * GB),
    node=PAPER_TESTBED.node,
    host=Host(cores=48, memory_bw=0.8 * 12 * 21.33 * GB, ram=1.5e12, nvme=8 * 3 * GB, nvme_capacity=8 * 3.84e12,
              pcie=12 * GB, cpu_adam_params_per_core=0.1e9),
    workers=16,
    micro_batch=8,
    host_shared_by=16,
)

PRESETS: dict[str, Config] = {"paper-testbed": PAPER_TESTBED, "dgx-2": DGX_2}


def model_named(name: str) -> ModelShape:
    """A preset model shape by name (case-insensitive; `opt-175b` and `custom-175b` are `175b`)."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise KeyError(name)
    return MODELS[key]
