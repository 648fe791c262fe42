"""The raw UDP ceiling of a Python datapath on this machine, measured the way the switch works.

N sender processes each push S bytes in datagrams of the protocol's packet size through one
relay process that returns every datagram to its sender (the switch, too, receives N packets
per chunk and sends N), with the same batching (recvmmsg/sendmmsg) and a window per sender.
The goodput S / time is what a switch that did no work at all would reach: the allreduce
benchmark divides its own goodput by it. `cpu_s_per_gb` is the CPU the senders and the relay
used per GB of one sender's buffer (the allreduce benchmark's denominator), i.e. what moving the
bytes through a Python UDP datapath costs before any aggregation.
"""

from __future__ import annotations

import multiprocessing as mp
import select
import time

import numpy as np

from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.process.children import cpu_seconds as proc_cpu


def _relay(port_q, stop, batch: int, max_len: int) -> None:
    sock = BatchSocket(udp_socket(), batch=batch, max_len=max_len)
    port_q.put(sock.sock.getsockname()[1])
    poller = select.poll()
    poller.register(sock.fd, select.POLLIN)
    while not stop.is_set():
        k = sock.recv(block=False)
        if k:
            sock.reflect(k)
        else:
            poller.poll(50)


def _sender(relay_port: int, nbytes: int, pkt: int, window: int, batch: int, start, result_q) -> None:
    sock = BatchSocket(udp_socket(), batch=batch, max_len=pkt, peers=1)
    sock.set_peer(0, "127.0.0.1", relay_port)
    sock.default_peer = 0
    npkts = max(1, -(-nbytes // pkt))
    rows = np.zeros((min(npkts, window), pkt), dtype=np.uint8)
    sent = got = 0
    start.wait()
    poller = select.poll()
    poller.register(sock.fd, select.POLLIN)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    last = t0
    resends = 0
    while got < npkts:
        while sent < npkts and sent - got < window:
            n = min(batch, npkts - sent, window - (sent - got))
            sock.send_rows(rows, np.arange(n) % len(rows), np.full(n, pkt))
            sent += n
        k = sock.recv(block=False)
        if k:
            got += k
            last = time.perf_counter()
        elif time.perf_counter() - last > 0.05:  # a lost datagram: resend the window's worth
            sent = got
            resends += 1
            last = time.perf_counter()
        else:
            poller.poll(5)
    result_q.put((time.perf_counter() - t0, resends, time.process_time() - cpu0))


def measure(workers: int, nbytes: int, pkt: int, window: int = 256, batch: int = 64, repeat: int = 5) -> dict:
    """Goodput (bytes/s of one worker's buffer) of N senders through a do-nothing relay."""
    ctx = mp.get_context("fork")
    port_q, stop, result_q = ctx.Queue(), ctx.Event(), ctx.Queue()
    relay = ctx.Process(target=_relay, args=(port_q, stop, batch, pkt + 64), daemon=True)
    relay.start()
    port = port_q.get(timeout=30)
    assert relay.pid is not None  # started
    times, cpus = [], []
    resends = 0
    try:
        for _ in range(repeat):
            relay0 = proc_cpu(relay.pid)
            start = ctx.Event()
            procs = [ctx.Process(target=_sender, args=(port, nbytes, pkt, window, batch, start, result_q),
                                 daemon=True) for _ in range(workers)]
            for p in procs:
                p.start()
            time.sleep(0.2)
            start.set()
            per = [result_q.get(timeout=120) for _ in procs]
            for p in procs:
                p.join(10)
            times.append(max(t for t, _, _ in per))
            cpus.append(sum(c for _, _, c in per) + proc_cpu(relay.pid) - relay0)
            resends += sum(r for _, r, _ in per)
    finally:
        stop.set()
        relay.join(5)
    # medians, as luwu's and Gloo's figures are: a lucky or descheduled repeat moves one, not the
    # figure (the fastest repeat made fraction_of_udp_ceiling swing 0.44-1.4 between runs)
    mid = sorted(times)[len(times) // 2]
    cpu = sorted(cpus)[len(cpus) // 2]
    return {"seconds": mid, "goodput_gbps": nbytes / mid / 1e9,
            "packets_per_s": workers * 2 * -(-nbytes // pkt) / mid, "resends": resends,
            "cpu_s": cpu, "cpu_s_per_gb": cpu / (nbytes / 1e9)}
