"""User mistakes on the command line: each runs the real `luwu` / `luwu-ctl` command as a
subprocess and must exit 2 with exactly one line on stderr and no traceback.

One case per family of mistake (missing file, garbage file, bad HOST:PORT, bad size, bad count,
options that contradict each other) in every command that takes such input. A corrupt
checkpoint given to `luwu node --restore` is tested with a real checkpoint in
tests/integration/test_node_restore.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _run(argv: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, LUWU_TOKEN="t0ken", **(env or {}))
    full_env.pop("LUWU_CONTROLLER", None)
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=tmp_path, env=full_env, capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode} for a mistake (2 expected); stdout: {proc.stdout!r}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr}"
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    return lines[0]


CASES = {
    # family: missing file
    "demo corpus missing": (["luwu", "demo", "--corpus", "/nonexistent/corpus.txt"], ["--corpus", "no such file"]),
    "node plan missing": (["luwu", "node", "--plan", "/nonexistent/plan.json", "--state-dir", "s"], ["--plan"]),
    "engine plan missing": (["luwu", "engine", "--plan", "/nonexistent.json", "--control", "c.sock"], ["--plan"]),
    "ctl tls-ca missing": (["luwu-ctl", "--tls-ca", "/nonexistent", "status"], ["--tls-ca", "no such file"]),
    "controller token file missing": (["luwu", "controller", "--token-file", "/nonexistent"], ["token file"]),
    "controller tls cert missing": (["luwu", "controller", "--tls-cert", "/nonexistent", "--tls-key", "/x"],
                                    ["--tls-cert"]),
    "node restore missing": (["luwu", "node", "--plan", "PLAN", "--state-dir", "s", "--restore", "/nonexistent"],
                             ["--restore"]),
    "node restore latest without dir": (["luwu", "node", "--plan", "PLAN", "--state-dir", "s", "--restore", "latest"],
                                        ["--checkpoint-dir"]),
    "node checkpoint every without dir": (["luwu", "node", "--plan", "PLAN", "--state-dir", "s", "--checkpoint-every",
                                           "5"], ["--checkpoint-every", "--checkpoint-dir"]),
    "p4 load token file missing": (["luwu", "p4", "load", "--runtime", "PLAN", "--token-file", "/nonexistent"],
                                   ["--token-file"]),
    "p4 load token beyond loopback without tls": (["luwu", "p4", "load", "--runtime", "PLAN", "--addr", "10.9.9.9:1",
                                                   "--token", "t"], ["--tls-ca"]),
    # family: garbage file
    "node plan garbage": (["luwu", "node", "--plan", "GARBAGE", "--state-dir", "s"], ["--plan", "not JSON"]),
    "node plan wrong json": (["luwu", "node", "--plan", "WRONG", "--state-dir", "s"], ["not a valid endpoint plan"]),
    "engine plan garbage": (["luwu", "engine", "--plan", "GARBAGE", "--control", "c.sock"], ["not JSON"]),
    "demo corpus not text": (["luwu", "demo", "--corpus", "BINARY"], ["--corpus", "UTF-8"]),
    # family: bad HOST:PORT
    "controller listen nonsense": (["luwu", "controller", "--listen", "nonsense"], ["--listen", "HOST:PORT"]),
    "ctl controller nonsense": (["luwu-ctl", "--controller", "nonsense", "status"], ["HOST:PORT"]),
    "node controller nonsense": (["luwu", "node", "--plan", "PLAN", "--state-dir", "s", "--controller", "x:y"],
                                 ["HOST:PORT"]),
    "switch metrics nonsense": (["luwu", "switch", "--metrics", "nonsense"], ["--metrics", "HOST:PORT"]),
    "controller metrics nonsense": (["luwu", "controller", "--metrics", "nonsense"], ["--metrics", "HOST:PORT"]),
    "ctl top zero interval": (["luwu-ctl", "top", "--interval", "0"], ["--interval", "positive"]),
    # family: bad sizes and counts
    "bench allreduce size banana": (["luwu", "bench", "allreduce", "--size", "banana"], ["--size", "banana"]),
    "bench switch negative size": (["luwu", "bench", "switch", "--size", "-3"], ["--size"]),
    "bench optimizer params": (["luwu", "bench", "optimizer", "--params", "lots"], ["--params"]),
    "bench allreduce workers": (["luwu", "bench", "allreduce", "--workers", "0"], ["--workers"]),
    "bench fuzz pool": (["luwu", "bench", "fuzz", "--pool", "3"], ["--pool", "power of two"]),
    "node ram budget": (["luwu", "node", "--plan", "PLAN", "--state-dir", "s", "--ram-budget", "banana"],
                        ["--ram-budget"]),
    "demo context zero": (["luwu", "demo", "--context", "0"], ["--context"]),
    "demo negative steps": (["luwu", "demo", "--steps", "-5"], ["--steps"]),
    "demo checkpoint every zero": (["luwu", "demo", "--checkpoint-every", "0"], ["--checkpoint-every"]),
    "demo resume without checkpoints": (["luwu", "demo", "--resume", "--out", "nothing-here"], ["--resume"]),
    "node checkpoint every zero": (["luwu", "node", "--plan", "PLAN", "--state-dir", "s", "--checkpoint-every", "0"],
                                   ["--checkpoint-every"]),
    "demo drop not a probability": (["luwu", "demo", "--drop", "1.5"], ["--drop"]),
    "controller negative pool": (["luwu", "controller", "--data-pool", "-1"], ["--data-pool"]),
    # family: options that contradict each other
    "demo heads not dividing width": (["luwu", "demo", "--heads", "3"], ["--heads 3", "--d-model 128"]),
    "demo batch vs workers": (["luwu", "demo", "--batch", "5", "--workers", "2"], ["--batch"]),
    "demo packet mode": (["luwu", "demo", "--packet-mode", "huge"], ["--packet-mode"]),
    "ctl missing argument": (["luwu-ctl", "plan"], ["job"]),
    # family: missing or unknown command (the same in every command that has commands or actions)
    "unknown command": (["luwu", "nosuchcmd"], ["unknown command 'nosuchcmd'", "demo", "luwu --help"]),
    "no command": (["luwu"], ["missing command", "demo", "luwu --help"]),
    "bench no command": (["luwu", "bench"], ["missing command", "allreduce"]),
    "bench unknown command": (["luwu", "bench", "nope"], ["unknown command 'nope'", "allreduce"]),
    "p4 no action": (["luwu", "p4"], ["missing command", "generate"]),
    "mininet no action": (["luwu", "mininet"], ["missing action", "run"]),
    "ctl no command": (["luwu-ctl"], ["missing command", "status"]),
    "ctl unknown command": (["luwu-ctl", "nosuchcmd"], ["nosuchcmd"]),
    # family: garbage files given to flags
    "switch config not yaml": (["luwu", "switch", "--config", "BADYAML"], ["BADYAML", "line 2, column 6"]),
    "switch config binary": (["luwu", "switch", "--config", "BINARY"], ["BINARY", "UTF-8"]),
    "ctl tls-ca garbage": (["luwu-ctl", "--tls-ca", "BINARY", "status"], ["--tls-ca", "not a PEM certificate"]),
    "p4 load tls-ca garbage": (["luwu", "p4", "load", "--runtime", "PLAN", "--tls-ca", "GARBAGE"],
                               ["--tls-ca", "not a PEM certificate"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_mistake_is_one_line_without_traceback(tmp_path, name):
    argv, words = CASES[name]
    (tmp_path / "GARBAGE").write_text("this is not json\n")
    (tmp_path / "WRONG").write_text('{"wiring": 3}\n')
    (tmp_path / "BINARY").write_bytes(b"\xff\xfe\x00\x80" * 64)
    (tmp_path / "BADYAML").write_text("slots: [1, 2\nports: {\n")
    if "PLAN" in argv:
        from luwu.dataplane.loopback import StarPlan

        plan = StarPlan(workers=1, nodes=1, switch_ports=dict.fromkeys(range(4), ("127.0.0.1", 9)))
        (tmp_path / "PLAN").write_text(plan.node_plan(0).to_json())
    line = assert_one_line_error(_run(argv, tmp_path), *words)
    print(f"{' '.join(argv)}\n  -> {line}")


@pytest.mark.parametrize("argv", [["luwu", "--version"], ["luwu-ctl", "--version"], ["luwu", "--help"],
                                  ["luwu", "bench", "--help"], ["luwu", "p4", "--help"], ["luwu", "mininet", "--help"],
                                  ["luwu-ctl", "--help"], ["luwu-ctl", "top", "--help"]])
def test_help_and_version_exit_zero(tmp_path, argv):
    """Help and version are answers, not mistakes: stdout, exit 0, nothing on stderr."""
    from luwu import __version__

    proc = _run(argv, tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
    assert (f"{argv[0]} {__version__}" if argv[-1] == "--version" else "usage:") in proc.stdout, proc.stdout
