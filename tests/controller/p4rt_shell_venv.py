"""A virtual environment with p4runtime-shell, built once per machine and reused.

p4runtime-shell 0.0.6 pins protobuf 3.20, which cannot share a venv with luwu's (protobuf >= 5),
so the tests run it in its own venv with that venv's python. `ensure()` returns the venv's python,
building it on first use with `pip install p4runtime-shell==VERSION` (network to PyPI), or the
reason it could not (the test then skips saying so). Where: $LUWU_P4RT_SHELL_VENV, else
$XDG_CACHE_HOME/luwu (else ~/.cache/luwu) / p4runtime-shell-VERSION; a lock file keeps two
builders apart, and a venv is only moved into place complete. Standard library only: .ci/run
builds it best-effort before the tests with `python3 tests/controller/p4rt_shell_venv.py`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "0.0.6"
INSTALL_TIMEOUT = 600  # s for venv + pip install; an unreachable index fails well before


def location() -> Path:
    if os.environ.get("LUWU_P4RT_SHELL_VENV"):
        return Path(os.environ["LUWU_P4RT_SHELL_VENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "luwu" / f"p4runtime-shell-{VERSION}"


def _import_error(python: Path) -> str | None:
    """None when `python` imports p4runtime-shell; else the error's last line."""
    try:
        # -I: not the current folder on sys.path (luwu's repository root has a `p4/` that hides the `p4` package)
        done = subprocess.run([str(python), "-I", "-c", "import p4runtime_sh.shell"], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["exit status"])[-1]


def _works(python: Path) -> bool:
    return python.exists() and _import_error(python) is None


def ensure(base_python: str = sys.executable) -> Path | str:
    """The venv's python (a Path), or why it cannot be built (a str)."""
    venv = location()
    python = venv / "bin" / "python"
    if _works(python):
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another builder finishes first; then its venv is used
        if _works(python):
            return python
        tmp = Path(tempfile.mkdtemp(prefix=f".{venv.name}-", dir=venv.parent))
        try:
            # the base interpreter, not luwu's venv: `venv` from inside a venv copies that venv's base anyway
            subprocess.run([base_python, "-m", "venv", str(tmp)], check=True, capture_output=True,
                           timeout=INSTALL_TIMEOUT)
            subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "--retries", "2", "--timeout", "30", f"p4runtime-shell=={VERSION}"], check=True,
                           capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        except subprocess.CalledProcessError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = (e.stderr or "").strip().splitlines()[-1:] if isinstance(e.stderr, str) else []
            step = "pip install" if "pip" in e.cmd else "python -m venv"
            return f"cannot build a venv with p4runtime-shell=={VERSION}: {step} failed " \
                   f"({tail[0] if tail else 'exit ' + str(e.returncode)})"
        except (OSError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"cannot build a venv with p4runtime-shell=={VERSION}: {e}"
        # venvs hold their own path in scripts: pip ran in tmp, but `bin/python -m` uses no script, so
        # the moved venv works (its python resolves site-packages relative to itself)
        shutil.rmtree(venv, ignore_errors=True)
        tmp.rename(venv)
        error = _import_error(python)
        return python if error is None else f"the venv at {venv} cannot import p4runtime_sh: {error}"


if __name__ == "__main__":
    result = ensure(sys.argv[1] if len(sys.argv) > 1 else sys.executable)
    print(result)
    sys.exit(0 if isinstance(result, Path) else 1)
