"""UDP attachment end to end: real sockets on loopback, the switch's event loop in a thread (and
the `luwu switch` daemon in a process): allreduce, GRAD to a node, PARAM back, bound ports,
unbound ports that refuse everything, opt-in peer learning, UNKNOWN_PORT, recovery from simulated
loss by retransmission."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from switch_setup import LANES, NODE_PORT, SLOTS, agg_packet, heartbeat, param, runtime

from luwu.dataplane.protocol import NODE, DropReason, Event, Flag, MsgType, Packet
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

DEADLINE = 20.0  # s, an upper bound for any exchange (never an assertion on speed)


class Endpoint:
    def __init__(self, switch_addr, local=("127.0.0.1", 0)):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(tuple(local))
        self.sock.setblocking(False)
        self.switch = switch_addr

    @property
    def addr(self):
        return self.sock.getsockname()

    def send(self, data: bytes) -> None:
        self.sock.sendto(data, self.switch)

    def recv_all(self) -> list[Packet]:
        out = []
        while True:
            try:
                data, src = self.sock.recvfrom(65536)
            except BlockingIOError:
                return out
            assert src == tuple(self.switch)
            out.append(Packet.unpack(data))

    def close(self):
        self.sock.close()


def wait_for(pred, what: str):
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def star():
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    eps = {p: Endpoint(None) for p in (1, 2, 3, NODE_PORT)}
    for p, ep in eps.items():  # every port bound to its endpoint's address
        ep.switch = sw.attach_udp(p, ("127.0.0.1", 0), peer=ep.addr)
    sw.load_runtime(runtime())
    sw.start()
    yield sw, eps
    sw.stop()
    for e in eps.values():
        e.close()


def test_allreduce_grad_param_and_heartbeats_over_udp(star):
    sw, eps = star
    workers = [eps[1], eps[2], eps[3]]
    node = eps[NODE_PORT]
    rng = np.random.default_rng(0)
    x = rng.integers(-2**31, 2**31, (10, 3, LANES)).astype(np.int32)
    got = {r: {} for r in range(3)}

    def results(upto):
        for r, w in enumerate(workers):
            for p in w.recv_all():
                got[r][p.seq] = p
        return all(len(v) >= upto for v in got.values())
    pool = 4
    for first in range(0, 10, pool):  # the protocol's window: at most pool_size phases in flight
        for seq in range(first, min(first + pool, 10)):
            for r, w in enumerate(workers):
                w.send(agg_packet(1, r, seq, x[seq, r]))
        wait_for(lambda first=first: results(min(first + pool, 10)), f"RESULTs up to seq {first + pool}")
    for r in range(3):
        for seq, p in got[r].items():
            assert p.type == MsgType.RESULT and p.lanes().tolist() == x[seq].sum(axis=0, dtype=np.int32).tolist()
    node.send(heartbeat(2, NODE, 0, 64))
    for r, w in enumerate(workers):
        w.send(agg_packet(2, r, 0, x[0, r], mtype=MsgType.GRAD))
        w.send(heartbeat(2, r, 5 + r, 50 + r))
    agg, hbs = [], []

    def at_node():
        for p in node.recv_all():
            (agg if p.type == MsgType.AGG else hbs).append(p)
        return agg and hbs
    wait_for(at_node, "AGG and the heartbeat round at the node")
    assert agg[0].lanes().tolist() == x[0].sum(axis=0, dtype=np.int32).tolist()
    assert (hbs[0].ack, hbs[0].credit) == (5, 50)
    node.send(param(2, count=4, dtype=1, pull_id=3))
    seen = {r: [] for r in range(3)}

    def params():
        for r, w in enumerate(workers):
            seen[r] += [p for p in w.recv_all() if p.type == MsgType.PARAM]
        return all(seen.values())
    wait_for(params, "PARAM at every worker")
    assert all(v[0].slot == 3 and v[0].count == 4 for v in seen.values())
    c = sw.counters()
    assert c["events"][int(Event.COMPLETED)][0] == 11 and sw.errors == 0
    assert all(c["ports"][p]["rx_packets"] >= 1 for p in (1, 2, 3, NODE_PORT))


def test_unbound_and_misaddressed_packets_are_refused_counted_and_change_no_result():
    """A second socket sends valid packets to a port with no peer and, from the wrong address, to a
    bound port: neither claims a port or touches a slot, both are counted UNKNOWN_PORT, and the real
    contributions complete the exact sum."""
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    w0, w1, w2 = Endpoint(None), Endpoint(None), Endpoint(None)
    w0.switch = sw.attach_udp(1, ("127.0.0.1", 0), peer=w0.addr)
    w1.switch = sw.attach_udp(2, ("127.0.0.1", 0))  # no peer: the tables name none it could take (fake addresses)
    w2.switch = sw.attach_udp(3, ("127.0.0.1", 0), peer=w2.addr)
    sw.load_runtime(runtime())
    sw.start()
    rogue = Endpoint(w0.switch)
    try:
        evil = np.full(LANES, 1000, dtype=np.int32)
        rogue.send(agg_packet(1, 0, 0, evil))  # rank 0's valid packet, from the wrong address
        rogue.switch = w1.switch
        rogue.send(agg_packet(1, 1, 0, evil))  # rank 1's valid packet, on the unbound port
        rogue.send(heartbeat(2, 1, 1, 2))
        wait_for(lambda: sw.counters()["drops"][int(DropReason.UNKNOWN_PORT)][0] == 3, "three UNKNOWN_PORT drops")
        assert sw.ports[2].peer is None  # nobody claimed it
        w1.send(agg_packet(1, 1, 0, np.ones(LANES, np.int32)))  # the rightful rank 1, also refused
        wait_for(lambda: sw.counters()["drops"][int(DropReason.UNKNOWN_PORT)][0] == 4, "the fourth drop")
        sw.set_peer(2, w1.addr)  # the plan binds the port
        a, b = np.arange(LANES, dtype=np.int32), np.full(LANES, 7, dtype=np.int32)
        for r, (w, v) in enumerate(((w0, a), (w1, b), (w2, a))):
            w.send(agg_packet(1, r, 0, v))
        got = []
        wait_for(lambda: got.extend(w0.recv_all()) or got, "rank 0's RESULT")
        assert got[0].type == MsgType.RESULT and got[0].lanes().tolist() == (a + b + a).tolist()
        assert rogue.recv_all() == []
        c = sw.counters()
        assert c["events"][int(Event.COMPLETED)][0] == 1 and c["drops"][int(DropReason.UNKNOWN_PORT)][0] == 4
    finally:
        sw.stop()
        for e in (w0, w1, w2, rogue):
            e.close()


def test_a_port_takes_its_peer_from_the_endpoints_table():
    """Without peer=, a port accepts the address the tables give its endpoint (the controller's JoinJob
    writes it), and refuses everyone while they name none."""
    from switch_setup import endpoint

    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    ep = Endpoint(None)
    ep.switch = sw.attach_udp(1, ("127.0.0.1", 0))
    sw.load_runtime({"table_entries": [e for e in runtime()["table_entries"] if e["table"] != "endpoints"]})
    sw.start()
    try:
        ep.send(heartbeat(2, 0, 1, 2))
        wait_for(lambda: sw.counters()["drops"][int(DropReason.UNKNOWN_PORT)][0] == 1, "refused while unnamed")
        for session in (1, 2):
            e = endpoint(session, 0)
            sw.tables.insert("endpoints", e["match"], "set_endpoint",
                             dict(e["action_params"], dst_ip="127.0.0.1", dst_udp=ep.addr[1]))
        ep.send(heartbeat(2, 0, 1, 2))
        wait_for(lambda: sw.ports[1].peer == ep.addr, "the port bound to the table's address")
        wait_for(lambda: sw.counters()["events"][int(Event.HB_ABSORBED)][0] == 1, "the heartbeat absorbed")
    finally:
        sw.stop()
        ep.close()


def test_opt_in_peer_learning_and_unknown_port():
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    addr = sw.attach_udp(1, ("127.0.0.1", 0), peer="learn")
    node_addr = sw.attach_udp(NODE_PORT, ("127.0.0.1", 0), peer="learn")
    sw.load_runtime(runtime())
    sw.start()
    a, b, node = Endpoint(addr), Endpoint(addr), Endpoint(node_addr)
    try:
        b.send(b"\x13" * 20)  # malformed: does not teach the port
        wait_for(lambda: sw.counters()["drops"][int(DropReason.MALFORMED)][0] == 1, "the malformed packet")
        b.send(heartbeat(2, NODE, 1, 2))  # the node's id on rank 0's port: SPOOFED, does not teach it
        wait_for(lambda: sw.counters()["drops"][int(DropReason.SPOOFED)][0] == 1, "the spoofed packet")
        assert sw.ports[1].peer is None
        a.send(heartbeat(2, 0, 1, 2))  # valid (rank 0's heartbeat on rank 0's port): the port learns a
        wait_for(lambda: sw.ports[1].peer is not None, "peer learning")
        assert sw.ports[1].peer == a.addr
        b.send(heartbeat(2, 0, 1, 2))
        wait_for(lambda: sw.counters()["drops"][int(DropReason.UNKNOWN_PORT)][0] == 1, "UNKNOWN_PORT")
        node.send(heartbeat(2, NODE, 7, 8))  # multicast includes port 1: the copy goes to a
        wait_for(lambda: any(p.ack == 7 for p in a.recv_all()), "the multicast copy at the learned peer")
        assert b.recv_all() == []
    finally:
        sw.stop()
        a.close()
        b.close()
        node.close()


def test_simulated_loss_is_recovered_by_retransmission(star):
    sw, eps = star
    for p in (1, 2, 3):
        sw.set_drop_sim(p, ingress=0.2, egress=0.2)
    workers = [eps[1], eps[2], eps[3]]
    x = np.arange(3 * LANES, dtype=np.int32).reshape(3, LANES)
    seqs = range(4)
    got = {r: {} for r in range(3)}
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline and not all(len(g) == len(seqs) for g in got.values()):
        for r, w in enumerate(workers):  # go back: resend whatever has no result yet
            for seq in seqs:
                if seq not in got[r]:
                    w.send(agg_packet(1, r, seq, x[r], flags=Flag.RETX))
        time.sleep(0.02)
        for r, w in enumerate(workers):
            for p in w.recv_all():
                got[r][p.seq] = p.lanes().tolist()
    assert all(len(g) == len(seqs) for g in got.values()), "loss was not recovered"
    assert all(v == x.sum(axis=0).tolist() for g in got.values() for v in g.values())
    c = sw.counters()
    assert c["drops"][int(DropReason.SIMULATED_LOSS)][0] > 0
    assert c["events"][int(Event.RESENT)][0] + c["drops"][int(DropReason.DUPLICATE)][0] > 0


def test_loopback_star_plan_drives_the_switch():
    """The embedded launcher (dataplane/loopback/) builds this switch in a child process."""
    from luwu.dataplane.loopback import LoopbackSwitch, StarPlan

    plan = StarPlan(workers=2, nodes=1, mode="tofino", slots=1024, transport="udp")
    with LoopbackSwitch(plan, process=True, drop={"ingress": 0.0}) as ls:
        w = Endpoint(plan.switch_ports[plan.worker_port(0)], plan.endpoints[plan.worker_port(0)])
        rogue = Endpoint(plan.switch_ports[plan.worker_port(0)])  # not the address the plan gave rank 0
        try:
            rogue.send(heartbeat(plan.node_session(0), 0, 1, 2))

            def refused():
                drops = ls.counters()["drops"]
                return (drops.get(int(DropReason.UNKNOWN_PORT)) or drops.get(str(int(DropReason.UNKNOWN_PORT))))[0] == 1
            wait_for(refused, "the rogue's packet refused")
            w.send(heartbeat(plan.node_session(0), 0, 1, 2))
            def absorbed():  # the child process reports counters as JSON (string keys)
                events = ls.counters()["events"]
                return (events.get(int(Event.HB_ABSORBED)) or events.get(str(int(Event.HB_ABSORBED))))[0] == 1
            wait_for(absorbed, "the heartbeat")  # exactly one: the rogue's was not absorbed
        finally:
            w.close()
            rogue.close()


def test_daemon_serves_writes_stats_and_stops_on_sigterm(tmp_path):
    rt = tmp_path / "rt.json"
    rt.write_text(json.dumps(runtime()))
    stats = tmp_path / "stats.json"
    cmd = [sys.executable, "-m", "luwu.cli", "switch", "--lanes", str(LANES), "--slots", str(SLOTS),
           "--runtime", str(rt), "--stats-file", str(stats), "--stats-interval", "0.1",
           "--drop", "all:ingress=0.0", "--drop", "4:egress=0.5"]
    cmd += [a for p in (1, 2, 3, NODE_PORT) for a in ("--port", f"{p}=127.0.0.1:0,peer=learn")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith('{"ready": true'), line + proc.stderr.read()
        ports = json.loads(line)["ports"]
        addr = {int(p): (a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for p, a in ports.items()}
        w = Endpoint(addr[1])
        try:
            w.send(heartbeat(2, 0, 1, 2))
            w.send(b"\x00" * 5)

            def stats_show_it():
                try:
                    doc = json.loads(stats.read_text())
                except (OSError, ValueError):
                    return False
                return doc["counters"]["events"]["HB_ABSORBED"][0] == 1 and doc["counters"]["drops"]["MALFORMED"][0] == 1
            wait_for(stats_show_it, "the stats file to show the packets")
            doc = json.loads(stats.read_text())
            assert doc["ports"]["1"]["peer"] == f"127.0.0.1:{w.addr[1]}" and doc["errors"] == 0
        finally:
            w.close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 0, err
        assert "luwu switch stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args,needle", [
    ([], "no switch ports"),
    (["--port", "1=localhost"], "HOST:PORT"),
    (["--port", "1=127.0.0.1:0,peer=anyone"], "HOST:PORT or learn"),
    (["--port", "600=127.0.0.1:0"], "out of range 0..511"),
    (["--port", "1=127.0.0.1:0", "--drop", "all:loss=0.1"], "unknown key 'loss'"),
    (["--port", "1=127.0.0.1:0", "--lanes", "huge"], "unknown packet mode"),
    (["--port", "1=127.0.0.1:0", "--runtime", "/nonexistent.json"], "cannot read runtime file"),
    (["--port", "1=127.0.0.1:0", "--slots", "3", "--runtime", "RT"], "must lie inside [0, 3)"),
    (["--port", "1=127.0.0.1:0", "--p4runtime", "127.0.0.1:0"], "--p4runtime needs a credential"),
    (["--port", "1=127.0.0.1:0", "--p4runtime", "0.0.0.0:0", "--p4runtime-token-file", "TOKEN"],
     "carry its token in clear text"),
    (["--port", "1=127.0.0.1:0", "--p4runtime", "127.0.0.1:0", "--p4runtime-token-file", "TOKEN",
      "--p4runtime-tls-cert", "/nonexistent.pem"], "needs both --p4runtime-tls-cert and --p4runtime-tls-key"),
])
def test_daemon_refuses_bad_configuration(tmp_path, args, needle):
    if "RT" in args:
        (tmp_path / "rt.json").write_text(json.dumps(runtime()))
        args = [str(tmp_path / "rt.json") if a == "RT" else a for a in args]
    if "TOKEN" in args:
        (tmp_path / "token").write_text("switch-token\n")
        args = [str(tmp_path / "token") if a == "TOKEN" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "luwu.cli", "switch", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2
    assert needle in proc.stderr, proc.stderr


def test_daemon_serves_p4runtime(tmp_path):
    pytest.importorskip("luwu.dataplane.switch.p4runtime_server", reason="the P4Runtime server is not written yet")
    import grpc
    from finsy.proto import p4r, p4r_grpc

    (tmp_path / "token").write_text("switch-token\n")
    proc = subprocess.Popen([sys.executable, "-m", "luwu.cli", "switch", "--port", "1=127.0.0.1:0", "--p4runtime",
                             "127.0.0.1:0", "--p4runtime-token-file", str(tmp_path / "token")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith('{"ready": true'), line
        address = json.loads(line)["p4runtime"]
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        with grpc.secure_channel(address, local) as channel:
            grpc.channel_ready_future(channel).result(timeout=DEADLINE)
            stub = p4r_grpc.P4RuntimeStub(channel)
            for token, code in (("wrong", grpc.StatusCode.UNAUTHENTICATED),
                                ("switch-token", grpc.StatusCode.FAILED_PRECONDITION)):  # no pipeline yet
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetForwardingPipelineConfig(p4r.GetForwardingPipelineConfigRequest(device_id=0),
                                                     metadata=(("authorization", f"Bearer {token}"),), timeout=DEADLINE)
                assert err.value.code() == code
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_mixed_attachments_route_l3_frames_only_to_ethernet_ports(star):
    """A frame routed by ipv4_lpm toward a UDP-attached port is dropped NO_ROUTE, never sent as a
    datagram (handle_turn is the event loop's per-turn entry; fed here as a raw port would)."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from luwu.dataplane.switch.receiver import GroupReceiver

    sw, eps = star
    sw.tables.insert("ipv4_lpm", {"dst_addr": ("10.9.0.0", 16)}, "ipv4_forward", {"port": 1, "dst_mac": 1})
    f = bytes(Ether() / IP(dst="10.9.1.1") / UDP(dport=80) / b"x")
    rx = GroupReceiver(4, 16384, want_addr=False)
    rx.rows[0, :len(f)] = np.frombuffer(f, dtype=np.uint8)
    rx.length[0], rx.port[0], rx.filled = len(f), 5, 1

    class FakeRaw:  # only what handle_turn reads of an attachment
        kind, framed, port, peer = "raw", True, 5, "test"
    with sw.lock:
        sw.handle_turn(rx, [(FakeRaw(), 0, 1)])
    assert sw.counters()["drops"][int(DropReason.NO_ROUTE)] == (1, len(f))
    assert sw.errors == 0 and eps[1].recv_all() == []


def test_datagrams_wider_than_a_row_arrive_whole_or_flagged_truncated():
    """Compact receive rows (one aggregation packet wide) with a spill row per datagram: what the
    pipeline sees of every datagram is exactly what was sent, up to max_len (then MSG_TRUNC)."""
    from luwu.dataplane.switch.receiver import GroupReceiver

    row, max_len = 100, 3000
    rx = GroupReceiver(8, max_len, want_addr=True, row_len=row)
    assert rx.rows.shape[1] < max_len  # rows really are compact
    dst = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    src = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        dst.bind(("127.0.0.1", 0))
        rng = np.random.default_rng(1)
        sizes = [10, rx.rows.shape[1], rx.rows.shape[1] + 1, 2000, max_len, max_len + 500]
        sent = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        for d in sent:
            src.sendto(d, dst.getsockname())
        got = 0
        deadline = time.monotonic() + DEADLINE
        while got < len(sent) and time.monotonic() < deadline:
            got += rx.drain(dst.fileno(), 1, 4, len(sent) - got)  # two recvmmsg calls: spills in both
        assert got == len(sent)
        rows = rx.turn_rows(got)
        for i, d in enumerate(sent):
            keep = min(len(d), max_len)
            assert rx.length[i] == keep and bool(rx.truncated[i]) == (len(d) > max_len)
            assert rows[i, :keep].tobytes() == d[:keep]
        rx.reset()  # a turn without wide datagrams sees the compact rows themselves
        src.sendto(sent[0], dst.getsockname())
        deadline = time.monotonic() + DEADLINE
        while not rx.drain(dst.fileno(), 1, 4, 4) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert rx.turn_rows(1).base is rx.rows and rx.turn_rows(1)[0, :10].tobytes() == sent[0]
    finally:
        dst.close()
        src.close()


def test_a_param_longer_than_an_aggregation_packet_is_multicast_intact(star):
    """PARAM length is count x itemsize, not bounded by the lanes: it spills past the compact
    receive row and must still leave byte for byte."""
    sw, eps = star
    data = param(2, count=60, dtype=1, pull_id=1)  # 272 bytes: rows here are 64 (8 lanes)
    assert len(data) > 4 * LANES + 32
    eps[NODE_PORT].send(data)
    seen: dict[int, list] = {r: [] for r in (1, 2, 3)}

    def arrived():
        for r in seen:
            seen[r] += [p for p in eps[r].recv_all() if p.type == MsgType.PARAM]
        return all(seen.values())
    wait_for(arrived, "the long PARAM at every worker")
    want = Packet.unpack(data)
    for got in seen.values():
        assert len(got) == 1 and got[0].count == 60 and got[0].payload == want.payload
    assert sw.errors == 0
