"""Compiled kernels loaded in the background (dataplane/kernels `load_in_background`, what the
engine daemon and the loopback switch do at start): while the load runs, "auto" mode takes the
reference path instead of waiting for numba, the loading thread itself sees the compiled path,
"numba" mode still insists, and a load that fails leaves the mode as it was."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from luwu.dataplane import kernels, quantize

DEADLINE = 30.0  # s, an upper bound for a thread to report (never an assertion on speed)

pytestmark = pytest.mark.skipif(not kernels.numba_available(), reason="numba is not installed")


@pytest.fixture(autouse=True)
def _no_lock_files_left():
    """The tests' loads leave no lock file (`_first_compiles`) in the kernels' __pycache__."""
    yield
    import glob
    import os

    for path in glob.glob(os.path.join(os.path.dirname(kernels.__file__), "__pycache__", "test-*.lock")):
        os.unlink(path)


def _until_loaded() -> None:
    if not kernels.wait_loaded(DEADLINE):
        raise AssertionError("the background load never finished")


def test_auto_mode_takes_the_reference_path_while_kernels_load(monkeypatch):
    monkeypatch.setenv("LUWU_KERNELS", "auto")
    release, entered = threading.Event(), threading.Event()
    seen_by_loader: list[bool] = []

    def load() -> None:
        seen_by_loader.append(kernels.use_numba())
        entered.set()
        release.wait(DEADLINE)

    kernels.load_in_background(load, "test-load")
    assert entered.wait(DEADLINE)
    try:
        assert not kernels.use_numba()  # another thread: the reference path, no stall
        monkeypatch.setenv("LUWU_KERNELS", "numba")
        assert kernels.use_numba()  # insisting on numba still gets it
        monkeypatch.setenv("LUWU_KERNELS", "auto")
        # the datapath's sum during the load is the reference's, and equal to the compiled one's after
        x = np.linspace(-3, 3, 1000, dtype=np.float32)
        during = quantize.chunk_exponents(x, 64)
        assert not kernels.wait_loaded(0.05)  # still loading: a bounded wait says so
    finally:
        release.set()
    _until_loaded()
    assert seen_by_loader == [True]
    assert kernels.use_numba()
    assert np.array_equal(during, quantize.chunk_exponents(x, 64))


def test_a_failing_load_ends_the_reference_period(monkeypatch):
    monkeypatch.setenv("LUWU_KERNELS", "auto")

    def load() -> None:
        raise RuntimeError("numba broke")

    kernels.load_in_background(load, "test-load-fails")
    _until_loaded()
    assert kernels.use_numba()


def test_reference_mode_starts_no_load(monkeypatch):
    monkeypatch.setenv("LUWU_KERNELS", "reference")
    ran: list[int] = []
    kernels.load_in_background(lambda: ran.append(1), "test-load-off")
    assert kernels._background == 0 and not ran


def test_a_loopback_switch_process_answers_once_its_kernels_are_in(monkeypatch):
    """What benchmarks call before timing: the switch process loaded its lane kernels."""
    from luwu.dataplane.loopback import LoopbackSwitch, StarPlan

    monkeypatch.setenv("LUWU_KERNELS", "auto")
    with LoopbackSwitch(StarPlan(workers=2, transport="udp"), process=True) as sw:
        assert sw.wait_kernels(DEADLINE) is True


# a fresh interpreter: after the engine's warm_up, the fixed32 datapath's kernels (quantise, exponents,
# the RESULT pass, check words, decode) run with no new compilation or cache load on the packet thread
_WARM_PROBE = """
import numpy as np
from luwu.dataplane import quantize
from luwu.dataplane.engine.packets import check_words_hold, check_words_of, write_check_words
from luwu.dataplane.kernels import fixed_point as fp
from luwu.dataplane.protocol import HEADER_LEN, Dtype, MsgType, header_view

quantize.warm_up()
names = ("quantize_rows", "dequantize_rows", "chunk_exponents", "absorb_fixed_results", "check_words32",
         "quantize_rows_checked", "absorb_checked_results", "seal_rows32")
before = {n: len(getattr(fp, n).signatures) for n in names}
lanes = 300
rows = np.zeros((4, HEADER_LEN + 4 * (lanes + 2)), dtype=np.uint8)
rows[:, 0] = (2 << 4) | MsgType.RESULT
h = header_view(np.ascontiguousarray(rows[:, :HEADER_LEN]))
idx = np.array([0, 2])
check_words_of(rows, idx, lanes, h[idx], int(Dtype.FIXED32), 3)  # the engine's check of every RESULT
check_words_hold(rows, idx, lanes, h[idx], int(Dtype.FIXED32), 3)
write_check_words(rows, lanes, h, int(Dtype.FIXED32))  # a fill's
# a float sum's fill (quantised, checked and sealed compiled) and its RESULT batches (refused: zeros)
from luwu.dataplane.engine.collective import CollectiveSession
from luwu.dataplane.engine.packets import QuantizedLanes, aggregation_fill
from luwu.dataplane.engine.send_stream import RtoEstimator, RtoPolicy
from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.quantize import chunk_exponents, pow2_split
from luwu.dataplane.session import SessionSpec
x = np.ones(3 * lanes, np.float32)
exps = chunk_exponents(x, lanes)
fill = aggregation_fill(seg_start=0, msg_type=MsgType.ALLREDUCE, session=2, worker=0, pool_base=0, pool_size=16,
                        lanes=lanes, tensor=0, numel=x.size, dtype=Dtype.FIXED32,
                        lanes_of=QuantizedLanes(x, exps, lanes, 3), exponents=exps, row_lanes=lanes + 2)
fill(0, 3, rows[:3], np.zeros(3, np.int64))
sock = BatchSocket(udp_socket(), batch=8, max_len=rows.shape[1], peers=1)
s = CollectiveSession(SessionSpec(2, "collective", 1, 0, 16, 3, lanes + 2, purpose="data"), 0, sock,
                      RtoEstimator(RtoPolicy()), 0.0)
op = s.new_op(x.size, Dtype.FIXED32, False, lambda o: None, lambda *a: None)
op.fixed = (*pow2_split(np.zeros(3, np.int64))[:2], np.zeros(3 * lanes, np.float32), 3, np.zeros(0, np.float32))
lens = np.zeros(8, np.int64)[:4]
for checked in (False, True):
    assert not s.on_result_batch(rows, lens, h, 0.0, checked=checked)
sock.close()
after = {n: len(getattr(fp, n).signatures) for n in names}
print("LOADED", sorted(n for n in names if before[n]), "NEW", sorted(n for n in names if after[n] != before[n]))
"""


def test_the_engines_warm_up_loads_the_kernels_of_its_datapath():
    import os
    import subprocess
    import sys

    env = dict(os.environ, LUWU_KERNELS="numba")
    out = subprocess.run([sys.executable, "-c", _WARM_PROBE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOADED"))
    assert line == ("LOADED ['absorb_checked_results', 'absorb_fixed_results', 'check_words32', 'chunk_exponents', "
                    "'dequantize_rows', 'quantize_rows', 'quantize_rows_checked', 'seal_rows32'] NEW []"), line


def test_a_load_waits_for_another_processs_load_of_the_same_kernels(monkeypatch):
    """While another open file (another process's, in real use) holds the load's lock exclusively,
    as the first of a job's processes does while it fills a cold cache, the load does not start;
    once it is released the load runs (and the reference path serves meanwhile)."""
    import fcntl
    import os

    monkeypatch.setenv("LUWU_KERNELS", "auto")
    name = f"test-first-compiles-{os.getpid()}"
    path = os.path.join(os.path.dirname(kernels.__file__), "__pycache__", f"{name}.lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    ran: list[int] = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # "the other process" compiling
        kernels.load_in_background(lambda: ran.append(1), name)
        assert not kernels.wait_loaded(0.3)  # bounded: still waiting for the lock
        assert ran == [] and not kernels.use_numba()
        fcntl.flock(fd, fcntl.LOCK_UN)
        _until_loaded()
        assert ran == [1] and kernels.use_numba()
    finally:
        os.close(fd)
        os.unlink(path)
