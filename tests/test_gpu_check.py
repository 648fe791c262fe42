"""`scripts/gpu-check` here, without a GPU: it installs luwu offline from the wheel folder and runs
end to end, the CUDA checks reported as skipped (docs/gpu.md).

What stands in for the GPU machine. Its image has torch, numpy, grpcio, protobuf, pytest, pip and
setuptools but not finsy, scapy, pyroute2 (nor finsy's parsy and pyee) and not luwu. The test
makes that: a fresh venv (no site packages of its own) whose only other source of packages is a
folder of links to this venv's site-packages minus luwu and those five. It first shows that luwu
and finsy do not import there, then runs the script with pip's index switched off
(PIP_NO_INDEX, an empty pip config) and every proxy pointing at a closed port, so nothing can be
fetched: what imports afterwards came from the wheel folder and the tree.

Which wheels. `make gpu-wheels` downloads them for the GPU's CPython 3.12 (x86-64); this Python may
be another version. All of them are pure Python (py3-none-any) except protobuf (abi3, any CPython
3.9+) and grpcio (cp312 only); the stand-in image's grpcio and protobuf are as new as the carried
ones, so the script keeps them (it installs those two only over older copies), exactly as it does
on a GPU image that is as new. So the test uses the very folder the GPU gets. Making it needs
PyPI: where that is unreachable the test skips and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MISSING_ON_GPU = ("luwu", "__editable__", "__editable___luwu", "finsy", "parsy", "pyee", "scapy", "pyroute2")
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
           "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "LUWU_"))}
    env.update(OFFLINE)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """A fresh copy of the tree with its wheel folder, and a stand-in for the GPU image's Python."""
    root = tmp_path_factory.mktemp("gpu-check")
    tree = root / "tree"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for f in filter(None, files):
        src = REPO / f.decode()
        if src.is_file():
            (tree / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / f.decode())
    made = subprocess.run(["make", "-s", "gpu-wheels", "STAMP=", f"PY={sys.executable}"], cwd=tree,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    wheels = sorted((tree / ".whl").glob("*.whl"))
    if made.returncode != 0 or not wheels:
        pytest.skip(f"`make gpu-wheels` could not make the wheel folder (PyPI unreachable?): {made.stderr[-400:]}")
    image = root / "image"
    image.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if not entry.name.lower().startswith(MISSING_ON_GPU) and entry.suffix != ".pth":
            (image / entry.name).symlink_to(entry)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    venv_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    Path(venv_site, "gpu_image.pth").write_text(f"import site; site.addsitedir({str(image)!r})\n")
    return {"root": root, "tree": tree, "python": py, "wheels": [w.name for w in wheels]}


def _gpu_check(machine, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = _clean_env(PYTHON=str(machine["python"]), OUT=str(out))
    return subprocess.run(["bash", "scripts/gpu-check", "--site", str(machine["root"] / "site"), *args],
                          cwd=machine["tree"], env=env, capture_output=True, text=True, timeout=400)


def test_the_wheel_folder_holds_what_the_gpu_image_lacks_for_its_python(machine):
    names = {w.split("-")[0].lower() for w in machine["wheels"]}
    assert {"finsy", "parsy", "pyee", "scapy", "pyroute2", "grpcio", "protobuf"} <= names
    grpcio = next(w for w in machine["wheels"] if w.startswith("grpcio-"))
    assert "-cp312-" in grpcio and "x86_64" in grpcio
    assert all(w.endswith("-py3-none-any.whl") for w in machine["wheels"] if not w.startswith(("grpcio-", "protobuf-")))
    size = sum(p.stat().st_size for p in (machine["tree"] / ".whl").rglob("*") if p.is_file())
    assert size < 20 << 20, f"the wheel folder is {size >> 20} MiB: it travels in a 64 MiB limit with the tree"


def test_installs_offline_and_runs_with_the_cuda_checks_skipped(machine, tmp_path):
    probe = subprocess.run([str(machine["python"]), "-P", "-c", "import torch, grpc, numpy; import finsy"],
                           capture_output=True, text=True,
                           cwd=tmp_path, env=_clean_env(), timeout=120)
    assert probe.returncode != 0 and "No module named 'finsy'" in probe.stderr, probe.stderr  # the image's state
    probe = subprocess.run([str(machine["python"]), "-P", "-c", "import luwu"], capture_output=True, text=True,
                           cwd=tmp_path, env=_clean_env(), timeout=60)
    assert "No module named 'luwu'" in probe.stderr, probe.stderr
    out = tmp_path / "out"
    run = _gpu_check(machine, out)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("gpu-check ")]
    assert [ln.split()[1:3] for ln in lines] == [["install", "PASS"], ["cuda_tests", "SKIP"], ["mnn", "SKIP"],
                                                 ["ddp", "SKIP"], ["staging", "SKIP"]], run.stdout
    result = json.loads((out / "gpu-check.json").read_text())
    assert result["ok"] is True and result["environment"]["cuda_available"] is False
    install = result["checks"]["install"]["details"]
    assert install["luwu_file"].startswith(str(machine["root"] / "site")) and install["luwu_from"] == "this tree"
    assert {"luwu", "luwu-ctl"} <= set(install["scripts"]), install  # one pip call: luwu's scripts land in bin/
    assert {"finsy-0.30.0-py3-none-any.whl", "scapy-2.8.0-py3-none-any.whl"} <= set(install["wheels"])
    cases = result["checks"]["cuda_tests"]["details"]["cases"]
    assert len(cases) >= 3 and all(c["outcome"] == "skipped" for c in cases), cases
    assert any("test_cuda_tensors_through_the_backend" in c["test"] for c in cases)
    assert "no CUDA" in result["checks"]["mnn"]["summary"]
    assert (out / "gpu-check.log").read_text().count("----- cuda_tests: output -----") == 1


def test_the_ddp_check_runs_on_the_cpu_as_a_dry_run(machine, tmp_path):
    """`--device cpu`: DDP over the luwu backend against Gloo, 2 rank processes, through the fresh install."""
    run = _gpu_check(machine, tmp_path, "--device", "cpu", "--only", "ddp")
    assert run.returncode == 0, run.stdout + run.stderr
    ddp = json.loads((tmp_path / "gpu-check.json").read_text())["checks"]["ddp"]
    assert ddp["status"] == "pass", ddp
    assert set(ddp["details"]["max_diff"]) == {"gloo"} and ddp["details"]["max_diff"]["gloo"] <= ddp["details"]["tolerance"]
    assert ddp["details"]["moved"] > 100 * ddp["details"]["tolerance"]


def test_unknown_check_is_one_line_and_exit_2(machine, tmp_path):
    run = _gpu_check(machine, tmp_path, "--only", "nonsense")
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "unknown check" in run.stderr, run.stderr
