"""`luwu bmv2`, the one-liner that runs BMv2 with the luwu pipeline: it starts simple_switch_grpc on
veth ports in a namespace the test makes, pushes the committed build and a 2-worker star runtime,
sums two workers' ALLREDUCE packets into a RESULT on both ports (INT32, and FIXED16's packed
int32 lanes), and stops on SIGTERM/SIGINT.
Without BMv2 (or root) those skip; the one-line errors for what is missing run everywhere."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from luwu.daemons import bmv2 as bmv2_switch
from luwu.dataplane.protocol import DEFAULT_UDP_PORT, HEADER_LEN, MsgType, Packet
from luwu.p4.runtime_examples import star_hosts, star_runtime

pytestmark = pytest.mark.bmv2
LANES = 64
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
READY_TIMEOUT = 60.0  # s for `luwu bmv2` to print its ready line on a loaded machine
needs_bmv2 = pytest.mark.skipif(
    os.geteuid() != 0 or bmv2_switch.missing() is not None,
    reason=f"needs root and BMv2: {bmv2_switch.missing() or 'not root'}")


def luwu(*args: str, env: dict | None = None, ns: str | None = None, **kw) -> subprocess.Popen:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.Popen([*prefix, sys.executable, "-m", "luwu.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def test_missing_simple_switch_grpc_is_one_line(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # an empty PATH: no simple_switch_grpc
    p = luwu("bmv2", "--port", "1=lo", env=env)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and "simple_switch_grpc" in err and "Traceback" not in err, err


def test_bad_port_and_missing_interface_are_one_line():
    p = luwu("bmv2", "--port", "one=veth1")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "N=IFNAME" in err and "Traceback" not in err, err
    if bmv2_switch.missing() is None:  # with BMv2 present the interface check is what fails
        p = luwu("bmv2", "--port", "1=luwu-no-such-if")
        _, err = p.communicate(timeout=60)
        assert p.returncode == 2 and "no interface luwu-no-such-if" in err, err


def test_missing_build_is_named(tmp_path):
    why = bmv2_switch.missing(bmv2_json=tmp_path / "luwu_v1model.json")
    assert why is not None and "luwu_v1model.json" in why and ("luwu p4 build" in why or "simple_switch_grpc" in why)


def test_command_line_has_device_id_0_and_one_interface_per_port():
    argv = bmv2_switch.command({2: "b", 1: "a"}, "127.0.0.1:50999", 9999, cpu_port=255)
    assert argv[:3] == ["simple_switch_grpc", "--device-id", "0"]
    assert argv[argv.index("-i") + 1] == "1@a" and "2@b" in argv
    assert argv[argv.index("--grpc-server-addr") + 1] == "127.0.0.1:50999" and argv[-2:] == ["--cpu-port", "255"]
    assert argv.index("--no-p4") < argv.index("--")  # BMv2's options before the target's


# -- with BMv2 ------------------------------------------------------------------------------------

class Namespace:
    """A namespace with veth pairs p<N> (BMv2's port N) <-> h<N> (a host's end); removed on close."""

    def __init__(self, ports: int):
        self.name = f"lwb{os.getpid() % 100000}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, timeout=10)
        self.socks: dict[int, socket.socket] = {}
        try:
            for n in range(1, ports + 1):
                self._ip("link", "add", f"p{n}", "type", "veth", "peer", "name", f"h{n}")
                for end in (f"p{n}", f"h{n}"):
                    subprocess.run(["ip", "netns", "exec", self.name, "sysctl", "-qw",
                                    f"net.ipv6.conf.{end}.disable_ipv6=1"], check=False, capture_output=True,
                                   timeout=10)
                    self._ip("link", "set", end, "up")
            self._ip("link", "set", "lo", "up")
            from pyroute2 import netns

            netns.pushns(self.name)
            try:
                for n in range(1, ports + 1):
                    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
                    s.bind((f"h{n}", ETH_P_ALL))
                    self.socks[n] = s
            finally:
                netns.popns()
        except BaseException:
            self.close()
            raise

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", "-n", self.name, *args], check=True, capture_output=True, timeout=10)

    def received(self, want: int, limit: float = 10.0) -> list[tuple[int, bytes]]:
        """Frames arriving at the host ends (not the ones they send) until `want` came or `limit` s."""
        got: list[tuple[int, bytes]] = []
        by_fd = {s.fileno(): n for n, s in self.socks.items()}
        end = time.monotonic() + limit
        while len(got) < want and time.monotonic() < end:
            for s in select.select(list(self.socks.values()), [], [], 0.2)[0]:
                data, addr = s.recvfrom(65536)
                if addr[2] != PACKET_OUTGOING:
                    got.append((by_fd[s.fileno()], data))
        return got

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True, timeout=10)


def allreduce_frame(rank: int, lanes: np.ndarray, dtype: int = 0, count: int = LANES, item: str = ">i4") -> bytes:
    """Rank `rank`'s ALLREDUCE of slot 0 of session 1 (the star's `meta` session), from its own addresses
    (`lanes` written as `item`: ">i4" every dtype's lanes, ">i2" the old FIXED16 int16 lanes)."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    host = star_hosts(2)[0][rank]
    luwu = Packet(type=MsgType.ALLREDUCE, session=1, worker=rank, count=count, seq=0, slot=0, dtype=dtype,
                  payload=lanes.astype(np.int32).astype(item).tobytes()).pack()
    return bytes(Ether(src=host.mac, dst="02:00:00:00:00:fe") / IP(src=host.ip, dst="10.0.0.254")
                 / UDP(sport=DEFAULT_UDP_PORT, dport=DEFAULT_UDP_PORT) / luwu)


@needs_bmv2
@pytest.mark.parametrize("stop_with", [signal.SIGTERM, signal.SIGINT])
def test_luwu_bmv2_starts_sums_and_stops(tmp_path, stop_with):
    runtime = tmp_path / "star2.json"
    cfg = star_runtime(2)
    runtime.write_text(cfg.dumps())
    ns = Namespace(2)
    proc = None
    try:
        proc = luwu("bmv2", "--port", "1=p1", "--port", "2=p2", "--runtime", str(runtime), ns=ns.name,
                    start_new_session=True)
        ready = select.select([proc.stdout], [], [], READY_TIMEOUT)[0] and proc.stdout.readline()
        assert ready, f"no ready line within {READY_TIMEOUT} s (exit {proc.poll()})"
        info = json.loads(ready)
        assert info["ready"] is True and info["device_id"] == 0 and info["ports"] == {"1": "p1", "2": "p2"}
        assert info["entities"] == len(cfg.table_entries) + len(cfg.multicast_group_entries)

        a = np.arange(1, LANES + 1, dtype=np.int64)
        b = np.full(LANES, 2**31 - 1, dtype=np.int64) - 5  # wraps like int32
        ns.socks[1].send(allreduce_frame(0, a))
        ns.socks[2].send(allreduce_frame(1, b))
        got = ns.received(2)
        assert sorted(port for port, _ in got) == [1, 2], got
        want = ((a + b + 2**31) % 2**32 - 2**31).astype(np.int32)
        hosts = star_hosts(2)[0]
        for port, frame in got:
            udp = frame[14 + 20:]
            assert udp[8] & 0xF == MsgType.RESULT, frame[:80].hex()
            assert socket.inet_ntoa(frame[30:34]) == hosts[port - 1].ip  # endpoints rewrite per replica
            sums = np.frombuffer(udp[8 + HEADER_LEN:8 + HEADER_LEN + 4 * LANES], dtype=">i4")
            assert (sums == want).all(), (port, sums[:4], want[:4])

        os.kill(proc.pid, stop_with)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "luwu bmv2 stopped" in out
        listening = subprocess.run(["ip", "netns", "exec", ns.name, "ss", "-ltn"], check=False, capture_output=True,
                                   text=True, timeout=10).stdout
        assert ":50051" not in listening and ":9090" not in listening, listening  # simple_switch_grpc is gone
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        ns.close()


@needs_bmv2
def test_luwu_bmv2_sums_fixed16_as_int32_lanes(tmp_path):
    """FIXED16 (docs/protocol.md 5.2) on the committed BMv2 build: 32 + 4 * LANES bytes with a whole
    block's count (112 int16 values, more than LANES), two int16 values packed a lane, summed as
    int32 lanes whose halves are the int16 sums; a packet of the old int16-lane length (32 + 2 *
    LANES) before them is dropped (else rank 0's real packet would be its duplicate)."""
    runtime = tmp_path / "star2.json"
    runtime.write_text(star_runtime(2).dumps())
    ns = Namespace(2)
    proc = None
    try:
        proc = luwu("bmv2", "--port", "1=p1", "--port", "2=p2", "--runtime", str(runtime), ns=ns.name,
                    start_new_session=True)
        ready = select.select([proc.stdout], [], [], READY_TIMEOUT)[0] and proc.stdout.readline()
        assert ready, f"no ready line within {READY_TIMEOUT} s (exit {proc.poll()})"
        rng = np.random.default_rng(16)
        hi = rng.integers(-2**14, 2**14, (2, LANES))
        lo = rng.integers(-2**14, 2**14, (2, LANES))
        lo[0, :4], lo[1, :4] = [-1, -2**14, 2**14 - 1, 0], [-1, -2**14, 0, -5]  # borrows into hi
        packed = hi * 2**16 + lo
        fixed16, count = 6, 112
        ns.socks[1].send(allreduce_frame(0, packed[0], fixed16, count, item=">i2"))  # the old length
        ns.socks[1].send(allreduce_frame(0, packed[0], fixed16, count))
        ns.socks[2].send(allreduce_frame(1, packed[1], fixed16, count))
        got = ns.received(2)
        assert sorted(port for port, _ in got) == [1, 2], got
        want = (packed.sum(axis=0) + 2**31) % 2**32 - 2**31
        for port, frame in got:
            udp = frame[14 + 20:]
            assert udp[8] & 0xF == MsgType.RESULT and len(udp) == 8 + HEADER_LEN + 4 * LANES, frame[:80].hex()
            sums = np.frombuffer(udp[8 + HEADER_LEN:8 + HEADER_LEN + 4 * LANES], dtype=">i4").astype(np.int64)
            assert sums.tolist() == want.tolist(), (port, sums[:4], want[:4])
            low = (sums & 0xFFFF).astype(np.uint16).astype(np.int16).astype(np.int64)
            assert low.tolist() == lo.sum(axis=0).tolist() and ((sums - low) >> 16).tolist() == hi.sum(axis=0).tolist()
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        ns.close()


@needs_bmv2
def test_runtime_that_does_not_fit_the_p4info_is_refused_before_starting(tmp_path):
    cfg = star_runtime(2).to_dict()
    cfg["table_entries"][0]["table"] = "no_such_table"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cfg))
    p = luwu("bmv2", "--port", "1=lo", "--runtime", str(bad))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "no_such_table" in err and "Traceback" not in err, err
    assert shutil.which("simple_switch_grpc") and "ready" not in out
