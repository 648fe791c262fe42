"""The flags of `luwu simulate` and the `Config` they build (a preset, a model, the cluster's shape,
the systems to compare): shared by the command (command.py) and the scenarios it can print
(scenarios.py), which run the same flags in process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from luwu.dataplane.process.usage import UserError, positive_float, positive_int, size
from luwu.simulate import systems
from luwu.simulate.hardware import MODELS, PRESETS, Config, model_named


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="paper-testbed", help="hardware preset")
    p.add_argument("--model", default=None, help=f"model shape: {', '.join(MODELS)} (default: the preset's)")
    p.add_argument("--layers", type=positive_int, help="override the model's number of blocks")
    p.add_argument("--hidden", type=positive_int, help="override the model's hidden size")
    p.add_argument("--heads", type=positive_int, help="override the model's attention heads")
    p.add_argument("--seq", type=positive_int, help="sequence length (default 1024)")
    p.add_argument("--workers", type=positive_int, help="data-parallel workers (one GPU each)")
    p.add_argument("--micro-batch", type=positive_int, help="sequences per worker per iteration "
                                                             "(the largest that fits, up to this)")
    p.add_argument("--recompute", choices=["auto", "full", "selective", "none"], default=None,
                   help="activation recomputation: full (checkpoint each block's input), selective (recompute "
                        "only attention's core), none; auto (default): the least that fits each system's memory")
    p.add_argument("--no-checkpointing", action="store_true", help="keep all activations (= --recompute none)")
    p.add_argument("--gpu-tflops", type=positive_float, help="GPU peak dense bf16 TFLOP/s")
    p.add_argument("--gpu-memory", type=size, help="GPU memory (e.g. 80GiB)")
    p.add_argument("--gemm-efficiency", type=positive_float, help="fraction of peak a large GEMM reaches")
    p.add_argument("--link-gbps", type=positive_float, help="NIC bandwidth per worker, each direction (Gbit/s)")
    p.add_argument("--payload", type=positive_int, help="luwu payload bytes per packet")
    p.add_argument("--grad-bytes", type=int, choices=[2, 4], help="bytes per gradient element on luwu's wire "
                   "(4: luwu's 32-bit fixed point; 2: the paper's 16-bit; default: the preset's)")
    p.add_argument("--grad-format", choices=["fixed32", "fixed16"], default=None,
                   help="luwu's gradient wire format (docs/protocol.md 5.2): fixed32 (4 B per element) or fixed16 "
                        "(16-bit values, an exponent per 112: 2.03-2.3 B by payload); sets the gradient bytes instead of --grad-bytes")
    p.add_argument("--topology", choices=["star", "multi-rack", "rail-only"], help="network topology")
    p.add_argument("--rack-size", type=positive_int, help="workers per ToR (multi-rack) or GPUs per NVLink "
                                                           "domain (rail-only)")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel GPUs per replica, inside a server over NVLink")
    p.add_argument("--pp", type=positive_int, help="pipeline stages per replica, across servers")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], help="pipeline schedule (default 1f1b)")
    p.add_argument("--micro-batches", type=positive_int, help="micro-batches per iteration and replica "
                                                               "(default 1, or 4 x --pp with pipelining)")
    p.add_argument("--collective", choices=list(systems.COLLECTIVES),
                   help="the baselines' NCCL algorithm: ring (default), pat, sharp (in-network reduction)")
    p.add_argument("--host-shared-by", type=positive_int, help="GPUs sharing one worker host's CPU, DRAM and "
                                                                "NVMe (and NVLink); e.g. 8 for one 8-GPU server")
    p.add_argument("--activation-offload", action="store_true",
                   help="keep checkpointed activations in host RAM (over PCIe) instead of on the GPU")
    p.add_argument("--optimizer-nodes", type=positive_int, help="optimizer nodes (layers are sharded over them)")
    p.add_argument("--node-ram", type=size, help="RAM per optimizer node (e.g. 512GB)")
    p.add_argument("--ssds", type=positive_int, help="SSDs per optimizer node")
    p.add_argument("--systems", default=",".join(systems.SYSTEMS),
                   help=f"comma-separated systems to compare with luwu ({', '.join(systems.SYSTEMS)})")
    p.add_argument("--plan", action="store_true", help="size the optimizer nodes, RAM, SSDs and network")
    p.add_argument("--paper", action="store_true", help="compare with the paper's published figures (testbed)")
    p.add_argument("--scenarios", action="store_true", help="print the issue-30 scenarios (tensor/pipeline "
                                                            "parallelism, collectives, shared hosts, >175B) and exit")
    p.add_argument("--calibrate", action="store_true", help="measure the node's software speeds here first "
                                                            "(runs `luwu bench optimizer` briefly)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key: value lines")
    p.add_argument("--out", type=Path, default=Path("luwu-simulate"),
                   help="directory for simulate.json and simulate.png (default: ./luwu-simulate)")
    p.add_argument("--no-files", action="store_true", help="write no files")


def build_config(args) -> Config:
    """The preset with the flags applied; UserError for a combination that cannot be simulated."""
    cfg = PRESETS[args.preset]
    model = cfg.model
    if args.model:
        try:
            model = model_named(args.model)
        except KeyError:
            raise UserError(f"unknown model {args.model!r}: choose one of {', '.join(MODELS)} "
                            "(or start from one and override --layers/--hidden/--heads)") from None
    over = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq") if getattr(args, k)}
    if over:
        model = replace(model, name=model.name + "-custom", **over)
    if model.hidden % model.heads:
        raise UserError(f"--hidden {model.hidden} is not a multiple of --heads {model.heads}")
    gpu, net, node = cfg.gpu, cfg.net, cfg.node
    if args.gpu_tflops:
        gpu = replace(gpu, peak_flops=args.gpu_tflops * 1e12)
    if args.gpu_memory:
        gpu = replace(gpu, memory=float(args.gpu_memory))
    if args.gemm_efficiency:
        if args.gemm_efficiency > 1:
            raise UserError(f"--gemm-efficiency {args.gemm_efficiency} must be at most 1")
        gpu = replace(gpu, gemm_efficiency=args.gemm_efficiency)
    if args.link_gbps:
        net = replace(net, link=args.link_gbps * 1e9 / 8)
    if args.payload:
        from luwu.dataplane import protocol

        if args.payload > protocol.MAX_UDP_PAYLOAD - protocol.HEADER_LEN:
            raise UserError(f"--payload {args.payload} exceeds a UDP datagram "
                            f"({protocol.MAX_UDP_PAYLOAD - protocol.HEADER_LEN} bytes of payload at most)")
        net = replace(net, payload=args.payload)
    if args.topology:
        net = replace(net, topology=args.topology)
    if args.rack_size:
        net = replace(net, rack_size=args.rack_size)
    if args.optimizer_nodes:
        node = replace(node, nodes=args.optimizer_nodes)
    if args.node_ram:
        node = replace(node, ram=float(args.node_ram))
    if args.ssds:
        node = replace(node, ssds=args.ssds)
    kw = {"model": model, "gpu": gpu, "net": net, "node": node}
    if args.workers:
        kw["workers"] = args.workers
    if args.micro_batch:
        kw["micro_batch"] = args.micro_batch
    if args.no_checkpointing and args.recompute not in (None, "none"):
        raise UserError(f"--no-checkpointing contradicts --recompute {args.recompute}: give one of them")
    if args.recompute or args.no_checkpointing:
        kw["recompute"] = args.recompute or "none"
    if args.grad_bytes and args.grad_format:
        raise UserError("--grad-bytes and --grad-format both set the gradient bytes: give one of them")
    if args.grad_bytes:
        kw["grad_wire_bytes"] = args.grad_bytes
    if args.grad_format:
        kw["grad_wire_bytes"] = None  # the format's own bytes, not the preset's figure
        kw["grad_format"] = args.grad_format
    if args.tp:
        if model.heads % args.tp:
            raise UserError(f"--tp {args.tp} does not divide the model's {model.heads} attention heads")
        kw["tp"] = args.tp
    if args.pp:
        if args.pp > model.layers:
            raise UserError(f"--pp {args.pp} exceeds the model's {model.layers} blocks")
        kw["pp"] = args.pp
    for flag in ("schedule", "micro_batches", "collective", "host_shared_by"):
        if getattr(args, flag):
            kw[flag] = getattr(args, flag)
    if args.activation_offload:
        kw["activation_offload"] = True
    return cfg.with_(**kw)


def parse_systems(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in systems.SYSTEMS]
    if bad or not names:
        raise UserError(f"--systems: unknown {', '.join(bad) or '(empty)'}: choose from {', '.join(systems.SYSTEMS)}")
    return names
