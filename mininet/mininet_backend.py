"""The Mininet backend, venv side: runs mn_network.py under the python that has mininet, holds it.

Debian's mininet is a package of the system python; the project runs in a venv. So the network is
built by a separate process (`mn_network.py SPEC.json`, mininet + stdlib only) that prints the
hosts' shell PIDs once the network is up; the hosts' namespaces are then `/proc/PID/ns/net`,
which the runner enters like the netns backend's. `stop()` asks the script to tear down (Mininet's
net.stop()) and, if it cannot (killed, hung), removes what it knows was made: it ends the node
shells by PID and deletes the run's root-namespace interfaces by name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from luwu.dataplane.process import children

from .emulation import EmulationSpec
from .nsexec import tx_checksum_off

SCRIPT = Path(__file__).with_name("mn_network.py")
PYTHON_CANDIDATES = ("/usr/bin/python3", "python3")
BUILD_TIMEOUT = 120.0  # s for Mininet to build the network
STOP_TIMEOUT = 60.0  # s for its net.stop()
# isolated mode: neither the working directory (a checkout has a `mininet/` folder -- this one --
# that would shadow the real package) nor PYTHON* variables reach the system python
ISOLATED = ("-I",)


class MininetError(RuntimeError):
    """Mininet is missing, or the network could not be built; the message says what to do."""


def find_python(explicit: str | None = None) -> str | None:
    """A python that can import mininet (None if there is none)."""
    for candidate in ([explicit] if explicit else PYTHON_CANDIDATES):
        exe = shutil.which(candidate) if not os.path.isabs(candidate) else candidate
        if not exe or not os.path.exists(exe):
            continue
        try:
            ok = subprocess.run([exe, *ISOLATED, "-c", "import mininet.net"], capture_output=True,
                                timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return exe
    return None


def missing(explicit_python: str | None = None) -> str | None:
    """None when the Mininet backend can run here, else what to install."""
    if os.geteuid() != 0:
        return "the Mininet backend needs root"
    if shutil.which("mnexec") is None:
        return "Mininet is not installed (no mnexec): apt-get install -y mininet iputils-ping"
    if find_python(explicit_python) is None:
        return ("no python here imports mininet (tried " + ", ".join([explicit_python] if explicit_python
                                                                       else PYTHON_CANDIDATES)
                + "): apt-get install -y mininet (it installs for Debian's /usr/bin/python3)")
    return None


class MininetNetwork:
    def __init__(self, spec: EmulationSpec, python: str | None = None, log_dir: Path | None = None):
        self.spec = spec
        self.python = python
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.pids: dict[str, int] = {}  # node -> its Mininet shell
        self._spec_file: Path | None = None
        self._lines: list[str] = []

    def start(self) -> dict[str, str]:
        why = missing(self.python)
        if why:
            raise MininetError(why)
        python = find_python(self.python)
        assert python is not None  # missing() said why otherwise
        fd, name = tempfile.mkstemp(prefix=f"luwu-mn-{self.spec.run_id}-", suffix=".json", dir=self.log_dir)
        with os.fdopen(fd, "w") as f:
            f.write(self.spec.to_json())
        self._spec_file = Path(name)
        log: IO[str] | int = open(self.log_dir / "mininet.log", "w") if self.log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen([python, *ISOLATED, str(SCRIPT), name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        if not isinstance(log, int):  # a file we opened, not DEVNULL
            log.close()
        try:
            msg = self._read_line(BUILD_TIMEOUT)
            if msg.get("error") or not msg.get("ready"):
                raise MininetError(f"Mininet could not build the network: {msg.get('error', msg)}")
        except Exception:
            self.stop()
            raise
        self.pids = {str(n): int(p) for n, p in msg.get("pids", {}).items()}
        namespaces = {host: f"/proc/{pid}/ns/net" for host, pid in msg["namespaces"].items()}
        try:  # from here: mn_network.py runs under a python that need not have what this takes
            for h in self.spec.hosts:
                tx_checksum_off(namespaces[h.name], h.tx_checksum_off)
        except Exception:
            self.stop()
            raise
        return namespaces

    def _read_line(self, timeout: float) -> dict:
        box: list[str] = []
        proc = self.proc
        if proc is None or proc.stdout is None:
            raise MininetError("mn_network.py is not running")
        stdout = proc.stdout
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box:
            raise MininetError(f"Mininet did not answer within {timeout} s (see mininet.log in the run directory)")
        line = box[0]
        if not line:
            code = proc.wait(timeout=5)
            raise MininetError(f"mn_network.py exited ({code}) before the network was up; see mininet.log")
        self._lines.append(line)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise MininetError(f"mn_network.py said {line.strip()!r}") from None

    def alive(self) -> bool:
        """Whether the process holding the network is still up (it exiting takes the network down)."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> list[str]:
        """Tear the network down; returns what could not be removed (normally nothing)."""
        left: list[str] = []
        clean = False
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    if self.proc.stdin is not None:
                        self.proc.stdin.write("stop\n")
                        self.proc.stdin.flush()
                except (BrokenPipeError, ValueError):
                    pass
                try:
                    self.proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
            try:
                rest = self.proc.stdout.read().splitlines() if self.proc.stdout else []
            except (OSError, ValueError):
                rest = []
            clean = any('"stopped": true' in line for line in self._lines + rest)
            children.close_pipes(self.proc)
        if not clean:  # killed, hung or never up: net.stop() may not have run
            left += self._sweep()
        if self._spec_file is not None:
            self._spec_file.unlink(missing_ok=True)
        self.proc = None
        return left

    def _sweep(self) -> list[str]:
        """After a script that did not finish net.stop(): end the node shells it reported (each
        checked to still be that node's `mininet:NAME` shell, so a reused PID is never hit) and
        delete the run's root-namespace interfaces."""
        left = []
        mine = [pid for name, pid in self.pids.items() if _is_shell(pid, name)]
        for pid in mine:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            except PermissionError as e:
                left.append(f"process {pid}: {e}")
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name in self.spec.root_interfaces():
            if os.path.exists(f"/sys/class/net/{name}"):
                r = subprocess.run(["ip", "link", "del", name], capture_output=True, text=True)
                if r.returncode and os.path.exists(f"/sys/class/net/{name}"):
                    left.append(f"interface {name}: {r.stderr.strip()}")
        self.pids = {}
        return left

    def __enter__(self) -> MininetNetwork:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_shell(pid: int, node: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"mininet:{node}".encode() in argv


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.path.exists(f"/proc/{pid}") and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return ""
