"""`luwu bench allreduce --grad-format fixed16|fixed32|both`: what each float-sum wire format
(docs/protocol.md 5.2) costs through torch, wall time and CPU, in the same run.

For each format in turn a job of spawned ranks runs the `luwu` backend with `LUWU_GRAD_FORMAT` set
to it and, per size, times `dist.all_reduce` as the default sweep does (torch_sweep.py: restore the
input, `dist.barrier()`, the call; the slowest rank's time per iteration, the median over them).
Around the timed iterations rank 0 reads the CPU time of every process of the job (the ranks,
their engine daemons, the switch: every descendant of the bench's process, `children.descendants`)
and, for the same number of iterations, what the loop costs without the all_reduce (the input's
copy and the barrier), which is taken off. Printed per size and format:
`grad_<fmt>_<size>_ms` (median wall time per call), `grad_<fmt>_<size>_cpu_ms` (CPU ms per call,
all processes), `_cpu_ms_switch`, `_cpu_ms_engines`, `_cpu_ms_ranks` (the same by role), and with
both formats `grad_<size>_cpu_ratio_fixed16_to_fixed32` and `grad_<size>_ms_ratio_fixed16_to_fixed32`.

CPU time is the robust figure on a shared host; wall times there are not.

`kernel_s_per_gb`: the endpoint's encode and decode of one format in one process, CPU seconds per
GB of float32 (`kernel_costs`), printed as `grad_<fmt>_kernel_s_per_gb` (`_encode`, `_decode`).
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import numpy as np

JOB_TIMEOUT = 900.0  # s a job's ranks may take for all sizes (bounded; the machine may be shared)
WARMUP_CALLS = 400  # 256 KiB all_reduces before the sizes (compiled kernels loaded, caches warm)
FORMATS = ("fixed32", "fixed16")


def _role(cmdline: str) -> str:
    if "luwu.dataplane.loopback.daemon" in cmdline or "switch" in cmdline:
        return "switch"
    if "luwu.dataplane.engine.daemon" in cmdline:
        return "engines"
    if "spawn_main" in cmdline:
        return "ranks"
    return "other"


def _job_cpu(pids: dict[int, str]) -> dict[str, float]:
    """CPU seconds so far of processes `pids` ({pid: cmdline}), summed by role."""
    from luwu.dataplane.process.children import cpu_seconds

    out = {"switch": 0.0, "engines": 0.0, "ranks": 0.0, "other": 0.0}
    for pid, cmd in pids.items():
        out[_role(cmd)] += cpu_seconds(pid)
    return out


def _rank(rank: int, workers: int, store: str, sizes: list[int], iters: int, out_q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        import luwu  # noqa: F401 - registers the luwu backend
        from luwu.bench import allreduce_check, rendezvous
        from luwu.dataplane.process.children import descendants

        torch.set_num_threads(1)
        rendezvous.init_group("luwu", store, rank, workers)
        out: dict = {}
        try:
            w = torch.ones(1 << 16)
            for _ in range(WARMUP_CALLS // 4):
                dist.all_reduce(w.fill_(1.0))
            for nbytes in sizes:
                x = torch.from_numpy(allreduce_check.inputs(rank, max(1, nbytes // 4), "float32"))
                t = torch.empty_like(x)
                t.copy_(x)
                dist.all_reduce(t)  # one untimed call
                pids = descendants(os.getppid()) if rank == 0 else {}
                cpu: list[dict[str, float]] = []
                times = []
                for timed in (False, True):  # the loop without the call, then with it
                    dist.barrier()
                    c0 = _job_cpu(pids)
                    for _ in range(iters):
                        t.copy_(x)
                        dist.barrier()
                        t0 = time.perf_counter()
                        if timed:
                            dist.all_reduce(t)
                            times.append(time.perf_counter() - t0)
                    dist.barrier()
                    c1 = _job_cpu(pids)
                    cpu.append({k: (c1[k] - c0[k]) / iters for k in c0})
                out[nbytes] = {"seconds": times, "cpu": {k: cpu[1][k] - cpu[0][k] for k in cpu[0]}}
        finally:
            dist.destroy_process_group()
        out_q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported by the parent, which would otherwise wait out its timeout
        out_q.put((rank, "error", traceback.format_exc()))


def run_format(fmt: str, workers: int, sizes: list[int], iters: int) -> dict:
    """One job of `workers` ranks with `LUWU_GRAD_FORMAT=fmt`: {bytes: {"ms", "cpu_ms", "cpu_ms_<role>"}}.

    Args:
        fmt (str): "fixed32" or "fixed16".
        workers (int): ranks.
        sizes (list[int]): bytes per rank's float32 tensor.
        iters (int): timed all_reduce calls per size.

    Returns:
        dict: per size, the median wall ms per call and the job's CPU ms per call (all, by role).

    Example:
        >>> run_format("fixed16", 2, [1 << 20], 5)[1 << 20]["cpu_ms"] > 0  # doctest: +SKIP
        True
    """
    from luwu.bench.rendezvous import spawn_ranks

    before = os.environ.get("LUWU_GRAD_FORMAT")
    os.environ["LUWU_GRAD_FORMAT"] = fmt  # the spawned ranks' backend reads it
    try:
        got: dict = spawn_ranks(_rank, workers, (sizes, iters), fmt, JOB_TIMEOUT)
    finally:
        if before is None:
            os.environ.pop("LUWU_GRAD_FORMAT", None)
        else:
            os.environ["LUWU_GRAD_FORMAT"] = before
    res: dict = {}
    for nbytes in sizes:
        per_iter = np.max([got[r][nbytes]["seconds"] for r in range(workers)], axis=0)
        cpu = got[0][nbytes]["cpu"]
        row = {"ms": float(np.median(per_iter)) * 1e3, "cpu_ms": sum(cpu.values()) * 1e3}
        row.update({f"cpu_ms_{k}": v * 1e3 for k, v in cpu.items() if k != "other"})
        res[nbytes] = row
    return res


def kernel_costs(fmt: str, nbytes: int = 16 << 20, lanes: int = 16000, seconds: float = 1.0) -> dict:
    """CPU seconds per GB of float32 of one endpoint's encode (exponents + packet fill: headers,
    quantised lanes, check words) and decode (check-word verification + decode into a buffer) of
    one format, in this process, rows as the engine's rings hold them; sums of one contribution
    (n = 1: every row verifies). Repeats for about `seconds` of CPU each.

    Returns:
        dict: {"encode", "decode", "total"} in s/GB.
    """
    from luwu.dataplane import fixed16
    from luwu.dataplane.engine.dispatch import widened
    from luwu.dataplane.engine.packets import QuantizedLanes, aggregation_fill, check_words_of, fixed16_fill
    from luwu.dataplane.integrity import FIXED16_BLOCK, data_lanes
    from luwu.dataplane.protocol import HEADER_LEN, Dtype, MsgType
    from luwu.dataplane.quantize import block_exponents, chunk_exponents, dequantize_rows_into, sum_shift

    x = np.random.default_rng(7).standard_normal(nbytes // 4, dtype=np.float32)
    out = np.empty_like(x)
    common: dict[str, Any] = {"seg_start": 0, "msg_type": MsgType.ALLREDUCE, "session": 1, "worker": 0, "pool_base": 0,
              "pool_size": 1024, "tensor": 0}
    if fmt == "fixed16":
        per = fixed16.layout(lanes)[1]
        width = fixed16.row_len(lanes)
    else:
        per = data_lanes(lanes, Dtype.FIXED32)
        width = HEADER_LEN + 4 * lanes
    k = -(-x.size // per)
    rows = np.zeros((k, width), dtype=np.uint8)
    lens = np.zeros(k, dtype=np.int64)
    sel = np.arange(k, dtype=np.int64)

    def encode() -> None:
        if fmt == "fixed16":
            exps = block_exponents(x, FIXED16_BLOCK)
            fill = fixed16_fill(lanes=lanes, x=x, exps=exps, n=1, **common)
        else:
            exps = chunk_exponents(x, per)
            fill = aggregation_fill(lanes=per, numel=x.size, dtype=Dtype.FIXED32, flags=0, row_lanes=lanes,
                                    lanes_of=QuantizedLanes(x, exps, per, 1), exponents=exps, **common)
        for i0 in range(0, k, 32):  # blocks of rows, as the send stream fills them
            i1 = min(k, i0 + 32)
            fill(i0, i1, rows[i0:i1], lens[i0:i1])

    received: list[np.ndarray] = []

    def as_received() -> np.ndarray:
        """The rows as a receiver reads them: a short last packet (docs/protocol.md 3.3) widened back
        to the switch's lanes, as the engine's dispatch does (`dispatch.widened`), once."""
        if not received:
            rx = rows.copy()
            short = np.flatnonzero((lens < width) & (lens > HEADER_LEN))
            if len(short):
                dtype = int(Dtype.FIXED16 if fmt == "fixed16" else Dtype.FIXED32)
                rx[short] = widened(rows, short, lens[short], np.full(len(short), dtype), lanes)
            received.append(rx)
        return received[0]

    def decode() -> None:
        rows = as_received()
        if fmt == "fixed16":
            if not fixed16.decode_rows(rows, sel, lanes, 1, out).all():  # verified and decoded in one call
                raise RuntimeError("fixed16 rows failed their check")
            return
        from luwu.dataplane.protocol import DATA_HEADER

        h = rows[:, :HEADER_LEN].copy().view(DATA_HEADER).reshape(-1)
        got = rows[:, HEADER_LEN + 4 * per:HEADER_LEN + 4 * per + 8].view(">u4").astype(np.uint64)
        if not (check_words_of(rows, sel, per, h, int(Dtype.FIXED32), 1) == got).all():
            raise RuntimeError("fixed32 rows failed their check")
        exps = h["exponent"].astype(np.int64)
        full = x.size // per
        dequantize_rows_into(rows, sel[:full], HEADER_LEN, per, sum_shift(exps[:full], 1), sel[:full],
                             out[:full * per].reshape(full, per))

    res = {}
    for name, fn in (("encode", encode), ("decode", decode)):
        fn()  # compiled kernels loaded
        reps, t0 = 0, time.process_time()
        while reps < 1000 and (reps < 3 or time.process_time() - t0 < seconds):
            fn()
            reps += 1
        res[name] = (time.process_time() - t0) / (reps * x.nbytes / 1e9)
    res["total"] = res["encode"] + res["decode"]
    return res


def compare(formats: list[str], workers: int, sizes: list[int], iters: int, kernels: bool = True) -> dict:
    """`run_format` for each of `formats` (and `kernel_costs`), with the fixed16 / fixed32 ratios."""
    res: dict = {"workers": workers, "iters": iters, "formats": {}}
    for fmt in formats:
        res["formats"][fmt] = {"sizes": run_format(fmt, workers, sizes, iters)}
        if kernels:
            res["formats"][fmt]["kernel_s_per_gb"] = kernel_costs(fmt)
    if len(formats) == 2:
        a, b = res["formats"]["fixed16"], res["formats"]["fixed32"]
        res["ratios"] = {n: {"cpu": a["sizes"][n]["cpu_ms"] / b["sizes"][n]["cpu_ms"],
                             "ms": a["sizes"][n]["ms"] / b["sizes"][n]["ms"]} for n in sizes}
        if kernels:
            res["kernel_ratio"] = a["kernel_s_per_gb"]["total"] / b["kernel_s_per_gb"]["total"]
    return res


def print_lines(res: dict) -> None:
    """Grep-able `key: value` lines of `compare`'s result."""
    from luwu.bench.torch_sweep import size_label

    for fmt, r in res["formats"].items():
        for nbytes, row in r["sizes"].items():
            for k, v in row.items():
                print(f"grad_{fmt}_{size_label(nbytes)}_{k}: {v:.3f}")
        for k, v in r.get("kernel_s_per_gb", {}).items():
            print(f"grad_{fmt}_kernel_s_per_gb{'' if k == 'total' else '_' + k}: {v:.4f}")
    for nbytes, r in res.get("ratios", {}).items():
        print(f"grad_{size_label(nbytes)}_cpu_ratio_fixed16_to_fixed32: {r['cpu']:.3f}")
        print(f"grad_{size_label(nbytes)}_ms_ratio_fixed16_to_fixed32: {r['ms']:.3f}")
    if "kernel_ratio" in res:
        print(f"grad_kernel_ratio_fixed16_to_fixed32: {res['kernel_ratio']:.3f}")


def run(args) -> int:
    """`luwu bench allreduce --grad-format F` (allreduce.py hands over here): the formats compared."""
    import json

    from luwu.bench.sizes import parse_size
    from luwu.dataplane.process.usage import UserError

    if args.engine or args.drop or args.no_ceiling or args.dtype != "float32" or args.verify:
        raise UserError("--grad-format compares float32 sums through torch: without --engine, --drop, "
                        "--no-ceiling, --verify or --dtype int32")
    if not 1 <= args.workers <= 32:
        raise UserError("--workers must be 1..32 (one switch bitmap)")
    sizes = args.sizes or ([parse_size(args.size)] if args.size else [1 << 20, 16 << 20])
    os.environ["LUWU_MODE"] = args.mode
    if args.transport != "both":
        os.environ["LUWU_TRANSPORT"] = args.transport
    formats = list(FORMATS) if args.grad_format == "both" else [args.grad_format]
    res = compare(formats, args.workers, sizes, args.iters)
    if args.json:
        print(json.dumps(res, default=float))
    else:
        print(f"workers: {args.workers}\niters: {args.iters}\nmode: {args.mode}")
        print_lines(res)
    return 0
