"""A memory cap on a benchmark's worker processes (`luwu bench capacity`), enforced as strongly as
this machine allows, and how a capped process's run ended.

In order of preference (`MemoryCap.detect`):

* ``cgroup-v2``: a child cgroup of this process's own cgroup with ``memory.max`` (and
  ``memory.swap.max`` 0 where present): the kernel OOM-kills the worker at the cap.
* ``cgroup-v1``: the same under the v1 memory controller: ``memory.limit_in_bytes`` and, where
  swap is accounted, ``memory.memsw.limit_in_bytes`` at the same value (so swap cannot stretch
  it); without the memsw file swap is not limited (the JSON's `swap` says which).
* ``rlimit-as``: RLIMIT_AS at the cap: an allocation beyond it fails (MemoryError, bad_alloc).
  Stricter than resident memory: address space that is reserved but never touched counts too.
* ``measured``: no enforcement; the processes' peak RSS (VmHWM) is compared after the run.

The cgroup is created under this process's own cgroup (never beside it: whatever limits the
machine put on this process keep applying), one per worker (`CapSlot`), and removed afterwards.
A worker joins its cgroup (or sets its rlimit) in a prelude that then exec's the worker, so
everything it allocates, and every process it starts (a luwu worker's engine daemon), is capped.
"""

from __future__ import annotations

import itertools
import os
import resource
import sys
import time
from pathlib import Path

KINDS = ("cgroup-v2", "cgroup-v1", "rlimit-as", "measured")
RMDIR_WAIT = 10.0  # s to wait for a cgroup's last process to be gone before removing it

# argv[1]: "cgroup" or "rlimit", argv[2]: the cgroup's procs file or the limit in bytes, argv[3:]: the command
_PRELUDE = ("import os, resource, sys\n"
            "if sys.argv[1] == 'cgroup':\n"
            "    with open(sys.argv[2], 'w') as f: f.write(str(os.getpid()))\n"
            "elif sys.argv[1] == 'rlimit':\n"
            "    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))\n"
            "os.execvp(sys.argv[3], sys.argv[3:])\n")

_counter = itertools.count()


def vm_hwm(pid: int | str = "self") -> int:
    """Peak resident set size (VmHWM) of process `pid` in bytes; 0 if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/io as {field: int} (read_bytes, write_bytes: what reached the block layer); {} if unreadable."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k.strip(): int(v) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return {}


def _own_cgroup(version: int) -> tuple[Path, str] | None:
    """(the controller's mount point, this process's cgroup path in it) for the memory controller."""
    try:
        cgroups = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    path = None
    for line in cgroups:
        hid, controllers, p = line.split(":", 2)
        if (version == 2 and hid == "0") or (version == 1 and "memory" in controllers.split(",")):
            path = p
    if path is None:
        return None
    for m in mounts:
        pre, _, post = m.partition(" - ")
        fields, fstype = pre.split(), post.split()
        if not fstype:
            continue
        if version == 2 and fstype[0] == "cgroup2":
            return Path(fields[4]), path
        if version == 1 and fstype[0] == "cgroup" and "memory" in fstype[-1].split(","):
            return Path(fields[4]), path
    return None


class CapSlot:
    """One capped worker: its cgroup (if any), the argv that starts it capped, and its peak."""

    def __init__(self, cap: MemoryCap, name: str) -> None:
        self.cap = cap
        self.dir: Path | None = None
        if cap.kind.startswith("cgroup"):
            if cap.parent is None:  # detect() found it; a None here is a bug, not a user error
                raise RuntimeError("a cgroup cap without a parent cgroup")
            self.dir = cap.parent / f"luwu-cap-{os.getpid()}-{next(_counter)}-{name}"
            self.dir.mkdir()
            try:
                cap.write_limit(self.dir)
            except BaseException:
                self.dir.rmdir()
                raise

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` wrapped so the process is capped before it runs anything of its own."""
        if self.dir is not None:
            return [sys.executable, "-c", _PRELUDE, "cgroup", str(self.dir / "cgroup.procs"), *argv]
        if self.cap.kind == "rlimit-as":
            return [sys.executable, "-c", _PRELUDE, "rlimit", str(self.cap.limit), *argv]
        return list(argv)

    def oom_kills(self) -> int:
        """How many processes the cgroup's limit killed (0 without a cgroup)."""
        if self.dir is None:
            return 0
        try:
            if self.cap.kind == "cgroup-v2":
                text = (self.dir / "memory.events").read_text()
            else:
                text = (self.dir / "memory.oom_control").read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def cgroup_peak(self) -> int | None:
        """The cgroup's peak charge in bytes (page cache and shared memory included), if it keeps one."""
        if self.dir is None:
            return None
        name = "memory.peak" if self.cap.kind == "cgroup-v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.dir / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        """Remove the cgroup once its processes are gone (bounded wait)."""
        d = self.dir
        if d is None:
            return
        deadline = time.monotonic() + RMDIR_WAIT
        while True:
            try:
                d.rmdir()
                self.dir = None
                return
            except FileNotFoundError:
                self.dir = None
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


class MemoryCap:
    """How worker processes are held to `limit` bytes here; `slot(name)` caps one process.

    Args:
        kind: one of KINDS.
        limit: bytes.
        parent: the cgroup directory the slots are created in (cgroup kinds only).
        swap: what bounds swap ("memsw limited", "swap.max 0", "not accounted", "n/a").

    Examples:
        >>> cap = MemoryCap.detect(2 << 30)  # doctest: +SKIP
        >>> slot = cap.slot("ddp-rank0"); proc = subprocess.Popen(slot.argv(cmd)); ...; slot.close()
    """

    def __init__(self, kind: str, limit: int, parent: Path | None = None, swap: str = "n/a") -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown memory cap kind {kind!r}: one of {', '.join(KINDS)}")
        self.kind, self.limit, self.parent, self.swap = kind, int(limit), parent, swap

    @classmethod
    def detect(cls, limit: int, allow: tuple[str, ...] = KINDS) -> MemoryCap:
        """The strongest cap of `allow` that works here (probed by creating a capped cgroup)."""
        for kind in allow:
            if kind in ("cgroup-v2", "cgroup-v1"):
                cap = cls._try_cgroup(kind, limit)
                if cap is not None:
                    return cap
            elif (kind == "rlimit-as" and hasattr(resource, "RLIMIT_AS")) or kind == "measured":
                return cls(kind, limit)
        raise ValueError(f"none of the memory caps {allow} is possible here")

    @classmethod
    def _try_cgroup(cls, kind: str, limit: int) -> MemoryCap | None:
        found = _own_cgroup(2 if kind == "cgroup-v2" else 1)
        if found is None:
            return None
        parent = found[0] / found[1].lstrip("/")
        if kind == "cgroup-v2" and "memory" not in _read(parent / "cgroup.subtree_control").split():
            return None  # children of this cgroup get no memory controller
        cap = cls(kind, limit, parent)
        try:
            slot = CapSlot(cap, "probe")
            slot.close()
        except OSError:
            return None
        return cap

    def write_limit(self, d: Path) -> None:
        if self.kind == "cgroup-v2":
            (d / "memory.max").write_text(str(self.limit))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
                self.swap = "swap.max 0"
            else:
                self.swap = "not accounted"
        else:
            (d / "memory.limit_in_bytes").write_text(str(self.limit))
            if (d / "memory.memsw.limit_in_bytes").exists():
                (d / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
                self.swap = "memsw limited"
            else:
                self.swap = "not accounted"
            if int(_read(d / "memory.limit_in_bytes") or 0) > self.limit + 4096:  # rounded to pages at most
                raise OSError(f"the cgroup {d} did not take the limit {self.limit}")

    def slot(self, name: str) -> CapSlot:
        return CapSlot(self, name)

    def describe(self) -> dict:
        return {"enforced": self.kind, "limit_bytes": self.limit, "swap": self.swap,
                "cgroup_parent": str(self.parent) if self.parent is not None else None}


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""
