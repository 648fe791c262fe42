"""The shared-memory doorbell as the engine uses it: a producer rings once per wake-up (not once
per publication), and a consumer that reads the doorbell only after poll() reported it (the
engine's loop) never sleeps on a ring that holds packets."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from luwu.dataplane.net.shm_ring import H_WAITING, ShmRing


def _path() -> str:
    return f"/dev/shm/luwu-test-bell-{os.getpid()}-{time.monotonic_ns()}"


def _bell_bytes(ring: ShmRing) -> int:
    try:
        return len(os.read(ring.fd, 65536))
    except BlockingIOError:
        return 0


def test_a_producer_rings_once_until_the_consumer_catches_up():
    path = _path()
    cons = ShmRing(path, "consumer", slots=16, row_bytes=64, create=True)
    prod = ShmRing(path, "producer")
    try:
        rows = np.zeros((4, 64), dtype=np.uint8)
        out, lens = np.zeros((16, 64), dtype=np.uint8), np.zeros(16, dtype=np.int64)
        assert cons.arm()
        for _ in range(3):  # three publications (gradients, then a heartbeat...) before the consumer wakes
            prod.push_rows(rows, [0, 1], [8, 8])
        assert _bell_bytes(cons) == 1, "one wake-up, one byte"
        assert not cons.arm(drain=False) and cons.pop_into(out, lens, 0, 16) == 6
        assert cons.arm(drain=False)  # caught up and armed again: the next publication must ring
        prod.push_rows(rows, [0], [8])
        assert _bell_bytes(cons) == 1, "a consumer that consumed what it was rung for is rung again"
        # rung, then woken and consumed only part of it before arming: not rung (it cannot sleep
        # on packets); once consumed past the rung packets, rung again
        assert cons.pop_into(out, lens, 0, 16) == 1 and cons.arm()
        prod.push_rows(rows, [0, 1, 2], [8, 8, 8])
        assert _bell_bytes(cons) == 1
        assert cons.pop_into(out, lens, 0, 1) == 1
        cons.h[H_WAITING] = 1  # waiting, as arm() would set it (arm() itself would say: do not sleep)
        prod.push_rows(rows, [0], [8])
        assert _bell_bytes(cons) == 0, "the consumer still has rung packets to consume: no second byte"
        assert cons.pop_into(out, lens, 0, 16) == 3 and cons.arm(drain=False)
        prod.push_rows(rows, [0], [8])
        assert _bell_bytes(cons) == 1
    finally:
        prod.close()
        cons.close()


def test_a_drain_takes_every_byte_in_one_read():
    path = _path()
    cons = ShmRing(path, "consumer", slots=16, row_bytes=64, create=True)
    try:
        for _ in range(5):
            cons.ring()
        cons.drain()
        assert _bell_bytes(cons) == 0
    finally:
        cons.close()


PRODUCER = """
import sys, time, numpy as np
from luwu.dataplane.net.shm_ring import H_WAITING, ShmRing
ring = ShmRing(sys.argv[1], "producer")
rows = np.zeros((3, 64), dtype=np.uint8)
rng = np.random.default_rng(1)
i, count = 0, int(sys.argv[2])
while i < count:
    k = min(count - i, int(rng.integers(1, 4)))  # a turn publishes up to three times, each notified
    for _ in range(k):
        rows[0, :8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
        while ring.push_rows(rows, [0], [8])[0] == 0:  # full: wait for the consumer
            time.sleep(0.0005)
        i += 1
    if rng.random() < 0.3:
        time.sleep(rng.random() * 0.001)  # sometimes the consumer catches up and goes to sleep
"""


@pytest.mark.parametrize("drain", ["when_rung", "always"])
def test_no_wake_up_is_lost_between_processes(drain):
    """A producer process publishes in bursts at irregular intervals; the consumer sleeps in poll()
    whenever it finds the ring empty, draining the doorbell as the engine and the switch do (only
    when poll() reported it) or at every arm. A lost wake-up leaves packets on the ring while
    poll() sleeps out its (generous) timeout: the test fails on that, not on speed."""
    count = 3000
    path = _path()
    cons = ShmRing(path, "consumer", slots=16, row_bytes=64, create=True)
    child = subprocess.Popen([sys.executable, "-c", PRODUCER, path, str(count)])
    try:
        out, lens = np.zeros((16, 64), dtype=np.uint8), np.zeros(16, dtype=np.int64)
        poller = select.poll()
        poller.register(cons.fd, select.POLLIN)
        seen, sleeps, rung = [], 0, True
        while len(seen) < count:
            k = cons.pop_into(out, lens, 0, 16)
            if k:
                seen += out[:k, :8].copy().view(np.int64).ravel().tolist()
                continue
            idle, rung = cons.arm(rung or drain == "always"), False
            if not idle:
                continue  # packets came while arming: do not sleep
            sleeps += 1
            woke = poller.poll(10_000)
            rung = bool(woke)
            assert woke or cons.pending() == 0, f"lost wake-up after {len(seen)} packets: poll slept on a queue"
            assert woke or child.poll() is None, f"the producer exited ({child.returncode}) after {len(seen)} packets"
        assert seen == list(range(count)) and sleeps > 0
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        cons.close()
