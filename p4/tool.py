"""`luwu p4`: generate, check and build the P4 programs.

  luwu p4 generate [--lanes N]   write constants.p4, the lane files and build/p4info.txtpb
  luwu p4 check                  fail (exit 1) if a generated file is stale
  luwu p4 build [--target T]     compile with p4c / bf-p4c when installed; otherwise say
                                 what is missing and print the exact commands
  luwu p4 commands               print the compile and run commands only
  luwu p4 load --runtime F       push the pipeline and a runtime JSON to a P4Runtime switch
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from . import BUILD_DIR, P4_DIR, P4INFO_TXTPB

BMV2_JSON = BUILD_DIR / "luwu_v1model.json"
BMV2_P4INFO = BUILD_DIR / "p4info.compiled.txtpb"  # p4c's own output, compared with the committed one
TNA_BUILD = BUILD_DIR / "tofino"
P4RUNTIME_PORT = 50051  # simple_switch_grpc's default gRPC port
BMV2_DEVICE_ID = 0  # finsy defaults to 1, which BMv2 rejects


def _rel(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (commands to paste)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def bmv2_compile_command(defines: list[str] = ()) -> list[str]:
    return ["p4c", "--target", "bmv2", "--arch", "v1model", *[f"-D{d}" for d in defines],
            "--p4runtime-files", _rel(BMV2_P4INFO), "-o", _rel(BUILD_DIR), _rel(P4_DIR / "luwu_v1model.p4")]


def tofino_compile_command(defines: list[str] = ()) -> list[str]:
    return ["bf-p4c", "--target", "tofino", "--arch", "tna", "--std", "p4-16", *[f"-D{d}" for d in defines],
            "--p4runtime-files", _rel(TNA_BUILD / "p4info.txtpb"), "-o", _rel(TNA_BUILD), _rel(P4_DIR / "luwu_tna.p4")]


def commands_text(defines: list[str] = ()) -> str:
    return "\n".join([
        "# BMv2 (v1model): JSON for simple_switch_grpc and P4Info",
        " ".join(bmv2_compile_command(defines)),
        "# Tofino (TNA) with the Intel P4 Studio SDE ($SDE set, $SDE_INSTALL/bin on PATH):",
        " ".join(tofino_compile_command(defines)),
        f"#   or: $SDE/p4_build.sh {_rel(P4_DIR / 'luwu_tna.p4')} P4_NAME=luwu P4_VERSION=p4-16 P4_ARCHITECTURE=tna"
        + "".join(f" P4FLAGS+=-D{d}" for d in defines),
        "# run on BMv2 (veth pairs as ports 1..N; P4Runtime on 50051, device id 0):",
        f"simple_switch_grpc --device-id {BMV2_DEVICE_ID} -i 1@veth1 -i 2@veth3 --no-p4 -- "
        f"--grpc-server-addr 0.0.0.0:{P4RUNTIME_PORT} --cpu-port 255",
        "# then set the pipeline (bmv2 JSON + P4Info) and a runtime JSON over P4Runtime:",
        f"luwu p4 load --addr 127.0.0.1:{P4RUNTIME_PORT} --device-id {BMV2_DEVICE_ID} "
        f"--runtime {_rel(P4_DIR / 'runtime' / 'star4.json')}",
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="write the generated P4 files and build/p4info.txtpb")
    gen.add_argument("--lanes", default="tofino",
                     help="lanes per aggregation packet: a packet mode (tofino=64, jumbo, loopback) or a number")
    sub.add_parser("check", help="exit 1 if a generated file is out of date")
    build = sub.add_parser("build", help="compile with p4c (BMv2) and/or bf-p4c (Tofino) when installed")
    build.add_argument("--target", choices=["bmv2", "tofino", "all"], default="bmv2")
    build.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                       help="build parameter, e.g. -D SLOTS=8192 (see p4/include/parameters.p4)")
    cmds = sub.add_parser("commands", help="print the compile and run commands")
    cmds.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    load = sub.add_parser("load", help="push the pipeline and a runtime JSON to a P4Runtime switch (BMv2)")
    load.add_argument("--addr", default=f"127.0.0.1:{P4RUNTIME_PORT}", help="P4Runtime address (host:port)")
    load.add_argument("--device-id", type=int, default=BMV2_DEVICE_ID, help="P4Runtime device id (BMv2: 0)")
    load.add_argument("--runtime", required=True, help="runtime JSON (p4/runtime/star4.json is an example)")
    load.add_argument("--p4info", help="P4Info (default: the runtime JSON's `p4info`, relative to the file)")
    load.add_argument("--bmv2-json", help="compiled BMv2 JSON (default: the runtime JSON's `bmv2_json`)")


def run(args: argparse.Namespace) -> int:
    if args.action == "generate":
        from luwu.dataplane.protocol import lanes_for_mode

        from .generate import generate

        lanes = lanes_for_mode(args.lanes)
        changed = generate(lanes)
        for path in changed:
            print(f"wrote {path.relative_to(P4_DIR.parent)}")
        print(f"{len(changed)} file(s) changed; lanes = {lanes}; P4Info: {P4INFO_TXTPB.relative_to(P4_DIR.parent)}")
        return 0
    if args.action == "check":
        from .generate import check

        stale = check()
        for item in stale:
            print(f"STALE {item.path.relative_to(P4_DIR.parent)}: {item.reason}")
        if stale:
            print("run `luwu p4 generate` (with the same --lanes) and commit the result")
            return 1
        print("generated P4 files and P4Info are up to date")
        return 0
    if args.action == "commands":
        print(commands_text(args.defines))
        return 0
    if args.action == "load":
        return _load(args)
    return _build(args)


def _build(args: argparse.Namespace) -> int:
    targets = ["bmv2", "tofino"] if args.target == "all" else [args.target]
    status = 0
    for target in targets:
        cmd = bmv2_compile_command(args.defines) if target == "bmv2" else tofino_compile_command(args.defines)
        if shutil.which(cmd[0]) is None:
            hint = ("install p4c (e.g. the p4lang `p4c` Debian/Ubuntu package) for p4c-bm2-ss"
                    if target == "bmv2" else "install the Intel P4 Studio SDE and put $SDE_INSTALL/bin on PATH")
            print(f"{target}: `{cmd[0]}` is not on PATH: {hint}. Command to run:\n  {' '.join(cmd)}")
            status = 2
            continue
        if target == "tofino":
            TNA_BUILD.mkdir(parents=True, exist_ok=True)
        print("$ " + " ".join(cmd))
        result = subprocess.run(cmd, check=False)
        if result.returncode:
            print(f"{target}: compile failed (exit {result.returncode})")
            status = result.returncode
        elif target == "bmv2":
            status = max(status, _compare_p4info())
    return status


def _load(args: argparse.Namespace) -> int:
    import asyncio

    from .bmv2 import load
    from .runtime_config import RuntimeConfigError

    try:
        n = asyncio.run(load(args.addr, Path(args.runtime), Path(args.p4info) if args.p4info else None,
                             Path(args.bmv2_json) if args.bmv2_json else None, args.device_id))
    except (RuntimeConfigError, FileNotFoundError) as exc:
        print(f"luwu p4 load: {exc}")
        return 2
    print(f"pipeline set and {n} entities written to {args.addr} (device id {args.device_id})")
    return 0


def _compare_p4info() -> int:
    """p4c's P4Info against the committed one (which the generator derives without p4c)."""
    from .p4info import load_p4info, p4info_differences

    diffs = p4info_differences(load_p4info(BMV2_P4INFO), load_p4info(P4INFO_TXTPB))
    if diffs:
        print(f"p4c's P4Info ({_rel(BMV2_P4INFO)}) differs from the committed {_rel(P4INFO_TXTPB)}:")
        for line in diffs:
            print("  " + line)
        return 1
    print(f"p4c's P4Info matches the committed {_rel(P4INFO_TXTPB)}")
    return 0
