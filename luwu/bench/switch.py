"""Throughput of the software switch in a 4-worker allreduce pattern over real UDP sockets on
loopback, next to a raw UDP relay measured the same way in the same run.

Each worker process pushes `size` bytes as ALLREDUCE packets (the switch's lane count) through
its switch port with a window of `pool` packets and waits for every RESULT (go-back-N on a
timeout). The relay baseline replaces the switch by a process that returns every datagram to
its sender: N packets in and N out per chunk, like the switch, with the same batching. Prints
grep-able `key: value` lines (or `--json`); `--out DIR` writes switch_bench.json and a PNG;
`--profile FILE` writes the switch process's cProfile stats.

    luwu bench switch --workers 4 --size 32MiB --mode jumbo
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import select
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from luwu.dataplane.integrity import seal_headers
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.p4runtime.entries import StarSession, star_program
from luwu.dataplane.protocol import (
    HEADER_LEN,
    Dtype,
    MsgType,
    aggregation_packet_len,
    header_view,
    lanes_for_mode,
    ver_type,
)
from luwu.dataplane.usage import UserError, positive_int, size

HOST = "127.0.0.1"
SESSION = 1
EPOCH = 1
RETRY_TIMEOUT = 0.2  # s without progress before a worker goes back to its oldest missing packet (no loss on loopback: only spurious)
STARTUP_TIMEOUT = 60  # s for processes to come up
RUN_TIMEOUT = 600  # s for one measured run
STALL_TIMEOUT = 10  # s without any new result before a worker gives up
SEQ_SPACE = 1 << 32  # the header's seq field


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=positive_int, default=4, help="worker processes (1..32)")
    p.add_argument("--size", type=size, default="32MiB", help="bytes each worker reduces (e.g. 8MiB, 64MiB)")
    p.add_argument("--mode", default="jumbo", help="packet mode or lane count (jumbo = 2048 lanes)")
    p.add_argument("--pool", type=positive_int, default=256, help="slot pool = window of packets in flight per worker")
    p.add_argument("--batch", type=positive_int, default=64, help="datagrams per recvmmsg/sendmmsg")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs of each; the best is reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, help="directory for switch_bench.json and switch_bench.png")
    p.add_argument("--profile", type=Path, help="write the switch process's cProfile stats here")


# --- the two servers ---------------------------------------------------------------------------

def _switch_server(lanes: int, peers: list, pool: int, batch: int, conn, profile: str | None) -> None:
    """The switch with one port per worker, wired to the worker's fixed address. Between runs
    the parent sends ("epoch", n): a new session instance, as a new job would get."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from luwu.dataplane.heap import freeze_collector, retain_freed_memory
    from luwu.dataplane.switch.config import SwitchConfig
    from luwu.dataplane.switch.switch import SoftwareSwitch

    retain_freed_memory()  # as `luwu switch` does: the turns' temporaries stay mapped (dataplane/heap.py)
    workers = len(peers)
    sw = SoftwareSwitch(SwitchConfig(lanes=lanes, slots=max(pool, 64), batch=batch))
    ports = {r + 1: sw.attach_udp(r + 1, (HOST, 0), peer=tuple(peers[r])) for r in range(workers)}
    sw.load_runtime(runtime(workers, pool))

    def control() -> None:
        while True:
            msg = conn.recv()
            if msg == "stop":
                return
            if msg == "cpu":
                conn.send(time.process_time())
                continue
            with sw.lock:
                entry = runtime(workers, pool, epoch=msg[1])["table_entries"][0]
                sw.tables.insert(entry["table"], entry["match"], entry["action_name"], entry["action_params"],
                                 modify=True)
            conn.send("ok")
    if profile:  # run the event loop in this thread under cProfile; a helper thread waits for "stop"
        import cProfile
        import threading

        from luwu.dataplane.switch.loop import EventLoop

        loop = EventLoop(sw)
        conn.send(ports)
        def control_then_stop() -> None:
            control()
            loop._stop.set()

        threading.Thread(target=control_then_stop, daemon=True).start()
        prof = cProfile.Profile()
        prof.runcall(loop._run)
        prof.dump_stats(profile)
        sw.stop()
    else:
        sw.start()
        freeze_collector()  # as `luwu switch` does (dataplane/heap.py)
        conn.send(ports)
        control()
        sw.stop()
    conn.send(sw.counters())


def runtime(workers: int, pool: int, epoch: int = EPOCH) -> dict:
    """One collective session over `workers` ranks on ports 1..workers."""
    cfg = star_program(workers, [StarSession(SESSION, 0, pool, epoch)], worker_port=lambda r: r + 1)
    return {"table_entries": [e.to_dict() for e in cfg.table_entries],
            "multicast_group_entries": [g.to_dict() for g in cfg.multicast_group_entries]}


def _relay_server(max_len: int, batch: int, conn) -> None:
    sock = BatchSocket(udp_socket(HOST, 0), batch=batch, max_len=max_len)
    conn.send({0: sock.sock.getsockname()[:2]})
    poller = select.poll()
    poller.register(sock.fd, select.POLLIN)
    while True:
        k = sock.recv()
        if k:
            sock.reflect(k)
            continue
        if conn.poll():
            msg = conn.recv()
            if msg == "stop":
                break
            conn.send(time.process_time())  # "cpu"
        poller.poll(20)
    conn.send({})


# --- a worker ------------------------------------------------------------------------------------

def _worker(rank: int, bound, target: tuple[str, int], lanes: int, npkts: int, pool: int, batch: int, start,
            result_q, run: int = 0) -> None:
    """Rank `rank`'s run number `run` over `bound`, its UDP socket (bound by the parent for the
    server's life). The run's packets carry sequence numbers from run * npkts (the switch echoes
    `seq` and never reads it), so a late datagram of an earlier run on the same socket -- a result
    of a resend, arriving after the drain below -- is not taken for one of this run's results."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    plen = aggregation_packet_len(lanes)
    sock = BatchSocket(bound, batch=batch, max_len=plen + 64, peers=1)
    while sock.recv():  # late datagrams of the previous run (a fresh socket would never see them)
        pass
    sock.set_peer(0, *target)
    sock.default_peer = 0
    rows = np.zeros((npkts, plen), dtype=np.uint8)
    h = header_view(rows)
    seqs = np.arange(npkts, dtype=np.int64)
    base = run * npkts % SEQ_SPACE
    h["ver_type"] = ver_type(MsgType.ALLREDUCE)
    h["flags"] = ((seqs // pool) & 1).astype(np.uint8)
    h["session"] = SESSION
    h["worker"] = rank
    h["count"] = lanes
    h["seq"] = (base + seqs) % SEQ_SPACE
    h["slot"] = seqs % pool
    h["dtype"] = int(Dtype.INT32)
    h["numel"] = npkts * lanes
    seal_headers(rows)
    rows[:, HEADER_LEN:] = (rank + 1) % 256
    got = np.zeros(npkts, dtype=bool)
    lengths = np.full(batch, plen, dtype=np.int64)
    ack = nxt = received = resends = 0
    poller = select.poll()
    poller.register(sock.fd, select.POLLIN)
    start.wait()
    t0 = last = last_new = time.perf_counter()
    while ack < npkts:
        while nxt < npkts and nxt < ack + pool:
            n = min(batch, npkts - nxt, ack + pool - nxt)
            sock.send_rows(rows, np.arange(nxt, nxt + n), lengths[:n])
            nxt += n
        k = sock.recv()
        if k:
            s = (header_view(sock.rx[:k])["seq"].astype(np.int64) - base) % SEQ_SPACE
            s = s[s < npkts]  # this run's results only
            fresh = np.unique(s[~got[s]])
            got[fresh] = True
            if len(fresh):
                last_new = time.perf_counter()
            received += len(fresh)
            while ack < npkts and got[ack]:
                ack += 1
            last = time.perf_counter()
        elif time.perf_counter() - last > RETRY_TIMEOUT:
            nxt = ack  # go back N
            resends += 1
            last = time.perf_counter()
        else:
            poller.poll(2)
        if time.perf_counter() - last_new > STALL_TIMEOUT or time.perf_counter() - t0 > RUN_TIMEOUT:
            break
    result_q.put((rank, time.perf_counter() - t0, received, resends))


class _Server:
    """A switch or relay process kept up across the interleaved runs."""

    def __init__(self, ctx, kind: str, args, lanes: int, profile: str | None):
        self.kind = kind
        self.conn, child = ctx.Pipe()
        # the workers' sockets, bound here once and handed to each run's worker processes: the
        # server is wired to their addresses, so they stay taken for its life (a port found free
        # and bound again later could be taken meanwhile by any socket bound to port 0)
        self.sockets = [udp_socket(HOST) for _ in range(args.workers)]
        self.local = [s.getsockname()[:2] for s in self.sockets]
        target: Callable[..., None]
        a: tuple
        if kind == "switch":
            target, a = _switch_server, (lanes, self.local, args.pool, args.batch, child, profile)
        else:
            target, a = _relay_server, (aggregation_packet_len(lanes) + 64, args.batch, child)
        self.proc = ctx.Process(target=target, args=a)
        self.proc.start()
        if not self.conn.poll(STARTUP_TIMEOUT):
            self.proc.kill()
            raise RuntimeError(f"the {kind} process did not start within {STARTUP_TIMEOUT} s")
        self.ports = self.conn.recv()
        self.runs: list[dict] = []

    def target(self, rank: int) -> tuple[str, int]:
        return self.ports[rank + 1] if self.kind == "switch" else self.ports[0]

    def ask(self, msg):
        self.conn.send(msg)
        return self.conn.recv()

    def stop(self) -> dict:
        try:
            self.conn.send("stop")
            counters = self.conn.recv() if self.conn.poll(30) else {}
        except (OSError, EOFError):
            counters = {}
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        for sock in self.sockets:
            sock.close()
        return counters


def _results(server: _Server, procs: list, result_q) -> list:
    """Every worker's result; a worker that exits without one fails the run at once, by name."""
    res: list = []
    deadline = time.monotonic() + RUN_TIMEOUT + STARTUP_TIMEOUT
    gone: dict[int, float] = {}  # rank -> when it was first seen exited with no result read yet
    while len(res) < len(procs):
        try:
            res.append(result_q.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        done = {r[0] for r in res}
        now = time.monotonic()
        for rank, p in enumerate(procs):
            # a worker that put its result and exited cleanly may still have it in flight: a grace
            # period for those, none for a worker that failed
            if rank not in done and p.exitcode is not None and (p.exitcode != 0 or now - gone.setdefault(rank, now) > 5):
                raise RuntimeError(f"{server.kind} run: worker {rank} exited with code {p.exitcode} before its "
                                   "result (its error is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.kind} run: no result from workers {sorted(set(range(len(procs))) - done)} "
                               f"within {RUN_TIMEOUT + STARTUP_TIMEOUT} s")
    return res


def _one_run(ctx, server: _Server, index: int, args, lanes: int, npkts: int) -> dict:
    if server.kind == "switch":
        server.ask(("epoch", EPOCH + index))  # a new session instance for every run
    start, result_q = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, server.sockets[r], server.target(r), lanes, npkts, args.pool,
                                               args.batch, start, result_q, index)) for r in range(args.workers)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let every worker import and build its packets
    cpu0 = server.ask("cpu")
    start.set()
    res = _results(server, procs, result_q)
    cpu1 = server.ask("cpu")
    for p in procs:
        p.join(10)
    if any(r[2] != npkts for r in res):
        raise RuntimeError(f"{server.kind}: a worker did not receive all {npkts} results: {res}")
    seconds = max(r[1] for r in res)
    pkts_in = args.workers * npkts
    return {"seconds": seconds, "packets_per_s": pkts_in / seconds,
            "gbytes_per_s": pkts_in * aggregation_packet_len(lanes) / seconds / 1e9,
            "cpu_us_per_packet": (cpu1 - cpu0) / pkts_in * 1e6, "worker_resends": sum(r[3] for r in res)}


def _summary(runs: list[dict]) -> dict:
    rates = sorted(r["packets_per_s"] for r in runs)
    best = max(runs, key=lambda r: r["packets_per_s"])
    return {"packets_per_s": best["packets_per_s"], "gbytes_per_s": best["gbytes_per_s"],
            "median_packets_per_s": float(np.median(rates)),
            "cpu_us_per_packet": float(np.median([r["cpu_us_per_packet"] for r in runs])), "runs": runs}


def run(args) -> int:
    if not 1 <= args.workers <= 32:
        raise UserError("--workers must be 1..32")
    try:
        lanes = lanes_for_mode(args.mode)
    except ValueError as exc:
        raise UserError(f"--mode: {exc}") from None
    nbytes = args.size
    npkts = max(1, -(-nbytes // (4 * lanes)))
    from rich.progress import Progress

    ctx = mp.get_context("spawn")
    relay = switch = None
    try:
        relay = _Server(ctx, "relay", args, lanes, None)
        switch = _Server(ctx, "switch", args, lanes, str(args.profile) if args.profile else None)
        with Progress(transient=True) as progress:
            task = progress.add_task("relay and switch, interleaved", total=2 * args.repeat)
            for i in range(args.repeat):  # interleaved, so both see the same background load
                for server in (relay, switch):
                    server.runs.append(_one_run(ctx, server, i, args, lanes, npkts))
                    progress.advance(task)
    finally:
        counters = switch.stop() if switch else {}
        if relay:
            relay.stop()
    r, sw = _summary(relay.runs), _summary(switch.runs)
    ev = counters.get("events", {})
    result = {
        "workers": args.workers, "lanes": lanes, "packet_bytes": aggregation_packet_len(lanes),
        "packets_per_worker": npkts, "pool": args.pool, "batch": args.batch, "repeat": args.repeat,
        "switch_packets_per_s": sw["packets_per_s"], "switch_gbytes_per_s": sw["gbytes_per_s"],
        "relay_packets_per_s": r["packets_per_s"], "relay_gbytes_per_s": r["gbytes_per_s"],
        "switch_median_packets_per_s": sw["median_packets_per_s"], "relay_median_packets_per_s": r["median_packets_per_s"],
        "switch_over_relay": sw["packets_per_s"] / r["packets_per_s"],
        "switch_over_relay_median": sw["median_packets_per_s"] / r["median_packets_per_s"],
        "switch_cpu_us_per_packet": sw["cpu_us_per_packet"], "relay_cpu_us_per_packet": r["cpu_us_per_packet"],
        "switch_completed": ev.get(1, (0, 0))[0], "switch_resent": ev.get(3, (0, 0))[0],
        "switch_runs_s": [x["seconds"] for x in sw["runs"]], "relay_runs_s": [x["seconds"] for x in r["runs"]],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        _write(args.out, result)
    return 0


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "switch_bench.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(8, 3.2))
    names = ["raw UDP relay", "software switch"]
    ax[0].bar(names, [result["relay_packets_per_s"] / 1e3, result["switch_packets_per_s"] / 1e3],
              color=["grey", "tab:blue"])
    ax[0].set_ylabel("packets in / s (thousands, best run)")
    ax[1].bar(names, [result["relay_cpu_us_per_packet"], result["switch_cpu_us_per_packet"]],
              color=["grey", "tab:blue"])
    ax[1].set_ylabel("server CPU us per packet in")
    fig.suptitle(f"{result['workers']}-worker allreduce, {result['lanes']} lanes "
                 f"({result['packet_bytes']} B packets): switch = {result['switch_over_relay']:.0%} of relay")
    fig.tight_layout()
    fig.savefig(out / "switch_bench.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luwu bench switch", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
