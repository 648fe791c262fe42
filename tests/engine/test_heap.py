"""dataplane/process/heap.py: a datapath daemon keeps freed batch-sized buffers instead of faulting them
in again on every allocation (what made half of the switch's CPU time kernel time)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import numpy as np
from luwu.dataplane.process.heap import retain_freed_memory
if sys.argv[1] == "retain" and not retain_freed_memory():
    print("unsupported")
    sys.exit(0)
a = np.ones(4 << 20, np.float32)  # 16 MiB, a turn's temporary
del a
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    a = np.ones(4 << 20, np.float32)
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_retained_heap_stops_refaulting_batch_buffers():
    kept = _faults("retain")
    if kept == "unsupported":
        pytest.skip("not glibc: retain_freed_memory() changes nothing here")
    plain = int(_faults("plain"))
    assert plain >= 20, f"without it every 16 MiB buffer is mapped afresh ({plain} faults for 20)"
    assert int(kept) < 20, f"with it the freed buffer is reused ({kept} faults for 20 allocations)"


FREEZE_PROBE = """
import gc, sys
from luwu.dataplane.process.heap import freeze_collector, refreeze
if sys.argv[1] == "freeze":
    frozen = freeze_collector()
    late = [[i] for i in range(1000)]  # made after start-up (the kernels' objects, say)
    refreeze()
    print(frozen, gc.get_freeze_count() - frozen, len(gc.get_objects()) < 1000)
else:
    late = [[i] for i in range(1000)]
    refreeze()  # a library call in a process that never froze: changes nothing
    print(gc.get_freeze_count())
"""


def test_a_daemon_freezes_its_start_up_objects_and_a_library_call_alone_does_not():
    """freeze_collector moves start-up objects out of the collector's traversals; refreeze (the
    kernel loaders' call) adds later long-lived objects, but only where the entry point froze."""
    run = lambda mode: subprocess.run([sys.executable, "-c", FREEZE_PROBE, mode], capture_output=True,  # noqa: E731
                                      text=True, check=True, timeout=120).stdout.split()
    frozen, added, few_left = run("freeze")
    assert int(frozen) > 1000 and int(added) >= 1000 and few_left == "True"
    assert run("library") == ["0"]
