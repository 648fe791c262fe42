"""`luwu bmv2`: one BMv2 (simple_switch_grpc) running the luwu pipeline, in one command.

    luwu bmv2 --port 1=veth1 --port 2=veth3 --runtime p4/runtime/star4.json

starts `simple_switch_grpc` with device id 0 on the given interfaces, pushes the committed build
(p4/build/luwu_v1model.json and p4info.txtpb, forced) and the runtime JSON's table entries and
multicast groups over P4Runtime (`luwu.dataplane.p4runtime.bmv2`, finsy), prints one JSON
ready line (as `luwu switch` does) and runs until SIGINT/SIGTERM, then stops simple_switch_grpc
(SIGTERM, SIGKILL after a grace period) by its process id. BMv2's own output goes to stderr (or `--log-file`).

`command()` is the one place that builds simple_switch_grpc's command line; the emulation
(`luwu mininet run --switch bmv2`) starts its switches with it too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from luwu.dataplane.p4runtime.bmv2 import BMV2_DEVICE_ID
from luwu.p4 import P4INFO_TXTPB
from luwu.p4.compiler import BMV2_JSON

BINARY = "simple_switch_grpc"
DEFAULT_GRPC = "127.0.0.1:50051"  # P4Runtime's registered port; loopback unless asked otherwise
DEFAULT_THRIFT_PORT = 9090  # BMv2's default (simple_switch_CLI)
START_TIMEOUT = 30.0  # s for simple_switch_grpc to accept the pipeline
STOP_GRACE = 5.0  # s between SIGTERM and SIGKILL
MAX_PORT = 511  # BMv2's default port numbers are 9-bit (v1model egress_spec)
EXIT_USAGE, EXIT_FAILED = 2, 1


class Bmv2Error(RuntimeError):
    """BMv2 could not be started or programmed; the message says what to fix."""


def missing(bmv2_json: Path | None = None, p4info: Path | None = None) -> str | None:
    """None when BMv2 can run the luwu pipeline here, else what to install or build.

    Args:
        bmv2_json, p4info: the program to run; default the committed build (p4/build).

    Returns:
        None, or one sentence ("needs ...") naming the missing binary or file and how to get it.
    """
    if shutil.which(BINARY) is None:
        return f"needs {BINARY} on PATH (BMv2 built with P4Runtime support; see p4/README.md \"Run on BMv2\")"
    for path in (Path(bmv2_json or BMV2_JSON), Path(p4info or P4INFO_TXTPB)):
        if not path.exists():
            return f"needs {path}: run `luwu p4 build` (needs p4c) first"
    return None


def command(ports: dict[int, str], grpc_address: str, thrift_port: int, device_id: int = BMV2_DEVICE_ID,
            cpu_port: int | None = None, log_file: Path | None = None, log_level: str = "") -> list[str]:
    """simple_switch_grpc's command line: `-i PORT@IFNAME` per port, no program (P4Runtime sets it).

    Args:
        ports: switch port number -> interface name.
        grpc_address: HOST:PORT the P4Runtime server binds.
        thrift_port: TCP port of BMv2's Thrift server (simple_switch_CLI); every BMv2 needs its own.
        device_id: P4Runtime device id; luwu's loader speaks to 0.
        cpu_port: BMv2's CPU port (packet-in/out), or None for none.
        log_file, log_level: BMv2's own log (`--log-file`, `-L trace|debug|info|...`), for debugging.

    Returns:
        argv for subprocess.

    Examples::

        >>> command({1: "veth1", 2: "veth3"}, "127.0.0.1:50051", 9090)[:6]
        ['simple_switch_grpc', '--device-id', '0', '--thrift-port', '9090', '-i']
    """
    argv = [BINARY, "--device-id", str(device_id), "--thrift-port", str(thrift_port)]
    for port, ifname in sorted(ports.items()):
        argv += ["-i", f"{port}@{ifname}"]
    if log_file is not None:
        argv += ["--log-file", str(log_file), "--log-flush"]
    if log_level:
        argv += ["-L", log_level]
    argv += ["--no-p4", "--", "--grpc-server-addr", grpc_address]
    if cpu_port is not None:
        argv += ["--cpu-port", str(cpu_port)]
    return argv


class Loader:
    """P4Runtime exchanges (finsy) on one event loop for the whole process. grpc's asyncio poller
    outlives a loop: a fresh `asyncio.run` per call leaves it calling into a closed loop ("Event
    loop is closed" tracebacks on stderr), so every call shares one loop that is never closed."""

    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    @classmethod
    def run(cls, coro, timeout: float):
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                logging.getLogger("finsy").setLevel(logging.ERROR)  # "gNMI is not implemented": BMv2 has none
            return cls._loop.run_until_complete(asyncio.wait_for(coro, timeout))


def program(proc: subprocess.Popen | None, address: str, runtime: Path | None, p4info: Path, bmv2_json: Path,
            timeout: float = START_TIMEOUT, cancelled=lambda: False) -> int:
    """Push the pipeline (forced) and `runtime`'s entities to the BMv2 at `address`, retrying while
    it starts; returns the entities written. Raises Bmv2Error when `proc` exits, `cancelled()`
    turns true or time runs out; ValueError/KeyError when the runtime does not fit the P4Info."""
    from luwu.dataplane.p4runtime import bmv2 as loader
    from luwu.dataplane.p4runtime.entries import RuntimeConfig

    async def push() -> int:
        sw = loader.switch_for(address, p4info, bmv2_json, BMV2_DEVICE_ID)
        async with sw:
            return 0 if cfg is None else await loader.write_runtime(sw, cfg)

    cfg = RuntimeConfig.load(runtime) if runtime is not None else None
    if cfg is not None:
        cfg.validate(_index(p4info))  # a bad runtime file is the user's mistake: say so before any retry
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Bmv2Error(f"{BINARY} exited ({proc.returncode}) before accepting the pipeline")
        if cancelled():
            raise Bmv2Error("interrupted while starting")
        try:
            return Loader.run(push(), max(1.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - not listening yet (any gRPC or connect error): retry
            last = e
            time.sleep(0.5)
    raise Bmv2Error(f"could not program {BINARY} at {address} within {timeout:g} s: {last}")


def _index(p4info: Path):
    from luwu.dataplane.p4runtime.entries import P4InfoIndex

    return P4InfoIndex.load(p4info)


def counters(address: str, p4info: Path = P4INFO_TXTPB, timeout: float = START_TIMEOUT) -> dict:
    """The luwu counters of the BMv2 at `address` (`luwu.dataplane.p4runtime.bmv2.read_counters`), pipeline left as is."""
    from luwu.dataplane.p4runtime import bmv2 as loader

    async def read() -> dict:
        sw = loader.switch_for(address, p4info, None, BMV2_DEVICE_ID, force=False)
        async with sw:
            return await loader.read_counters(sw)

    return Loader.run(read(), timeout)


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; returns the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


# -- `luwu bmv2` ------------------------------------------------------------------------------------

def _port(text: str) -> tuple[int, str]:
    import argparse

    num, sep, ifname = text.partition("=")
    if not sep or not num.strip().isdigit() or not ifname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N=IFNAME, e.g. 1=veth1")
    if not 0 <= int(num) <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r}: port number must be 0..{MAX_PORT}")
    return int(num), ifname


def add_arguments(p) -> None:
    from luwu.dataplane.process.usage import existing_file, host_port, positive_float, positive_int

    p.add_argument("--port", action="append", default=[], type=_port, metavar="N=IFNAME", required=True,
                   help="attach interface IFNAME as switch port N (repeatable)")
    p.add_argument("--runtime", type=existing_file, help="runtime JSON: table entries and multicast groups "
                   "(p4/README.md \"Runtime config\"); without it only the pipeline is set")
    p.add_argument("--grpc", type=host_port, default=DEFAULT_GRPC,
                   help=f"P4Runtime server address (default {DEFAULT_GRPC})")
    p.add_argument("--thrift-port", type=positive_int, default=DEFAULT_THRIFT_PORT,
                   help=f"BMv2's Thrift port for simple_switch_CLI (default {DEFAULT_THRIFT_PORT})")
    p.add_argument("--cpu-port", type=positive_int, default=None, help="BMv2 CPU port (default: none)")
    p.add_argument("--p4info", type=existing_file, default=None, help=f"P4Info (default {P4INFO_TXTPB})")
    p.add_argument("--bmv2-json", type=existing_file, default=None, help=f"BMv2 JSON (default {BMV2_JSON})")
    p.add_argument("--log-file", type=Path, default=None, help="BMv2's own log file (default: none)")
    p.add_argument("--log-level", choices=["trace", "debug", "info", "warn", "error", "off"], default="",
                   help="BMv2's log level with --log-file (its default: trace; slows it a lot)")
    p.add_argument("--timeout", type=positive_float, default=START_TIMEOUT,
                   help=f"seconds BMv2 may take to accept the pipeline (default {START_TIMEOUT:g})")


def _tcp_port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _check(args) -> tuple[dict[int, str], Path, Path]:
    """Ports, P4Info and JSON; raises UserError (one line, exit 2) for whatever cannot work."""
    from luwu.dataplane.process.usage import UserError

    ports: dict[int, str] = {}
    for num, ifname in args.port:
        if num in ports:
            raise UserError(f"--port {num} given twice ({ports[num]}, {ifname})")
        if not Path("/sys/class/net", ifname).exists():
            raise UserError(f"--port {num}={ifname}: no interface {ifname} in this network namespace")
        ports[num] = ifname
    p4info = Path(args.p4info or P4INFO_TXTPB)
    bmv2_json = Path(args.bmv2_json or BMV2_JSON)
    why = missing(bmv2_json, p4info)
    if why:
        raise UserError(why)
    if args.runtime:
        from luwu.dataplane.p4runtime.entries import RuntimeConfig

        try:
            RuntimeConfig.load(Path(args.runtime)).validate(_index(p4info))
        except (ValueError, KeyError) as e:
            raise UserError(f"--runtime {args.runtime}: {e}") from None
    host, _, port = args.grpc.rpartition(":")
    if not _tcp_port_free(host, int(port)):
        raise UserError(f"--grpc {args.grpc} is in use (another BMv2?): pick another address")
    if not _tcp_port_free("0.0.0.0", args.thrift_port):
        raise UserError(f"--thrift-port {args.thrift_port} is in use (another BMv2?): pick another port")
    if os.geteuid() != 0:
        raise UserError(f"{BINARY} opens raw interfaces: run as root")
    return ports, p4info, bmv2_json


def run(args) -> int:
    ports, p4info, bmv2_json = _check(args)
    argv = command(ports, args.grpc, args.thrift_port, cpu_port=args.cpu_port, log_file=args.log_file,
                   log_level=args.log_level)
    stop_now = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop_now.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    # BMv2's console goes to our stderr: stdout carries only our JSON lines
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
                            start_new_session=True)  # a Ctrl-C reaches us, and we stop it in order
    try:
        try:
            written = program(proc, args.grpc, Path(args.runtime) if args.runtime else None, p4info, bmv2_json,
                              args.timeout, stop_now.is_set)
        except Bmv2Error as e:
            print(f"luwu bmv2: {e}", file=sys.stderr)
            return EXIT_FAILED
        print(json.dumps({"ready": True, "pid": proc.pid, "p4runtime": args.grpc, "device_id": BMV2_DEVICE_ID,
                          "thrift_port": args.thrift_port, "ports": {str(p): i for p, i in sorted(ports.items())},
                          "pipeline": str(bmv2_json), "p4info": str(p4info),
                          "runtime": str(args.runtime) if args.runtime else None, "entities": written}), flush=True)
        while not stop_now.is_set():
            if proc.poll() is not None:
                print(f"luwu bmv2: {BINARY} exited ({proc.returncode})", file=sys.stderr)
                return EXIT_FAILED
            stop_now.wait(0.5)
        return 0
    finally:
        stop(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("luwu bmv2 stopped", flush=True)
