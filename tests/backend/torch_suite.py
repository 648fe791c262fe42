"""PyTorch's own distributed tests (`torch.testing._internal.distributed.distributed_test`,
`DistributedTest._DistTestBase`) on a backend, as a third-party backend must run them, with the
counts side by side. Not collected by pytest (it takes minutes); run it by hand:

    python tests/backend/torch_suite.py --world 2 [--backends luwu,gloo] [-k all_reduce] [--json out.json]

The suite reads BACKEND, WORLD_SIZE and TEMP_DIR when it is imported and gates many tests on
sets of backend names; a third-party backend opens the gates it implements (subgroup, ddp,
plugin, gpu) before the import, which this script does for luwu, and the gates hard-coded to
Gloo's name that guard a c10d API rather than Gloo itself (GLOO_ONLY_APIS) after it. Each backend
runs in its own child process (the gates are read at import). The selection is every collective,
point-to-point and group test that runs on CPU tensors (CUDA/NCCL-only tests are left out: they
skip everywhere). The JSON holds each test's outcome per backend ("passed", "failed: ...",
"skipped: <reason>"), the summary lists the tests one backend passes and the other does not, and
each backend's stderr (the ranks' tracebacks) is kept in --logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

FAMILIES = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "all_to_all", "barrier",
            "send_recv", "isend", "irecv", "new_subgroups", "get_rank", "get_backend", "batch_isend", "allgather",
            "get_future", "sparse_all_reduce", "destroy")
LEFT_OUT = re.compile(r"cuda|nccl|gpu")

# Gates the suite hard-codes to Gloo's name (`BACKEND != "gloo"`, `require_backend_is_available({"gloo"})`)
# where what they guard is an API c10d defines for every backend, not Gloo's own behaviour: only Gloo among
# the built-in backends implements it. A backend that implements it opens the gate by running the test's
# unchanged body (the test still runs, judges and can fail). Keyed by the gate's own skip message and the
# tests it guards; gates that test Gloo itself (monitored_barrier) stay shut. The decorators of a test share
# one skip mark (the last one's message), so an entry names only tests whose other gates run at run time.
GLOO_ONLY_APIS = {
    ("Test requires backend {backend} to be one of {{'gloo'}}", "test_all_reduce_coalesced_"): "all_reduce_coalesced",
    ("Test requires backend {backend} to be one of {{'gloo'}}", "test_scatter_object_list"): "scatter_object_list",
    ("GLOO Batch Send Recv CPU", "test_batch_isend_irecv_gloo"): "batch_isend_irecv of CPU tensors",
    ("get_future is only supported on mpi, nccl and gloo", "test_get_future"): "Work.get_future",
    ("Only Gloo backend supports sparse all reduce", "test_sparse_all_reduce_sum"): "all_reduce of sparse tensors",
    # not test_barrier_timeout_global: its other gate (file:// init only) shares the one skip mark
    ("Only gloo backend supports timeouts", "test_barrier_timeout_full_group"): "the group's timeout",
    ("Only gloo backend supports timeouts", "test_barrier_timeout_group"): "the group's timeout",
}


def selected(pattern: str | None) -> list[str]:
    from torch.testing._internal.distributed import distributed_test as dt

    names = [n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_")
             and n[5:].startswith(FAMILIES) and not LEFT_OUT.search(n)]
    return sorted(n for n in names if pattern is None or pattern in n)


_MADE: list[str] = []  # TEMP_DIRs _prepare made in this process


def _prepare(backend: str) -> None:
    """Environment and gates, before the suite is imported (in the runner and in every rank it
    spawns: ranks re-import this file and find `Suite` here)."""
    os.environ["BACKEND"] = backend
    if "TEMP_DIR" not in os.environ:  # the ranks inherit the runner's (mkdtemp only once, not per rank)
        os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="luwu-torch-suite-")
        _MADE.append(os.environ["TEMP_DIR"])  # the suite points TEMP_DIR at its own later: remove ours by name
    from torch.testing._internal import common_distributed as cd

    if backend == "luwu":
        # gpu: device tensors cross luwu through host buffers (worker/backend/staging.py), as Gloo's do
        for gate in ("subgroup", "ddp", "plugin", "gpu"):
            cd.DistTestCases.backend_feature[gate].add("luwu")


def _open_gloo_only_apis(backend: str, base) -> None:
    """Clears the skip marks of GLOO_ONLY_APIS (the decorators set them on the test functions at import)."""
    if backend != "luwu":
        return
    for name in dir(base):
        fn = getattr(base, name)
        for (why, prefix) in GLOO_ONLY_APIS:
            if name.startswith(prefix) and getattr(fn, "__unittest_skip_why__", None) == why.format(backend=backend):
                fn.__unittest_skip__ = False


if os.environ.get("LUWU_SUITE_BACKEND"):
    _prepare(os.environ["LUWU_SUITE_BACKEND"])
    from torch.testing._internal.distributed import distributed_test as _dt

    _open_gloo_only_apis(os.environ["LUWU_SUITE_BACKEND"], _dt.DistributedTest._DistTestBase)

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
    for path in _MADE:
        shutil.rmtree(path, ignore_errors=True)
    counts = {"tests": result.testsRun, "failed": len(result.failures) + len(result.errors),
              "skipped": len(result.skipped)}
    counts["passed"] = counts["tests"] - counts["failed"] - counts["skipped"]
    counts["failures"] = sorted(t.id().rsplit(".", 1)[-1] for t, _ in result.failures + result.errors)
    # per test: "passed", "failed: <last line>" or "skipped: <reason>" (to compare backends test by test)
    outcome = dict.fromkeys(selected(pattern), "passed")
    for t, tb in result.failures + result.errors:
        outcome[t.id().rsplit(".", 1)[-1]] = "failed: " + (tb.strip().splitlines() or [""])[-1][:300]
    for t, reason in result.skipped:
        outcome[t.id().rsplit(".", 1)[-1]] = f"skipped: {reason}"
    counts["outcome"] = outcome
    print("COUNTS " + json.dumps(counts), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backends", default="luwu,gloo")
    p.add_argument("-k", dest="pattern", default=None, help="only tests whose name contains this")
    p.add_argument("--json", default=None)
    p.add_argument("--logs", default=tempfile.gettempdir(), help="folder for each backend's stderr (default: %(default)s)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.pattern)
    os.makedirs(a.logs, exist_ok=True)
    table = {}
    for backend in a.backends.split(","):
        print(f"running PyTorch's distributed tests on {backend} with {a.world} ranks ...", flush=True)
        cmd = [sys.executable, __file__, "--child", "--world", str(a.world)]
        if a.pattern:
            cmd += ["-k", a.pattern]
        env = dict(os.environ, OMP_NUM_THREADS="1", LUWU_SUITE_BACKEND=backend, WORLD_SIZE=str(a.world))
        env.pop("TEMP_DIR", None)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        # the ranks' own stderr (tracebacks of failed tests) is kept: the summary names only the test
        log = os.path.join(a.logs, f"{backend}-{a.world}.log")
        with open(log, "w") as f:
            f.write(out.stderr)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("COUNTS ")), None)
        if line is None:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        table[backend] = json.loads(line[7:])
        c = table[backend]
        print(f"  {backend}: {c['tests']} tests, {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
              + (f"; failed: {', '.join(c['failures'])}" if c["failures"] else "") + f" (stderr: {log})", flush=True)
    first, *others = table
    for other in others:  # the tests one backend passes and another does not, with the other's outcome
        for name, outcome in table[other]["outcome"].items():
            if outcome == "passed" and table[first]["outcome"].get(name) != "passed":
                print(f"  {other} passes, {first} does not: {name}: {table[first]['outcome'].get(name)}")
            elif outcome != "passed" and table[first]["outcome"].get(name) == "passed":
                print(f"  {first} passes, {other} does not: {name}: {outcome}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "results": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
