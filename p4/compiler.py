"""The P4 compilers as luwu runs them: p4c for BMv2, p4test for the TNA program, bf-p4c for Tofino.

p4c is the source of truth for the P4Info and the BMv2 JSON: `luwu p4 generate` compiles
`luwu_v1model.p4` and commits what p4c writes (`build/p4info.txtpb`, `build/luwu_v1model.json`)
with a stamp (`build/build-info.json`) holding the SHA-256 of every P4 source and of both
outputs. The stamp lets a machine without p4c tell that the committed build is stale, and one
with p4c check that a fresh compile gives the same outputs. Every compile runs from the
repository root with relative paths, so the outputs name `p4/...` files and not a checkout's
absolute path, and are byte-for-byte reproducible.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import BUILD_DIR, P4_DIR, P4INFO_TXTPB

REPO_DIR = P4_DIR.parent
V1MODEL_PROGRAM = P4_DIR / "luwu_v1model.p4"
TNA_PROGRAM = P4_DIR / "luwu_tna.p4"
BMV2_JSON = BUILD_DIR / "luwu_v1model.json"
BUILD_INFO = BUILD_DIR / "build-info.json"
TNA_BUILD = BUILD_DIR / "tofino"
COMPILE_TIMEOUT = 900  # s; p4c takes ~20 s for the 64-lane program on two cores

INSTALL_HINT = ("install p4c and behavioral-model (BMv2) as p4lang documents them "
                "(github.com/p4lang/p4c#installing-packaged-versions-of-p4c, or build both from source)")
TOFINO_HINT = "install the Intel P4 Studio SDE (bf-p4c) and put $SDE_INSTALL/bin on PATH"


class CompileError(RuntimeError):
    """A compiler rejected the program; the message holds its diagnostics."""


@dataclass
class CompileResult:
    bmv2_json: Path
    p4info: Path
    warnings: list[str]


def rel(path: Path) -> str:
    """`path` relative to the repository root (what the compilers are given and what they print)."""
    try:
        return str(path.resolve().relative_to(REPO_DIR))
    except ValueError:
        return str(path)


def p4c_available() -> bool:
    return shutil.which("p4c") is not None


def p4c_version() -> str:
    out = subprocess.run(["p4c", "--version"], capture_output=True, text=True, timeout=60, check=False)
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "p4c"


def bmv2_command(out_dir: Path, defines: list[str] = ()) -> list[str]:
    return ["p4c", "--target", "bmv2", "--arch", "v1model", *[f"-D{d}" for d in defines],
            "--p4runtime-files", rel(out_dir / "p4info.txtpb"), "-o", rel(out_dir), rel(V1MODEL_PROGRAM)]


def tna_check_command(tofino: int = 1, defines: list[str] = ()) -> list[str]:
    """p4test over the TNA program: p4c's front and mid end against tna.p4 (no Tofino back end)."""
    return ["p4test", f"-D__TARGET_TOFINO__={tofino}", *[f"-D{d}" for d in defines], rel(TNA_PROGRAM)]


def tofino_command(defines: list[str] = ()) -> list[str]:
    return ["bf-p4c", "--target", "tofino", "--arch", "tna", "--std", "p4-16", *[f"-D{d}" for d in defines],
            "--p4runtime-files", rel(TNA_BUILD / "p4info.txtpb"), "-o", rel(TNA_BUILD), rel(TNA_PROGRAM)]


def _run(cmd: list[str]) -> list[str]:
    """Run a compiler from the repository root; its warnings, or CompileError with its output."""
    result = subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True, timeout=COMPILE_TIMEOUT, check=False)
    output = (result.stdout + result.stderr).strip()
    if result.returncode:
        raise CompileError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{output}")
    return [line for line in output.splitlines() if "warning" in line]


def compile_bmv2(out_dir: Path, defines: list[str] = ()) -> CompileResult:
    """Compile luwu_v1model.p4 with p4c into `out_dir` (inside or outside the repository)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    warnings = _run(bmv2_command(out_dir, defines))
    (out_dir / "luwu_v1model.p4i").unlink(missing_ok=True)  # the preprocessed source: not an artifact
    return CompileResult(out_dir / "luwu_v1model.json", out_dir / "p4info.txtpb", warnings)


def check_tna(tofino: int = 1, defines: list[str] = ()) -> list[str]:
    """p4test's warnings for luwu_tna.p4 against Tofino `tofino`'s TNA; CompileError on errors."""
    return _run(tna_check_command(tofino, defines))


def p4_sources() -> list[Path]:
    """The sources of the BMv2 build: luwu_v1model.p4 and include/, in a stable order."""
    return [V1MODEL_PROGRAM, *sorted((P4_DIR / "include").glob("*.p4"))]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sources_digest() -> str:
    h = hashlib.sha256()
    for path in p4_sources():
        h.update(rel(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def normalized_json(path: Path) -> dict:
    """A BMv2 JSON without its `program` field (the output directory p4c was given)."""
    data = json.loads(path.read_text())
    data.pop("program", None)
    return data


def write_build_info(compiler: str) -> None:
    info = {
        "compiler": compiler,
        "command": " ".join(bmv2_command(BUILD_DIR)),
        "sources_sha256": sources_digest(),
        "outputs_sha256": {rel(p): _sha256(p) for p in (P4INFO_TXTPB, BMV2_JSON)},
    }
    BUILD_INFO.write_text(json.dumps(info, indent=2) + "\n")


def build_staleness() -> list[str]:
    """Why the committed build does not match the sources (empty: it does). Needs no compiler."""
    if not BUILD_INFO.exists():
        return [f"{rel(BUILD_INFO)} is missing"]
    info = json.loads(BUILD_INFO.read_text())
    reasons = []
    if info.get("sources_sha256") != sources_digest():
        reasons.append("the P4 sources changed since the committed build")
    for name, digest in info.get("outputs_sha256", {}).items():
        path = REPO_DIR / name
        if not path.exists():
            reasons.append(f"{name} is missing")
        elif _sha256(path) != digest:
            reasons.append(f"{name} is not what p4c wrote (edited by hand?)")
    return reasons


def rebuild() -> CompileResult:
    """Compile into p4/build (the committed outputs) and stamp them."""
    result = compile_bmv2(BUILD_DIR)
    write_build_info(p4c_version())
    return result


def compare_with_fresh_compile() -> list[str]:
    """Differences between the committed outputs and a fresh p4c compile (empty: identical)."""
    from finsy.proto import p4i
    from google.protobuf import text_format

    with tempfile.TemporaryDirectory() as tmp:
        fresh = compile_bmv2(Path(tmp))
        diffs = []
        committed = text_format.Parse(P4INFO_TXTPB.read_text(), p4i.P4Info())
        compiled = text_format.Parse(fresh.p4info.read_text(), p4i.P4Info())
        if committed != compiled:
            diffs.append(f"{rel(P4INFO_TXTPB)} differs from p4c's P4Info")
        if not BMV2_JSON.exists() or normalized_json(BMV2_JSON) != normalized_json(fresh.bmv2_json):
            diffs.append(f"{rel(BMV2_JSON)} differs from p4c's BMv2 JSON")
        return diffs
