"""Run a process inside a network namespace given by a path (stdlib only).

Both backends hand out namespaces as paths: `/run/netns/NAME` for the netns backend's named
namespaces, `/proc/PID/ns/net` for a Mininet host (held by its shell). Only the network
namespace changes (the mount namespace, and so the venv and the run directory, stay the same):
`nsenter --net=PATH` where util-linux is installed, else setns(2) between fork and exec.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys

CLONE_NEWNET = 0x40000000
NSENTER = shutil.which("nsenter")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def enter(ns_path: str) -> None:
    """Move the calling thread into the network namespace at `ns_path`."""
    fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns_path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def popen_in(ns_path: str | None, argv: list[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(argv)` inside the namespace (None: this process's own). Through util-linux's
    `nsenter --net` (which execs the program, so the process id is the program's) when it exists:
    a Python preexec_fn is not safe in a process with threads, and the runner has some."""
    if ns_path is None:
        return subprocess.Popen(argv, **kwargs)
    if not os.path.exists(ns_path):
        raise FileNotFoundError(f"network namespace {ns_path} does not exist (was the network torn down?)")
    if NSENTER:
        return subprocess.Popen([NSENTER, f"--net={ns_path}", "--", *argv], **kwargs)
    return subprocess.Popen(argv, preexec_fn=lambda: enter(ns_path), **kwargs)


def run_in(ns_path: str | None, argv: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    """Run a short command in the namespace; raises with its stderr when it fails."""
    p = popen_in(ns_path, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise RuntimeError(f"{' '.join(argv)} in {ns_path} did not finish within {timeout} s") from None
    if p.returncode:
        raise RuntimeError(f"{' '.join(argv)} in {ns_path} failed ({p.returncode}): {err.strip()}")
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def write_sysctls(ns_path: str | None, values: dict[str, str], timeout: float = 10.0) -> None:
    """Set /proc/sys/net/... keys as seen from inside the namespace (they are per namespace)."""
    if not values:
        return
    script = "; ".join(f"printf %s {v} > /proc/sys/{k.replace('.', '/')}" for k, v in values.items())
    run_in(ns_path, ["/bin/sh", "-c", f"set -e; {script}"], timeout)


# ETHTOOL_STXCSUM through SIOCETHTOOL (linux/sockios.h, linux/ethtool.h), run inside the namespace:
# struct ifreq {char name[16]; void *data} (padded to its 40 bytes) -> struct ethtool_value {cmd, data}
_TX_CSUM_OFF = """
import array, fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for name in sys.argv[1:]:
    value = array.array("I", [0x17, 0])
    fcntl.ioctl(s.fileno(), 0x8946, struct.pack("16sP", name.encode(), value.buffer_info()[0]).ljust(40, b"\\0"))
"""


def tx_checksum_off(ns_path: str | None, ifnames: list[str], timeout: float = 10.0) -> None:
    """Turn off transmit checksum offload (`ethtool -K IF tx off`) on interfaces inside the namespace.

    A veth hands a TCP segment on with its checksum still to be filled in (CHECKSUM_PARTIAL); a host
    that forwards it, and a switch program that reads it from a raw socket and writes it to another
    port, pass that unfinished checksum on, and the receiving host drops the segment. With the
    offload off the sender's kernel computes the checksum, as a NIC would on real links."""
    if ifnames:
        run_in(ns_path, [sys.executable, "-c", _TX_CSUM_OFF, *ifnames], timeout)
