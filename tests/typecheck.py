"""Type-check the `luwu` import package with mypy (`make lint` runs it; so does .ci/run).

The folders install under one import package through pyproject.toml's package-dir, which mypy
cannot follow; this builds a temporary tree of links that has the installed layout (luwu/,
luwu/dataplane -> dataplane/, ...) and runs mypy on it with the settings in pyproject.toml.

    python tests/typecheck.py [extra mypy arguments]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="luwu-typecheck-") as tmp:
        root = Path(tmp) / "luwu"
        root.mkdir()
        for entry in (REPO / cfg["luwu"]).iterdir():
            (root / entry.name).symlink_to(entry)
        for package, folder in cfg.items():
            if package != "luwu":
                (root / package.split(".", 1)[1]).symlink_to(REPO / folder)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "-p", "luwu", *argv]
        return subprocess.run(cmd, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
