"""`luwu bench integrity`: what the wire's integrity checks cost (docs/protocol.md 3.5-3.8), measured in one run.

The same allreduce as `luwu bench allreduce --engine` (N worker processes, the software switch
in its own process) runs with this build in two or three configurations, interleaved round by
round so that drift on a shared machine falls on all of them alike:

* `checks`: this build as it runs by default (header check on every packet, check words on
  every aggregation packet, verified by every receiver);
* `before`: another revision of luwu (`--before REV`, default a4bb410: main just before the v2
  wire checks), extracted with `git archive` from this checkout's repository into a temporary
  directory and imported from there (PYTHONPATH) by its own processes: the cost of everything
  that changed between the two, the checks first among them;
* `off`: this build with `--off-env NAME=VALUE` set (an environment switch that turns the
  checks off, if the build has one): the cost of the checks alone. Skipped without it.

Each run is a fresh Python process (its workers and switch are its children), started from a
temporary directory so the revision under test is the only `luwu` it can import. CPU seconds
of every process (workers and switch) per GB reduced is the measure, as in the allreduce bench;
`<config>_cpu_ratio` is a configuration's over `checks`'s (below 1: cheaper than the checks).

Prints grep-able `key: value` lines; `--json` prints one JSON object; `--out DIR` writes
integrity.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from luwu.bench.sizes import format_size, parse_size
from luwu.dataplane.process.usage import UserError, positive_int, size

BEFORE = "a4bb410"  # main just before the v2 wire checks (issue 27)
RUN_TIMEOUT = 900.0  # s one configuration's run may take
_CHILD = """
import json, sys
from luwu.bench.allreduce import run_luwu
import luwu.dataplane.protocol as p
a = json.loads(sys.argv[1])
r = run_luwu(a["workers"], a["numel"], "float32", a["mode"], a["iters"], a["verify"], 0.0, a["transport"])
print("RESULT " + json.dumps({"cpu_s": r["cpu_s"], "median_s": r["median_s"], "retransmits": r.get("retransmits"),
                              "verify": r.get("verify"), "version": p.VERSION, "file": p.__file__}, default=str))
"""


def add_arguments(p) -> None:
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--size", type=size, default="16MiB", help="bytes per worker buffer (float32; default 16MiB)")
    p.add_argument("--iters", type=positive_int, default=5, help="timed allreduces per run (after one warm-up)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds of the configurations (default 3)")
    p.add_argument("--mode", default="loopback", help="packet mode: tofino, jumbo or loopback (the default)")
    p.add_argument("--transport", choices=["shm", "udp"], default="shm",
                   help="between the engines and the switch: shared memory (the loopback default) or UDP")
    p.add_argument("--before", default=BEFORE, metavar="REV",
                   help=f"the revision to compare with (default {BEFORE}: main before the checks); 'none' skips it")
    p.add_argument("--off-env", default=None, metavar="NAME=VALUE",
                   help="an environment setting that turns this build's checks off (adds the `off` configuration)")
    p.add_argument("--verify", action="store_true", help="every run checks its result (costs CPU, not timed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key: value lines")
    p.add_argument("--out", type=Path, help="directory for integrity.json")


def _repo_root() -> Path:
    """The checkout this luwu is imported from (an editable install of a git worktree)."""
    import luwu.dataplane as dp

    return Path(dp.__file__).resolve().parent.parent


def extract_revision(rev: str, dest: Path) -> Path:
    """`git archive` revision `rev` of this checkout into dest/src and lay it out as the import
    package `luwu` under dest/root (the pyproject's package-dir mapping of that revision).
    Returns dest/root, for PYTHONPATH."""
    repo = _repo_root()
    src, root = dest / "src", dest / "root"
    src.mkdir(parents=True)
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev], check=True,
                                 capture_output=True, timeout=120).stdout
    except FileNotFoundError:
        raise UserError("--before needs git on PATH (or pass --before none)") from None
    except subprocess.CalledProcessError as e:
        raise UserError(f"--before {rev}: git archive failed in {repo}: "
                        f"{e.stderr.decode(errors='replace').strip()[:200]} (a revision of this checkout, or none)") from None
    import io

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise UserError("--before needs Python 3.11 (tomllib) to read that revision's layout; or --before none") from None
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root.mkdir(parents=True)
    shutil.copytree(src / mapping.get("luwu", "luwu"), root / "luwu")
    for pkg, folder in mapping.items():
        if pkg != "luwu":
            shutil.copytree(src / folder, root.joinpath(*pkg.split(".")))
    return root


def _run(config: str, args, numel: int, pythonpath: Path | None, workdir: Path) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    if config == "off" and args.off_env:
        name, _, value = args.off_env.partition("=")
        env[name] = value
    req = {"workers": args.workers, "numel": numel, "mode": args.mode, "iters": args.iters, "verify": args.verify,
           "transport": args.transport}
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(req)], cwd=workdir, env=env, capture_output=True,
                           text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {config} run did not finish within {RUN_TIMEOUT:.0f} s") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"the {config} run failed (exit {p.returncode}): {p.stderr.strip()[-800:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    r["gb"] = args.iters * numel * 4 / 1e9
    return r


def run(args) -> int:
    numel = parse_size(args.size) // 4
    if numel < 1:
        raise UserError(f"--size {args.size}: at least 4 bytes (one float32)")
    if not 1 <= args.workers <= 32:
        raise UserError("--workers must be 1..32 (one switch bitmap)")
    if args.off_env is not None and ("=" not in args.off_env or not args.off_env.partition("=")[0]):
        raise UserError(f"--off-env {args.off_env!r}: give NAME=VALUE")
    from luwu.dataplane.protocol import lanes_for_mode

    try:
        lanes_for_mode(args.mode)
    except ValueError as exc:
        raise UserError(f"--mode: {exc}") from None
    configs = ["checks"] + (["before"] if args.before != "none" else []) + (["off"] if args.off_env else [])
    if len(configs) == 1:
        raise UserError("nothing to compare with: give --before REV and/or --off-env NAME=VALUE")
    from rich.console import Console

    console = Console(stderr=True)
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="luwu-bench-integrity-") as tmp:
        work = Path(tmp) / "cwd"
        work.mkdir()
        before_path = extract_revision(args.before, Path(tmp) / "before") if "before" in configs else None
        res: dict = {"workers": args.workers, "bytes": numel * 4, "iters": args.iters, "rounds": args.rounds,
                     "transport": args.transport, "mode": args.mode, "before": args.before, "off_env": args.off_env}
        with console.status("integrity") as status:
            for i in range(args.rounds):
                for config in configs if i % 2 == 0 else configs[::-1]:  # alternate: drift hits all alike
                    status.update(f"round {i + 1}/{args.rounds}: allreduce, {config} "
                                  f"({args.workers} workers, {format_size(numel * 4)})")
                    runs[config].append(_run(config, args, numel, before_path if config == "before" else None, work))
    for c in configs:
        gb = sum(r["gb"] for r in runs[c])
        cpu = sum(r["cpu_s"]["workers"] + r["cpu_s"]["switch"] for r in runs[c])
        res[f"{c}_cpu_s_per_gb"] = cpu / gb
        res[f"{c}_goodput_gbps"] = numel * 4 / float(np.median([r["median_s"] for r in runs[c]])) / 1e9
        res[f"{c}_protocol_version"] = runs[c][0]["version"]
        res[f"{c}_imported_from"] = str(Path(runs[c][0]["file"]).parent.parent)  # proves which tree ran
        if args.verify:
            res[f"{c}_verify"] = runs[c][0].get("verify")
    for c in configs[1:]:
        res[f"{c}_cpu_ratio"] = res[f"{c}_cpu_s_per_gb"] / res["checks_cpu_s_per_gb"]
        res[f"{c}_time_ratio"] = res["checks_goodput_gbps"] / res[f"{c}_goodput_gbps"]
    # what the checks cost, per GB and as a share of the run without them (the closest baseline)
    base = "off" if "off" in configs else "before"
    res["checks_extra_cpu_s_per_gb"] = res["checks_cpu_s_per_gb"] - res[f"{base}_cpu_s_per_gb"]
    res["checks_extra_fraction"] = res["checks_extra_cpu_s_per_gb"] / res[f"{base}_cpu_s_per_gb"]
    res["baseline"] = base
    res["runs"] = runs
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "integrity.json").write_text(json.dumps(res, indent=2, default=float))
    if args.json:
        print(json.dumps(res, default=float))
    else:
        for k, v in res.items():
            if k != "runs":
                print(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}")
    return 0
