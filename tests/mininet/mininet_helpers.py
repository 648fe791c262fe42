"""Helpers for the emulation tests: run `luwu mininet` as a real process, find and remove what a run left.

A run's kernel objects all carry its id (`lw<run>-...`: root-namespace interfaces, namespaces),
so a test can check that teardown removed exactly those, and remove them itself if not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from luwu.mininet.topologies import NAME_PREFIX

RUN_TIMEOUT = 240  # s for one whole `luwu mininet run` (start-up, the workload, teardown) on a loaded machine
ENV = dict(os.environ, LUWU_NO_BACKEND="1", OMP_NUM_THREADS="1")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces, veth pairs, AF_PACKET")


def luwu_mininet(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """`luwu mininet ARGS` in a child process, bounded; killed (and reported) if it overruns."""
    p = subprocess.Popen([sys.executable, "-m", "luwu.cli", "mininet", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()  # the runner tears down on SIGTERM
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"luwu mininet {' '.join(args)} ran over {timeout} s\n{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_json(*args: str) -> dict:
    """A run with --json; its JSON object (the test fails with the runner's stderr if there is none).
    The run directory is a temporary one, removed afterwards; `_logs` keeps the tail of every log,
    `_audit` the P4Runtime audit logs."""
    with tempfile.TemporaryDirectory(prefix="luwu-mininet-test-") as tmp:
        r = luwu_mininet("run", "--json", "--run-dir", f"{tmp}/run", *args)
        logs = {p.name: p.read_text()[-1500:] for p in Path(tmp, "run").glob("*.log")}
        audit = {p.name: [json.loads(line) for line in p.read_text().splitlines()]
                 for p in Path(tmp, "run").glob("*-p4runtime-audit.jsonl")}
    try:
        info = json.loads(r.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"luwu mininet run {' '.join(args)} exited {r.returncode} without JSON:\n{r.stdout}\n"
                    f"{r.stderr[-3000:]}\n{logs}")
    info["_returncode"] = r.returncode
    info["_logs"] = logs
    info["_audit"] = audit  # the P4Runtime audit logs the run kept: {file name: [records]}
    return info


def leftovers(run_id: str) -> list[str]:
    """Interfaces (root namespace) and namespaces whose names belong to run `run_id`."""
    prefix = f"{NAME_PREFIX}{run_id}-"
    found = [f"interface {n}" for n in os.listdir("/sys/class/net") if n.startswith(prefix)]
    if os.path.isdir("/run/netns"):
        found += [f"namespace {n}" for n in os.listdir("/run/netns") if n.startswith(prefix)]
    return found


def remove_leftovers(run_id: str) -> None:
    """Safety net after a failed teardown: delete exactly the run's objects, by name."""
    prefix = f"{NAME_PREFIX}{run_id}-"
    for n in os.listdir("/sys/class/net"):
        if n.startswith(prefix):
            subprocess.run(["ip", "link", "del", n], capture_output=True, timeout=10)
    if os.path.isdir("/run/netns"):
        for n in os.listdir("/run/netns"):
            if n.startswith(prefix):
                subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=10)


def check_clean(info: dict) -> None:
    """The run reported no leftovers and none are there; whatever is there gets removed."""
    run_id = info.get("run_id", "")
    assert run_id, f"no run id in {info}"
    found = leftovers(run_id)
    if found:
        remove_leftovers(run_id)
    assert not found, f"teardown left {found}"
    assert info["leftovers"] == []


def counters(info: dict, switch: str, event: str) -> int:
    return info["counters"][switch]["events"][event]
