"""The backend string is the only change from Gloo: a script that never imports luwu gets the
`luwu` backend from torch's `torch.backends` entry point (pyproject.toml), and with
TORCH_DEVICE_BACKEND_AUTOLOAD=0 (torch's own switch) it does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys
import torch
import torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("luwu", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
x = torch.tensor([rank + 1.0, 2.0, -3.5])
dist.all_reduce(x)
print("RESULT", x.tolist(), flush=True)
y = torch.tensor([0.1 * (rank + 1), 1e300], dtype=torch.float64)  # float64: the exact host path
dist.all_reduce(y)
print("FLOAT64", y.tolist(), flush=True)
z = torch.tensor([2.0 + rank, -1.5])
dist.all_reduce(z, op=dist.ReduceOp.PRODUCT)
print("PRODUCT", z.tolist(), flush=True)
outs = [[torch.zeros(2), torch.zeros(1)] for _ in range(2)]
dist.all_gather_coalesced(outs, [torch.full((2,), float(rank)), torch.full((1,), 10.0 + rank)])
print("COALESCED", [[t.tolist() for t in o] for o in outs], flush=True)
sub = dist.new_group([0, 1])
w = torch.ones(2) * (rank + 1)
dist.all_reduce(w, group=sub)
dist.destroy_process_group(sub)
print("SUBGROUP", w.tolist(), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(env_extra: dict) -> list[subprocess.CompletedProcess]:
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "LUWU_NO_BACKEND"}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_string_swap_without_import_luwu():
    # the check: float64 and PRODUCT all_reduce, all_gather_coalesced, a subgroup made and destroyed
    for res in _run({}):
        assert res.returncode == 0, res.stderr[-3000:]
        assert "RESULT [3.0, 4.0, -7.0]" in res.stdout, res.stdout
        assert f"FLOAT64 {[0.1 + 0.2, 2e300]}" in res.stdout, res.stdout
        assert "PRODUCT [6.0, 2.25]" in res.stdout, res.stdout
        assert "COALESCED [[[0.0, 0.0], [10.0]], [[1.0, 1.0], [11.0]]]" in res.stdout, res.stdout
        assert "SUBGROUP [3.0, 3.0]" in res.stdout, res.stdout


def test_torch_autoload_switch_turns_it_off():
    res = _run({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})[0]
    if res.returncode == 0:
        pytest.fail("the luwu backend was registered although torch's autoload was off")
    assert "luwu" in res.stderr.lower(), res.stderr[-2000:]
