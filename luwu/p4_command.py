"""`luwu p4`: generate, check and build the P4 programs.

  luwu p4 generate [--lanes N]   write the generated sources; with p4c on PATH, recompile the
                                 committed build (P4Info, BMv2 JSON, stamp)
  luwu p4 check [--compile]      fail (exit 1) if a generated file or the committed build is stale;
                                 --compile also recompiles with p4c and compares byte for byte
  luwu p4 build [--target T]     compile with p4c (BMv2), p4test (TNA front/mid end) or bf-p4c
                                 (Tofino) when installed; otherwise say in one line what to install
  luwu p4 commands               print the compile and run commands only
  luwu p4 load --runtime F       push the pipeline and a runtime JSON to a P4Runtime switch (with
                                 --token/--token-file and --tls-* for an authenticated `luwu switch`)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

from luwu.p4 import BUILD_DIR, P4_DIR, P4INFO_TXTPB
from luwu.p4.compiler import (
    INSTALL_HINT,
    TNA_BUILD,
    TOFINO_HINT,
    CompileError,
    bmv2_command,
    check_tna,
    compare_with_fresh_compile,
    p4c_available,
    rebuild,
    rel,
    tna_check_command,
    tofino_command,
)

P4RUNTIME_PORT = 50051  # simple_switch_grpc's default gRPC port
BMV2_DEVICE_ID = 0  # finsy defaults to 1, which BMv2 rejects
TNA_TARGETS = (1, 2)  # __TARGET_TOFINO__ values p4test checks the TNA program for


def commands_text(defines: list[str] | None = None) -> str:
    defines = defines or []
    return "\n".join([
        "# BMv2 (v1model): JSON for simple_switch_grpc and P4Info (run from the repository root)",
        " ".join(bmv2_command(BUILD_DIR, defines)),
        "# TNA front and mid end (p4c's p4test with the Tofino architecture includes):",
        " ".join(tna_check_command(1, defines)),
        "# Tofino (TNA) with the Intel P4 Studio SDE ($SDE set, $SDE_INSTALL/bin on PATH):",
        " ".join(tofino_command(defines)),
        f"#   or: $SDE/p4_build.sh {rel(P4_DIR / 'luwu_tna.p4')} P4_NAME=luwu P4_VERSION=p4-16 P4_ARCHITECTURE=tna"
        + "".join(f" P4FLAGS+=-D{d}" for d in defines),
        "# run on BMv2 (veth pairs as ports 1..N; P4Runtime on 50051, device id 0):",
        f"simple_switch_grpc --device-id {BMV2_DEVICE_ID} -i 1@veth1 -i 2@veth3 --no-p4 -- "
        f"--grpc-server-addr 0.0.0.0:{P4RUNTIME_PORT} --cpu-port 255",
        "# then set the pipeline (bmv2 JSON + P4Info) and a runtime JSON over P4Runtime:",
        f"luwu p4 load --addr 127.0.0.1:{P4RUNTIME_PORT} --device-id {BMV2_DEVICE_ID} "
        f"--runtime {rel(P4_DIR / 'runtime' / 'star4.json')}",
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="write the generated P4 files; recompile the committed build with p4c")
    gen.add_argument("--lanes", default="tofino",
                     help="lanes per aggregation packet: a packet mode (tofino=64, jumbo, loopback) or a number")
    gen.add_argument("--no-compile", action="store_true", help="write the sources only, even where p4c is installed")
    chk = sub.add_parser("check", help="exit 1 if a generated file or the committed build is out of date")
    chk.add_argument("--compile", action="store_true",
                     help="also recompile with p4c and compare with the committed P4Info and BMv2 JSON")
    build = sub.add_parser("build", help="compile with p4c (BMv2), p4test (TNA) and/or bf-p4c (Tofino)")
    build.add_argument("--target", choices=["bmv2", "tna", "tofino", "all"], default="bmv2",
                       help="bmv2: p4c into p4/build; tna: p4test front/mid end for Tofino 1 and 2; "
                            "tofino: bf-p4c (Intel SDE); all: each that is installed")
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
    auth = load.add_mutually_exclusive_group()
    auth.add_argument("--token", help="the switch's P4Runtime token (a `luwu switch` with authentication: its "
                                      "--p4runtime-token-file, or HMAC of the admin token and its name as the "
                                      "controller derives it); sent as `authorization: Bearer`, over TLS or loopback")
    auth.add_argument("--token-file", help="file holding the switch's P4Runtime token (preferred over --token: "
                                           "not in the process list)")
    load.add_argument("--tls-ca", help="PEM CA of the switch's P4Runtime certificate: connect over TLS")
    load.add_argument("--tls-cert", help="PEM client certificate for switches that require one (mutual TLS; with "
                                         "--tls-key)")
    load.add_argument("--tls-key", help="PEM private key of --tls-cert")


def run(args: argparse.Namespace) -> int:
    if args.action == "generate":
        from luwu.dataplane.protocol import lanes_for_mode
        from luwu.p4.generate import generate

        lanes = lanes_for_mode(args.lanes)
        try:
            changed, notes = generate(lanes, compile=not args.no_compile)
        except CompileError as exc:
            print(f"luwu p4 generate: {exc}", file=sys.stderr)
            return 1
        for path in changed:
            print(f"wrote {rel(path)}")
        for note in notes:
            print(note)
        print(f"{len(changed)} file(s) changed; lanes = {lanes}; P4Info: {rel(P4INFO_TXTPB)}")
        return 0
    if args.action == "check":
        from luwu.p4.generate import check

        stale = check()
        diffs: list[str] = []  # a fresh p4c compile against the committed build (--compile)
        for item in stale:
            print(f"STALE {rel(item.path)}: {item.reason}")
        if not stale and args.compile:
            if not p4c_available():
                print(f"luwu p4 check --compile: p4c is not on PATH; {INSTALL_HINT}", file=sys.stderr)
                return 2
            try:
                diffs = compare_with_fresh_compile()
            except CompileError as exc:
                print(f"luwu p4 check: {exc}", file=sys.stderr)
                return 1
            for diff in diffs:
                print(f"STALE {diff}")
        if stale or diffs:
            print("run `luwu p4 generate` (with the same --lanes, p4c on PATH) and commit the result")
            return 1
        print("generated P4 files, P4Info and BMv2 JSON are up to date" + (" (recompiled: identical)" if args.compile else ""))
        return 0
    if args.action == "commands":
        print(commands_text(args.defines))
        return 0
    if args.action == "load":
        return _load(args)
    return _build(args)


def _build(args: argparse.Namespace) -> int:
    targets = ["bmv2", "tna", "tofino"] if args.target == "all" else [args.target]
    status, ran = 0, 0
    for target in targets:
        tool = {"bmv2": "p4c", "tna": "p4test", "tofino": "bf-p4c"}[target]
        if shutil.which(tool) is None:
            hint = TOFINO_HINT if target == "tofino" else INSTALL_HINT
            print(f"luwu p4 build: {tool} is not on PATH ({target}); {hint}", file=sys.stderr)
            if args.target != "all":  # `all` builds what is installed
                status = status or 2
            continue
        ran += 1
        try:
            if target == "bmv2":
                if args.defines:  # a parameterised build is the user's, never the committed one
                    out = BUILD_DIR / "custom"
                    from luwu.p4.compiler import compile_bmv2

                    result = compile_bmv2(out, args.defines)
                else:
                    result = rebuild()
                for w in result.warnings:
                    print(f"p4c: {w}")
                print(f"bmv2: {rel(result.bmv2_json)} and {rel(result.p4info)}")
            elif target == "tna":
                for tofino in TNA_TARGETS:
                    warnings = check_tna(tofino, args.defines)
                    print(f"tna: {rel(P4_DIR / 'luwu_tna.p4')} passes p4test for Tofino {tofino}"
                          f"{'' if warnings else ' with no warnings'}")
                    for line in summarize_warnings(warnings):
                        print(f"  p4test: {line}")
            else:
                TNA_BUILD.mkdir(parents=True, exist_ok=True)
                cmd = tofino_command(args.defines)
                print("$ " + " ".join(cmd))
                proc = subprocess.run(cmd, cwd=P4_DIR.parent, check=False)
                if proc.returncode:
                    print(f"luwu p4 build: bf-p4c failed (exit {proc.returncode})", file=sys.stderr)
                    status = proc.returncode
        except CompileError as exc:
            print(f"luwu p4 build: {exc}", file=sys.stderr)
            status = 1
    return status if ran else 2


def _load_credentials(args: argparse.Namespace):
    """finsy channel credentials for `luwu p4 load`, the way the controller reaches a switch
    (luwu.dataplane.p4runtime.credentials): the token over TLS, or over gRPC local credentials on
    loopback; None for a plaintext switch (BMv2). Bad options raise UserError (one line)."""
    from luwu.dataplane.process.usage import UserError, existing_file_or_error, pem_certificates_or_error

    token = args.token
    if args.token_file:
        try:
            token = existing_file_or_error(args.token_file, "--token-file").read_text().strip()
        except OSError as exc:
            raise UserError(f"--token-file {args.token_file}: cannot read it ({exc.strerror})") from None
        if not token:
            raise UserError(f"--token-file {args.token_file} is empty: it must hold the switch's P4Runtime token")
    if token is not None and not token.strip():
        raise UserError("--token must not be empty")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UserError("--tls-cert and --tls-key go together (the client certificate and its key)")
    if args.tls_cert and not args.tls_ca:
        raise UserError("--tls-cert needs --tls-ca (the CA of the switch's certificate): mutual TLS is TLS first")
    for flag in ("tls_ca", "tls_cert", "tls_key"):
        if getattr(args, flag):
            existing_file_or_error(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.tls_ca:
        pem_certificates_or_error(args.tls_ca, "--tls-ca")
    if not token and not args.tls_ca:
        return None
    from luwu.dataplane.p4runtime import is_loopback
    from luwu.dataplane.p4runtime.credentials import SwitchTls, switch_credentials

    tls = SwitchTls(args.tls_ca, args.tls_cert or "", args.tls_key or "") if args.tls_ca else None
    if token and tls is None and not is_loopback(args.addr):
        raise UserError(f"--token to {args.addr} needs --tls-ca: a bearer token travels only over TLS or loopback")
    return switch_credentials(args.addr, token or "", tls)


def summarize_warnings(warnings: list[str]) -> list[str]:
    """One line per warning kind (`[--Wwarn=kind]`): its count and first occurrence."""
    kinds: dict[str, list[str]] = {}
    for w in warnings:
        m = re.search(r"\[--Wwarn=([\w-]+)\]", w)
        kinds.setdefault(m.group(1) if m else "other", []).append(w)
    return [f"{len(ws)} x {kind} (p4/README.md explains it), first: {ws[0]}" for kind, ws in kinds.items()]


def _load(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import finsy

    from luwu.dataplane.p4runtime.bmv2 import load
    from luwu.dataplane.p4runtime.entries import RuntimeConfigError

    credentials = _load_credentials(args)
    logging.getLogger("finsy").setLevel(logging.CRITICAL + 1)  # its tracebacks (logged CRITICAL) say what one line says
    try:
        n = asyncio.run(load(args.addr, Path(args.runtime), Path(args.p4info) if args.p4info else None,
                             Path(args.bmv2_json) if args.bmv2_json else None, args.device_id, credentials))
    except (RuntimeConfigError, FileNotFoundError) as exc:
        print(f"luwu p4 load: {exc}")
        return 2
    except finsy.P4ClientError as exc:  # refused (no or wrong token, role) or unreachable: one line naming the switch
        code = getattr(getattr(exc, "code", None), "name", "") or "error"
        hint = " (pass the switch's --token-file)" if code == "UNAUTHENTICATED" else ""
        print(f"luwu p4 load: the P4Runtime switch at {args.addr} (device id {args.device_id}) answered {code}: "
              f"{(getattr(exc, 'message', '') or str(exc))[:300]}{hint}", file=sys.stderr)
        return 1
    print(f"pipeline set and {n} entities written to {args.addr} (device id {args.device_id})")
    return 0
