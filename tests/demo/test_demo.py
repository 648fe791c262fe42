"""`luwu demo` end to end, as a user runs it (the installed entry point, a subprocess), with tiny
settings: the controller plans the job and programs the software switch, the workers train
through it and the optimizer node, the DDP baseline runs, report.json and the PNGs appear; with
5% simulated loss on every port the losses are bit-identical to a run without loss; and an
interrupted demo leaves none of its processes behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LUWU = Path(sys.executable).parent / "luwu"
TINY = ["--workers", "2", "--d-model", "32", "--layers", "2", "--heads", "2", "--context", "16", "--batch", "4",
        "--quiet"]
RUN_TIMEOUT = 600  # s a tiny demo may take on a loaded 2-core machine before the test gives up
PNGS = ("loss.png", "memory.png", "throughput.png", "traffic.png")


def _demo(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.run([str(LUWU), "demo", "--out", str(out), *TINY, *extra], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, env=env, cwd=out.parent)
    assert proc.returncode == 0, f"luwu demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_demo_trains_through_the_network_and_writes_its_report(tmp_path):
    out = tmp_path / "out"
    proc = _demo(out, "--steps", "4")
    assert re.search(r"LUWU_CONTROLLER=127\.0\.0\.1:\d+ LUWU_TOKEN=\w+ luwu-ctl status", proc.stdout), proc.stdout
    report = json.loads((out / "report.json").read_text())
    for name in PNGS:
        assert (out / name).stat().st_size > 1000, name
    assert report["control_plane"]["kind"] == "controller"
    assert report["steps"] == 4 and len(report["luwu"]["losses"]) == 4 and len(report["ddp"]["losses"]) == 4
    # the same model, data and seed: the first loss is the same function of the same initial weights
    # (bf16-served parameters move it by bf16 rounding only), and both runs learn alike
    assert report["luwu"]["losses"][0] == pytest.approx(report["ddp"]["losses"][0], rel=1e-2)
    assert report["luwu"]["final_loss"] == pytest.approx(report["ddp"]["final_loss"], rel=5e-2)
    # real traffic through the switch, counted by the engines and by the switch itself
    t = report["traffic"]
    assert t["luwu_measured_per_step"]["out"] >= t["model_bytes_fp32"]  # every gradient, once
    assert t["luwu_measured_per_step"]["in"] >= t["luwu_ideal_per_step"]["in"] / 2
    assert report["switch_counters"]["events"]["COMPLETED"][0] > 0
    assert report["optimizer_nodes"][0]["node"]["node"]["published"] == 4 * len(report["model"]["units"])
    mem, ddp_mem = report["luwu"]["memory"]["0"], report["ddp"]["memory"]["0"]
    assert mem["peak_bytes"] < ddp_mem["state_bytes"]["total"]


def test_five_percent_loss_gives_bit_identical_losses(tmp_path):
    clean = tmp_path / "clean"
    lossy = tmp_path / "lossy"
    clean.mkdir()
    lossy.mkdir()
    _demo(clean / "out", "--steps", "3", "--no-baseline")
    _demo(lossy / "out", "--steps", "3", "--no-baseline", "--drop", "0.05")
    a = json.loads((clean / "out" / "report.json").read_text())
    b = json.loads((lossy / "out" / "report.json").read_text())
    assert b["switch_counters"]["drops"]["SIMULATED_LOSS"][0] > 0  # loss did happen ...
    assert a["luwu"]["losses"] == b["luwu"]["losses"]  # ... and recovery did not change a single sum


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def _group(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (a demo worker and the engine daemon it spawned)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


def test_an_interrupted_demo_stops_every_process_it_started(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.Popen([str(LUWU), "demo", "--out", str(tmp_path / "out"), *TINY, "--steps", "100000",
                             "--no-baseline"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        port = None
        deadline = time.monotonic() + RUN_TIMEOUT
        for line in proc.stdout:  # bounded: the demo prints a handful of lines, then trains quietly
            m = re.search(r"LUWU_CONTROLLER=127\.0\.0\.1:(\d+)", line)
            if m:
                port = m.group(1)
                break
            assert time.monotonic() < deadline
        assert port, "the demo never printed its controller address"
        controller = _processes_mentioning(f"--listen 127.0.0.1:{port}")
        assert controller, "no controller process"
        workdir = re.search(r"--db (\S+)/fabric/controller\.sqlite", controller[0]).group(1)
        workers: list[int] = []
        for _ in range(1200):  # the workers come up and spawn their engines (bounded: 120 s)
            workers = [int(p.split(":")[0]) for p in _processes_mentioning(f"luwu.demo.worker {workdir}")]
            if len(workers) == 2 and all(len(_group(w)) >= 2 for w in workers):
                break
            time.sleep(0.1)
        assert len(workers) == 2 and all(len(_group(w)) >= 2 for w in workers), "workers or engines missing"
        assert len(_processes_mentioning(workdir)) >= 5  # controller, switch, node, two workers
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    assert _processes_mentioning(workdir) == []
    assert [_group(w) for w in workers] == [[], []]  # each worker's engine daemon went with it
    assert _processes_mentioning(f"--listen 127.0.0.1:{port}") == []
