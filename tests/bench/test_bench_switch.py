"""`luwu bench switch` as a user runs it, tiny: the switch and the relay each carry every packet of
every run (the workers' sockets are bound once by the bench and handed to each run's workers),
a worker that dies without a result fails its run at once, by name, instead of leaving the
bench waiting for it, and a late result of an earlier run on the same socket is not counted.
Figures are printed, never asserted on."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import luwu.bench.switch as bench
from luwu.bench.switch import _results
from luwu.dataplane.net.mmsg import udp_socket

LUWU = Path(sys.executable).parent / "luwu"


def test_switch_bench_completes_every_packet_of_every_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(LUWU), "bench", "switch", "--workers", "2", "--size", "256KiB", "--repeat", "2",
                          "--json", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["switch_completed"] == res["repeat"] * res["packets_per_worker"]  # a phase completed per packet index
    assert len(res["switch_runs_s"]) == len(res["relay_runs_s"]) == 2
    assert res["switch_cpu_us_per_packet"] > 0 and res["relay_cpu_us_per_packet"] > 0
    assert (tmp_path / "switch_bench.json").is_file()
    print({k: v for k, v in res.items() if not isinstance(v, list)})


def test_a_worker_that_exits_without_its_result_fails_the_run_by_name():
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=sys.exit, args=(3,))]
    procs[0].start()
    procs[0].join(60)
    with pytest.raises(RuntimeError, match="relay run: worker 0 exited with code 3 before its result"):
        _results(SimpleNamespace(kind="relay"), procs, ctx.Queue())


def _peer(answer, stop: threading.Event) -> tuple[socket.socket, threading.Thread]:
    """A UDP peer on loopback that answers each datagram with `answer(datagram)` until `stop`."""
    sock = udp_socket()
    sock.settimeout(0.05)

    def serve() -> None:
        while not stop.is_set():
            try:
                data, addr = sock.recvfrom(65536)
            except TimeoutError:
                continue
            sock.sendto(answer(data), addr)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return sock, t


def _run_worker(bound, peer: socket.socket, run: int) -> tuple:
    q: queue.Queue = queue.Queue()
    start = threading.Event()
    start.set()
    t = threading.Thread(target=bench._worker, args=(0, bound, peer.getsockname()[:2], 64, 8, 4, 4, start, q, run))
    t.start()
    t.join(60)
    return q.get(timeout=1)


def test_late_results_of_an_earlier_run_are_not_counted(monkeypatch):
    """Run 0 against a peer that echoes (and records) every packet; then run 1 on the same socket
    against a peer that answers only with run 0's packets, as late resent results of run 0 would
    arrive. Run 1 must count none of them (it gives up after its stall timeout with 0 results)."""
    monkeypatch.setattr(bench, "STALL_TIMEOUT", 1.0)
    bound = udp_socket()
    seen: list[bytes] = []
    stop = threading.Event()
    echo, t = _peer(lambda d: seen.append(d) or d, stop)
    try:
        _, _, received, _ = _run_worker(bound, echo, run=0)
        assert received == 8
    finally:
        stop.set()
        t.join(5)
        echo.close()
    stale = list(seen)
    stop = threading.Event()
    late, t = _peer(lambda d: stale.pop(0) if stale else b"", stop)
    try:
        _, _, received, _ = _run_worker(bound, late, run=1)
    finally:
        stop.set()
        t.join(5)
        late.close()
        bound.close()
    assert received == 0, f"run 1 took {received} of run 0's results for its own"
