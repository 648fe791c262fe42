"""The hand-kept package list in pyproject.toml matches the tree, and a built wheel carries it all.

pyproject.toml maps the top-level folders onto one import package (`luwu.dataplane` is
`dataplane/`, ...) and lists every package by hand, because setuptools cannot discover packages
through a package-dir remap. A folder with an `__init__.py` that is missing from the list installs
nowhere: an editable install still finds it (the editable finder maps whole folders), so only a
real wheel shows the loss. These tests read the list against the tree, then build a wheel (no
network, no build isolation: setuptools and wheel come from the test venv) and check that it holds
every module and the data files the code opens at run time (P4 sources and build, the proto, the
switch's example config, the demo corpus).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def tree_packages() -> dict[str, Path]:
    """Import name -> folder, for every folder with an __init__.py under a package-dir root."""
    found: dict[str, Path] = {}
    for package, folder in SETUPTOOLS["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found[".".join([package, *rel])] = init.parent
    return found


def tracked(pattern: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line]


def test_the_package_list_is_the_tree():
    listed, tree = set(SETUPTOOLS["packages"]), set(tree_packages())
    missing, stale = sorted(tree - listed), sorted(listed - tree)
    assert not missing, (f"folders with an __init__.py that pyproject.toml's [tool.setuptools] packages does not "
                         f"list (a wheel would leave them out): {missing}")
    assert not stale, f"packages listed in pyproject.toml that have no folder with an __init__.py: {stale}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    # from a copy of the tree: setuptools reuses a build/ folder it finds, which would hide a loss
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for rel in subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.splitlines():
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    if proc.returncode != 0 and "No module named" in proc.stderr and ("setuptools" in proc.stderr
                                                                      or "wheel" in proc.stderr):
        pytest.skip(f"cannot build a wheel without setuptools/wheel in this venv: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stderr[-2000:]}"
    (built,) = out.glob("luwu-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def installed_path(path: str) -> str:
    """Where a tracked file of the repository lands inside the wheel."""
    first, _, rest = path.partition("/")
    for package, folder in SETUPTOOLS["package-dir"].items():
        if folder == first:
            return "/".join([*package.split("."), rest])
    raise AssertionError(f"{path} is under no package-dir folder")


def test_the_wheel_holds_every_module(wheel):
    names = set(wheel.namelist())
    folders = {str(f.relative_to(REPO)) for f in tree_packages().values()}
    modules = [p for p in tracked("*.py") if str(Path(p).parent) in folders]
    assert len(modules) > 100  # the tree was read
    lost = sorted(p for p in modules if installed_path(p) not in names)
    assert not lost, f"modules a built wheel leaves out (pyproject.toml's packages): {lost[:20]}"


def test_the_wheel_holds_the_runtime_data(wheel):
    names = set(wheel.namelist())
    needed = (tracked("p4/*.p4") + tracked("p4/build/*.json") + tracked("p4/build/*.txtpb")
              + tracked("proto/*.proto") + ["dataplane/switch/switch.example.yaml", "luwu/demo/data/corpus.txt"])
    assert any(p.startswith("p4/build/") for p in needed) and any(p.endswith(".p4") for p in needed)
    lost = sorted(p for p in needed if installed_path(p) not in names)
    assert not lost, f"data files a built wheel leaves out (pyproject.toml's package-data): {lost}"
