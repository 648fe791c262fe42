"""PyTorch's own distributed tests (`torch.testing._internal.distributed.distributed_test`,
`DistributedTest._DistTestBase`) on a backend, as a third-party backend must run them, with the
counts side by side. Not collected by pytest (it takes minutes); run it by hand:

    python tests/backend/torch_suite.py --world 2 [--backends luwu,gloo] [-k all_reduce] [--json out.json]

The suite reads BACKEND, WORLD_SIZE and TEMP_DIR when it is imported and gates many tests on
sets of backend names; a third-party backend opens the gates it implements (subgroup, ddp,
plugin) before the import, which this script does for luwu. Each backend runs in its own child
process (the gates are read at import). The selection is every collective, point-to-point and
group test that runs on CPU tensors (CUDA/NCCL-only tests are left out: they skip everywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

FAMILIES = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "all_to_all", "barrier",
            "send_recv", "isend", "irecv", "new_subgroups", "get_rank", "get_backend", "batch_isend", "allgather")
LEFT_OUT = re.compile(r"cuda|nccl|gpu|full_group|complex|sparse|_group$")


def selected(pattern: str | None) -> list[str]:
    from torch.testing._internal.distributed import distributed_test as dt

    names = [n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_")
             and n[5:].startswith(FAMILIES) and not LEFT_OUT.search(n)]
    return sorted(n for n in names if pattern is None or pattern in n)


def _prepare(backend: str) -> None:
    """Environment and gates, before the suite is imported (in the runner and in every rank it
    spawns: ranks re-import this file and find `Suite` here)."""
    os.environ["BACKEND"] = backend
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="luwu-torch-suite-"))
    from torch.testing._internal import common_distributed as cd

    if backend == "luwu":
        for gate in ("subgroup", "ddp", "plugin"):
            cd.DistTestCases.backend_feature[gate].add("luwu")


if os.environ.get("LUWU_SUITE_BACKEND"):
    _prepare(os.environ["LUWU_SUITE_BACKEND"])
    from torch.testing._internal.distributed import distributed_test as _dt

    class Suite(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()


def child(pattern: str | None) -> int:
    """The runner of one backend (LUWU_SUITE_BACKEND and WORLD_SIZE set by main)."""
    import unittest

    loader = unittest.TestLoader()
    tests = unittest.TestSuite(loader.loadTestsFromName(name, Suite) for name in selected(pattern))
    result = unittest.TextTestRunner(verbosity=1, stream=sys.stderr).run(tests)
    counts = {"tests": result.testsRun, "failed": len(result.failures) + len(result.errors),
              "skipped": len(result.skipped)}
    counts["passed"] = counts["tests"] - counts["failed"] - counts["skipped"]
    counts["failures"] = sorted(t.id().rsplit(".", 1)[-1] for t, _ in result.failures + result.errors)
    print("COUNTS " + json.dumps(counts), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backends", default="luwu,gloo")
    p.add_argument("-k", dest="pattern", default=None, help="only tests whose name contains this")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.pattern)
    table = {}
    for backend in a.backends.split(","):
        print(f"running PyTorch's distributed tests on {backend} with {a.world} ranks ...", flush=True)
        cmd = [sys.executable, __file__, "--child", "--world", str(a.world)]
        if a.pattern:
            cmd += ["-k", a.pattern]
        env = dict(os.environ, OMP_NUM_THREADS="1", LUWU_SUITE_BACKEND=backend, WORLD_SIZE=str(a.world))
        env.pop("TEMP_DIR", None)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("COUNTS ")), None)
        if line is None:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        table[backend] = json.loads(line[7:])
        c = table[backend]
        print(f"  {backend}: {c['tests']} tests, {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
              + (f"; failed: {', '.join(c['failures'])}" if c["failures"] else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "results": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
