"""Driver of `scripts/gpu-check` (docs/gpu.md): install luwu offline, then run its CUDA checks.

Run from the repository root of a fresh copy of the tree, on a machine whose Python already has
torch, numpy, grpcio, transformers (the GPU image, docs/gpu.md) and a folder of wheels made by
`make gpu-wheels` (.whl/) for what it lacks. Steps, each in its own process with its own time
limit, so that one failing or hanging still lets the others run:

  install      the wheels and luwu (built from this tree) into a fresh --target folder, with pip's
               --no-index: nothing can be fetched
  cuda_tests   the test suite's CUDA tests (pytest -k cuda on the test files that check for CUDA)
  mnn          ModelInNetwork trains a tiny Llama (transformers, from a config) in bf16 on the GPU,
               2 worker processes on loopback, against a one-process reference (scripts/gpu_checks.py)
  ddp          DDP over init_process_group("luwu") with CUDA tensors against Gloo (and NCCL
               where there is one GPU per rank), 2 ranks
  staging      luwu's pinned host staging copies against a plain pinned copy of the same size

One summary line per step on stdout, the whole output in gpu-check.log and the results in
gpu-check.json, both in $OUT when it is set (else the current folder). Without a CUDA device the
GPU steps report "skip" (`--device cpu` runs mnn and ddp on the CPU instead: a dry run of their
code). Exit status 0 when no step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
CHECKS = ("cuda_tests", "mnn", "ddp", "staging")
# Seconds each step may take, and the whole run's budget (the machine is lent for minutes).
LIMITS = {"install": 150, "cuda_tests": 200, "mnn": 150, "ddp": 150, "staging": 90}
BUDGET = 460
RESERVE = 25  # s kept for each later step when a step's limit is cut to fit the budget
# Carried only as a floor: luwu's generated stubs need at least these, so the carried wheel is
# installed only where the interpreter's own copy is missing or older (a newer one stays).
FLOORS = ("grpcio", "protobuf")
TAIL = 40  # lines of a failed step's output echoed to stdout
MARK = ".luwu-gpu-check"  # marks an install folder as this script's (it empties only those)


def _version_key(v: str) -> tuple:
    try:
        from packaging.version import Version

        return (0, Version(v))
    except Exception:  # noqa: BLE001 - no packaging, or a version it cannot parse: compare numbers
        nums = []
        for part in v.split("+")[0].split("."):
            digits = "".join(ch for ch in part if ch.isdigit())
            nums.append(int(digits) if digits else 0)
        return (1, tuple(nums))


def _installed(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _wheel_name(path: Path) -> tuple[str, str]:
    name, ver = path.name.split("-")[:2]
    return name.lower().replace("_", "-"), ver


class Run:
    """The log, the JSON and the summary lines of one gpu-check run."""

    def __init__(self, out: Path, device: str):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "gpu-check.log"
        self.json_path = out / "gpu-check.json"
        self.log = self.log_path.open("w", encoding="utf-8")
        self.t0 = time.monotonic()
        self.result: dict = {"device_arg": device, "environment": {}, "checks": {}, "started": time.time()}

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def write(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.t0, 1)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        tmp.replace(self.json_path)

    def record(self, name: str, res: dict, output: str) -> None:
        self.result["checks"][name] = res
        self.log.write(f"----- {name}: output -----\n{output}\n----- {name}: end -----\n")
        self.log.flush()
        self.say(f"gpu-check {name:<10} {res['status'].upper():<7} {res.get('seconds', 0):6.1f}s  {res.get('summary', '')}")
        if res["status"] in ("fail", "error", "timeout") and output.strip():
            lines = output.rstrip().splitlines()[-TAIL:]
            print("\n".join(f"    | {ln}" for ln in lines), flush=True)
        self.write()

    def remaining(self) -> float:
        return BUDGET - (time.monotonic() - self.t0)


def _run_limited(cmd: list[str], env: dict, limit: float, cwd: Path = REPO) -> tuple[int | None, str, float]:
    """cmd in its own process group, killed whole after `limit` s: (exit status or None, output, seconds)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as buf:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=buf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its children (ranks, daemons) too
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait(10)
        buf.seek(0)
        return rc, buf.read(), time.monotonic() - t0


def _environment(py: str, env: dict) -> dict:
    """Versions of what the checks use, read in a child (torch's import must not break the driver)."""
    code = (
        "import json, platform, sys\n"
        "from importlib.metadata import version as v\n"
        "out = {'python': sys.version.split()[0], 'executable': sys.executable, 'machine': platform.machine()}\n"
        "for n in ('torch', 'numpy', 'numba', 'grpcio', 'protobuf', 'transformers', 'setuptools', 'pip'):\n"
        "    try: out[n] = v(n)\n"
        "    except Exception as e: out[n] = None\n"
        "try:\n"
        "    import numba\n"
        "except Exception as e:\n"
        "    out['numba_error'] = repr(e)  # luwu's switch and node kernels need it\n"
        "try:\n"
        "    import torch\n"
        "    out['cuda_build'] = torch.version.cuda\n"
        "    out['cuda_available'] = torch.cuda.is_available()\n"
        "    if out['cuda_available']:\n"
        "        p = torch.cuda.get_device_properties(0)\n"
        "        out.update(device_count=torch.cuda.device_count(), device_name=p.name,\n"
        "                   device_memory_gib=round(p.total_memory / 2**30, 1), capability='%d.%d' % (p.major, p.minor))\n"
        "        try: out['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))\n"
        "        except Exception as e: out['nccl'] = repr(e)\n"
        "except Exception as e:\n"
        "    out['torch_error'] = repr(e)\n"
        "print('GPU_CHECK_ENV ' + json.dumps(out))\n"
    )
    rc, output, _ = _run_limited([py, "-c", code], env, 120, cwd=Path(tempfile.gettempdir()))
    for line in output.splitlines():
        if line.startswith("GPU_CHECK_ENV "):
            return json.loads(line[len("GPU_CHECK_ENV "):])
    return {"error": f"could not read the environment (exit {rc}): {output[-2000:]}"}


def _install(py: str, env: dict, wheels: Path, site: Path, limit: float) -> tuple[dict, str]:
    """The carried wheels and luwu into `site`, from local files only (--no-index)."""
    t0 = time.monotonic()
    out: list[str] = []
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return {"status": "fail", "summary": f"no wheels in {wheels}: run `make gpu-wheels` before copying the tree"}, ""
    chosen, kept = [], []
    for w in found:
        name, ver = _wheel_name(w)
        have = _installed(name)
        if name in FLOORS and have is not None and _version_key(have) >= _version_key(ver):
            kept.append(f"{name} {have}")
        else:
            chosen.append(w)
    pip = [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--no-build-isolation", "--target", str(site), *(str(w) for w in chosen)]
    details: dict = {"site": str(site), "wheels": [w.name for w in chosen], "image_kept": kept}
    # One pip call for all (a second --target install would not merge into the first's bin/): luwu
    # built from this tree, what is being checked; the wheel `make gpu-wheels` built is the fallback.
    built = sorted((wheels / "luwu").glob("luwu-*.whl"))
    for source in [str(REPO), *(str(b) for b in built[-1:])]:
        if site.exists():
            if any(site.iterdir()) and not (site / MARK).exists():
                return {"status": "fail", "summary": f"{site} holds files this script did not put there: pass an "
                        "empty or new folder as --site"}, ""
            shutil.rmtree(site)
        site.mkdir(parents=True)
        (site / MARK).write_text("made by scripts/gpu-check; emptied by its next run\n")
        cmd = [*pip, source]
        rc, text, _ = _run_limited(cmd, env, limit - (time.monotonic() - t0))
        out.append(f"$ {' '.join(cmd)}\n{text}")
        if rc == 0:
            if source != str(REPO):
                details["luwu_from"] = f"{Path(source).name} (the tree's build failed)"
            break
    else:
        return {"status": "fail", "summary": f"pip install failed (exit {rc}){'' if built else '; .whl/luwu/ has no fallback wheel'}",
                "details": details}, "\n".join(out)
    details.setdefault("luwu_from", "this tree")
    probe = ("import sys, luwu, finsy, scapy, pyroute2, luwu.worker.backend, luwu.train\n"
             "from importlib.metadata import version\n"
             "print('GPU_CHECK_IMPORTS', luwu.__file__, version('luwu'), version('finsy'), version('scapy'))\n")
    rc, text, _ = _run_limited([py, "-P", "-c", probe], env, max(10.0, limit - (time.monotonic() - t0)),
                               cwd=Path(tempfile.gettempdir()))
    out.append(f"$ import probe\n{text}")
    line = next((ln for ln in text.splitlines() if ln.startswith("GPU_CHECK_IMPORTS")), None)
    if rc != 0 or line is None:
        return {"status": "fail", "summary": f"luwu or a dependency does not import after the install (exit {rc})",
                "details": details}, "\n".join(out)
    where = line.split()[1]
    details["luwu_file"] = where
    details["scripts"] = sorted(p.name for p in (site / "bin").glob("luwu*"))
    if not where.startswith(str(site)):
        return {"status": "fail", "summary": f"luwu imports from {where}, not the fresh install in {site}",
                "details": details}, "\n".join(out)
    n_kept = f", kept the image's {', '.join(kept)}" if kept else ""
    return {"status": "pass", "summary": f"{len(chosen)} wheels + luwu ({details['luwu_from']}) into {site} offline"
            f"{n_kept}", "details": details}, "\n".join(out)


def _check(py: str, env: dict, name: str, device: str, limit: float, scratch: Path) -> tuple[dict, str]:
    result = scratch / f"{name}.json"
    cmd = [py, str(HERE / "gpu_checks.py"), name, "--device", device, "--result", str(result),
           "--scratch", str(scratch / name)]
    rc, output, took = _run_limited(cmd, env, limit)
    if rc is None:
        res = {"status": "timeout", "summary": f"stopped after its limit of {limit:.0f} s"}
    elif result.exists():
        res = json.loads(result.read_text())
        if rc != 0 and res.get("status") == "pass":
            res = {**res, "status": "fail", "summary": f"exit status {rc} after reporting pass: {res.get('summary')}"}
    else:
        res = {"status": "error", "summary": f"exit status {rc} without a result (see the output below)"}
    res["seconds"] = round(took, 1)
    return res, output


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n")[0])
    ap.add_argument("--wheels", default=str(REPO / ".whl"), help="the folder `make gpu-wheels` made (default: .whl)")
    ap.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "luwu-gpu-check", "site"),
                    help="fresh install target, emptied first (default: %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for gpu-check.json/.log (default: $OUT or .)")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks among {', '.join(CHECKS)}")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: CUDA checks on the GPU, skipped without one; cpu: mnn and ddp on the CPU (a dry run)")
    args = ap.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        print(f"gpu-check: unknown check(s) {', '.join(unknown)}; choose among {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    py = sys.executable
    site = Path(args.site).resolve()
    run = Run(Path(args.out).resolve(), args.device)
    env = dict(os.environ, PIP_NO_INDEX="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TORCH_NCCL_ASYNC_ERROR_HANDLING="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    # The repository root holds luwu's folders, not its import layout: `python -m ...` would put the
    # current folder first on sys.path and find ./luwu (without luwu.dataplane). luwu's own children
    # pass -P (dataplane/process/children.py python_module); PYTHONSAFEPATH covers what this script starts.
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])
    run.say(f"gpu-check: {platform.node()} python {platform.python_version()} ({py}), tree {REPO}")
    info = _environment(py, env)
    run.result["environment"] = info
    run.say("gpu-check: " + ", ".join(f"{k} {info.get(k)}" for k in ("torch", "cuda_build", "cuda_available", "device_name",
                                                                        "device_count", "capability", "nccl", "numpy",
                                                                        "transformers", "grpcio", "protobuf")))
    for key in ("error", "torch_error", "numba_error"):
        if key in info:
            run.say(f"gpu-check: environment: {key}: {info[key]}")
    run.write()
    t_install = time.monotonic()
    res, output = _install(py, env, Path(args.wheels), site, LIMITS["install"])
    res.setdefault("seconds", round(time.monotonic() - t_install, 1))
    run.record("install", res, output)
    failed = res["status"] != "pass"
    device = args.device
    if device == "auto":
        device = "cuda" if info.get("cuda_available") else "none"
        if device == "none" and Path("/dev/nvidiactl").exists():
            run.say("gpu-check: FAILED to reach the GPU: /dev/nvidiactl exists but torch.cuda.is_available() is "
                    "False (driver or torch build; see the environment line); the GPU checks will say skip")
            run.result["gpu_present_but_unusable"] = True
            failed = True
    with tempfile.TemporaryDirectory(prefix="luwu-gpu-check-") as scratch:
        for i, name in enumerate(only):  # after a failed install too: each check says what it could not import
            later = len(only) - i - 1
            limit = min(LIMITS[name], run.remaining() - RESERVE * later)
            if limit < 10:
                run.record(name, {"status": "timeout", "summary": f"not run: the run's budget of {BUDGET} s is spent",
                                  "seconds": 0.0}, "")
                failed = True
                continue
            res, output = _check(py, env, name, device, limit, Path(scratch))
            run.record(name, res, output)
            failed = failed or res["status"] in ("fail", "error", "timeout")
    counts: dict[str, int] = {}
    for r in run.result["checks"].values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    run.result["ok"] = not failed
    run.write()
    run.say(f"gpu-check: {'OK' if not failed else 'FAILED'} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}) "
            f"in {time.monotonic() - run.t0:.0f} s; {run.json_path}")
    run.log.close()
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
