"""BMv2 under test: compile with p4c, wire ports to veth pairs, run simple_switch_grpc, talk P4Runtime.

Ports 1..N of the switch are veth pairs: the switch end (`lcf<pid>s<N>`) stays in this
namespace for simple_switch_grpc, the host end (`h<N>`) goes into a namespace the harness
creates, where AF_PACKET sockets (created inside it) send and capture frames. IPv6 is off on
every end so the links carry nothing but the test's frames. Everything made is removed on
close, by name. A fresh simple_switch_grpc per vector gives every vector empty registers.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

REQUIRED = ("simple_switch_grpc",)  # the program is the committed p4c build
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
START_TIMEOUT = 20.0  # s for simple_switch_grpc to accept P4Runtime
QUIET = 0.3  # s without frames after which a step's outputs are complete
STEP_LIMIT = 3.0  # s a step may wait for its expected frames in all


def missing_binaries() -> list[str]:
    return [b for b in REQUIRED if shutil.which(b) is None]


def compiled_program() -> tuple[Path, Path]:
    """(bmv2 json, p4info) of p4/luwu_v1model.p4: the committed p4c build (tests/p4 checks that it
    is what p4c makes of the current sources)."""
    from luwu.p4 import P4INFO_TXTPB
    from luwu.p4.compiler import BMV2_JSON

    return BMV2_JSON, P4INFO_TXTPB


def packet_socket() -> socket.socket:
    """An AF_PACKET socket that receives nothing until bound to (ifname, protocol): created with
    ETH_P_ALL it would queue every interface's traffic in the meantime. (Python applies htons to
    the bind tuple's protocol itself.)"""
    return socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


class Ports:
    """veth pairs for switch ports 1..n and one AF_PACKET socket per host end."""

    def __init__(self, n: int):
        self.tag = f"lcf{os.getpid() % 100000}"
        self.ns = f"{self.tag}-hosts"
        self.n = n
        self.socks: dict[int, socket.socket] = {}
        self.made: list[str] = []
        _ip("netns", "add", self.ns)
        try:
            for p in range(1, n + 1):
                sw, host = self.switch_if(p), f"h{p}"
                _ip("link", "add", sw, "type", "veth", "peer", "name", host, "netns", self.ns)
                self.made.append(sw)
                for ifname, ns in ((sw, None), (host, self.ns)):
                    cmd = (["ip", "netns", "exec", ns] if ns else []) + [
                        "sysctl", "-qw", f"net.ipv6.conf.{ifname}.disable_ipv6=1"]
                    subprocess.run(cmd, check=False, capture_output=True, timeout=10)
                _ip("link", "set", sw, "up")
                _ip("link", "set", host, "up", ns=self.ns)
            self._open_sockets()
        except BaseException:
            self.close()
            raise

    def switch_if(self, port: int) -> str:
        return f"{self.tag}s{port}"

    def _open_sockets(self) -> None:
        from pyroute2 import netns

        netns.pushns(self.ns)
        try:
            for p in range(1, self.n + 1):
                s = packet_socket()
                s.bind((f"h{p}", ETH_P_ALL))
                s.setblocking(False)
                self.socks[p] = s
        finally:
            netns.popns()

    def drain(self) -> None:
        for s in self.socks.values():
            while select.select([s], [], [], 0)[0]:
                s.recv(65536)

    def exchange(self, port: int, frame: bytes, expect: int) -> list[tuple[int, bytes]]:
        """Send `frame` into switch port `port`; collect frames out of every port until `expect`
        arrived and QUIET passed, or STEP_LIMIT."""
        self.drain()
        self.socks[port].send(frame)
        got: list[tuple[int, bytes]] = []
        start = last = time.monotonic()
        by_fd = {s.fileno(): (p, s) for p, s in self.socks.items()}
        while True:
            now = time.monotonic()
            if now - start > STEP_LIMIT or (len(got) >= expect and now - last > QUIET):
                return got
            ready, _, _ = select.select(list(self.socks.values()), [], [], QUIET / 3)
            for s in ready:
                p, sock = by_fd[s.fileno()]
                data, addr = sock.recvfrom(65536)
                if addr[2] == PACKET_OUTGOING:
                    continue
                got.append((p, data))
                last = time.monotonic()

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.socks.clear()
        for name in self.made:
            subprocess.run(["ip", "link", "del", name], check=False, capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.ns], check=False, capture_output=True, timeout=10)


class P4RuntimeSession:
    """A finsy P4Runtime session (device id 0, pipeline forced) on its own event-loop thread."""

    def __init__(self, address: str, p4info: Path, blob: Path | None):
        from luwu.dataplane.p4runtime.bmv2 import BMV2_DEVICE_ID, switch_for

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.switch = switch_for(address, p4info, blob, BMV2_DEVICE_ID)
        self.open = False
        try:
            self.call(self.switch.__aenter__(), START_TIMEOUT)
            self.open = True
        except BaseException:
            self.close()
            raise

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def program(self, runtime: dict) -> None:
        from luwu.dataplane.p4runtime.bmv2 import write_runtime
        from luwu.dataplane.p4runtime.entries import RuntimeConfig

        self.call(write_runtime(self.switch, RuntimeConfig.from_dict(runtime)))

    def counters(self) -> dict:
        from luwu.dataplane.p4runtime.bmv2 import read_counters

        return self.call(read_counters(self.switch))

    def close(self) -> None:
        if self.open:
            self.open = False
            try:
                self.call(self.switch.__aexit__(None, None, None), 10)
            except Exception:  # noqa: BLE001 - closing a session whose server may be gone
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Bmv2:
    """simple_switch_grpc on the harness's ports, programmed through a P4RuntimeSession."""

    def __init__(self, ports: Ports, bmv2_json: Path, p4info: Path, log_dir: Path):
        from luwu.dataplane.p4runtime.bmv2 import BMV2_DEVICE_ID

        self.grpc = f"127.0.0.1:{_free_port()}"
        args = ["simple_switch_grpc", "--device-id", str(BMV2_DEVICE_ID), "--thrift-port", str(_free_port()),
                *[a for p in range(1, ports.n + 1) for a in ("-i", f"{p}@{ports.switch_if(p)}")],
                "--no-p4", "--", "--grpc-server-addr", self.grpc]
        self.log = open(log_dir / "simple_switch_grpc.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.session: P4RuntimeSession | None = None
        try:
            self._wait_grpc()
            self.session = P4RuntimeSession(self.grpc, p4info, bmv2_json)
        except BaseException:
            self.close()
            raise

    def _wait_grpc(self) -> None:
        host, port = self.grpc.split(":")
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simple_switch_grpc exited with {self.proc.returncode}; see {self.log.name}")
            with socket.socket() as s:
                if s.connect_ex((host, int(port))) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"simple_switch_grpc did not open {self.grpc} within {START_TIMEOUT} s")

    def program(self, runtime: dict) -> None:
        self.session.program(runtime)

    def counters(self) -> dict:
        return self.session.counters()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
