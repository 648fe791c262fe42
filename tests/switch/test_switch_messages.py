"""Heartbeat rounds, node heartbeats, PARAM/PULL forwarding, session isolation, Ethernet frames
(per-replica endpoints rewrite, L3 forwarding) -- docs/protocol.md 6.4, 6.5 and section 2."""

from __future__ import annotations

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether
from switch_setup import (
    LANES,
    NODE_PORT,
    PARENT_PORT,
    SLOTS,
    UP_WORKER,
    agg_packet,
    heartbeat,
    lanes_of,
    param,
    pull,
    runtime,
    worker_port,
)

from luwu.dataplane.protocol import NODE, DropReason, Event, MsgType, Packet
from luwu.dataplane.scapy_layer import Luwu
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

WRAP = 0xFFFFFFF0


@pytest.fixture
def sw():
    s = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    s.load_runtime(runtime())
    return s


def count(sw, kind, code):
    return sw.counters()[kind][int(code)][0]


# --- heartbeats ----------------------------------------------------------------------------------

def test_heartbeat_round_takes_serial_min_across_wraparound(sw):
    assert sw.process_datagrams([(1, heartbeat(2, 0, WRAP + 30, WRAP + 40))]) == []  # wraps to 0x0e / 0x18
    assert sw.process_datagrams([(2, heartbeat(2, 1, WRAP + 5, WRAP + 50))]) == []
    out = sw.process_datagrams([(3, heartbeat(2, 2, WRAP + 20, WRAP + 12, seq=77))])
    assert [p for p, _ in out] == [NODE_PORT]
    hb = Packet.unpack(out[0][1])
    assert hb.type == MsgType.HEARTBEAT and hb.worker == NODE and hb.seq == 77
    assert hb.ack == WRAP + 5 and hb.credit == WRAP + 12  # serial minimum, not numeric
    # a new round starts from nothing
    sw.process_datagrams([(1, heartbeat(2, 0, 100, 200)), (2, heartbeat(2, 1, 90, 300))])
    out = sw.process_datagrams([(3, heartbeat(2, 2, 95, 250))])
    assert (Packet.unpack(out[0][1]).ack, Packet.unpack(out[0][1]).credit) == (90, 200)
    assert count(sw, "events", Event.HB_ROUND) == 2 and count(sw, "events", Event.HB_ABSORBED) == 4


def test_heartbeat_repeated_worker_and_epoch_change(sw):
    sw.process_datagrams([(1, heartbeat(2, 0, 50, 60)), (1, heartbeat(2, 0, 40, 70))])  # twice in one round
    params = sw.tables.lookup("sessions", {"session": 2})["params"]
    sw.tables.insert("sessions", {"session": 2}, "set_session", {**params, "epoch": 99}, modify=True)
    sw.process_datagrams([(2, heartbeat(2, 1, 10, 20)), (1, heartbeat(2, 0, 30, 35))])
    out = sw.process_datagrams([(3, heartbeat(2, 2, 15, 25))])
    hb = Packet.unpack(out[0][1])
    assert (hb.ack, hb.credit) == (10, 20)  # the old epoch's 40/60 are gone


def test_heartbeat_at_upstream_switch_goes_to_parent_and_parent_heartbeat_is_multicast(sw):
    sw.process_datagrams([(1, heartbeat(3, 0, 8, 9))])
    out = sw.process_datagrams([(2, heartbeat(3, 1, 7, 10))])
    assert [p for p, _ in out] == [PARENT_PORT]
    assert Packet.unpack(out[0][1]).worker == UP_WORKER
    down = heartbeat(3, NODE, 5, 6)
    out = sw.process_datagrams([(PARENT_PORT, down)])
    assert out == [(worker_port(0), down), (worker_port(1), down)]


def test_node_heartbeat_is_multicast_unchanged(sw):
    hb = heartbeat(2, NODE, 1234, 5678)
    out = sw.process_datagrams([(NODE_PORT, hb)])
    assert out == [(worker_port(r), hb) for r in range(3)]
    assert count(sw, "events", Event.MULTICAST) == 1


# --- PARAM and PULL ------------------------------------------------------------------------------

def test_param_from_node_multicast_and_from_worker_refused(sw):
    for dtype, n in ((1, 5), (2, 3), (3, 0)):
        data = param(2, count=n, dtype=dtype, pull_id=42)
        out = sw.process_datagrams([(NODE_PORT, data)])
        assert out == [(worker_port(r), data) for r in range(3)]
    assert sw.process_datagrams([(1, param(2, worker=0))]) == []
    assert count(sw, "drops", DropReason.BAD_DIRECTION) == 1
    bad = param(2, count=3, dtype=1)[:-1]  # one byte short of count * itemsize
    assert sw.process_datagrams([(NODE_PORT, bad)]) == []
    assert count(sw, "drops", DropReason.MALFORMED) == 1


def test_pull_unicast_to_node_and_to_parent(sw):
    data = pull(2, 1, [(7, 8, 9), (10, 11, 12)])
    assert sw.process_datagrams([(2, data)]) == [(NODE_PORT, data)]  # root: unchanged
    out = sw.process_datagrams([(1, pull(3, 0))])
    assert [p for p, _ in out] == [PARENT_PORT] and Packet.unpack(out[0][1]).worker == UP_WORKER
    assert sw.process_datagrams([(NODE_PORT, pull(2, NODE))]) == []
    assert count(sw, "drops", DropReason.BAD_DIRECTION) == 1


# --- isolation -----------------------------------------------------------------------------------

def test_two_sessions_never_touch_each_others_state(sw):
    rng = np.random.default_rng(5)
    x1 = rng.integers(-1000, 1000, (3, LANES))
    x2 = rng.integers(-1000, 1000, (3, LANES))
    items = []
    for r in range(3):  # interleaved, same seq numbers
        items.append((r + 1, agg_packet(1, r, 2, x1[r])))
        items.append((r + 1, agg_packet(2, r, 2, x2[r], mtype=MsgType.GRAD)))
        items.append((r + 1, heartbeat(1, r, 10 + r, 20 + r)))
    out = sw.process_datagrams(items)
    by_type = {Packet.unpack(d).type: d for _, d in out}
    assert lanes_of(by_type[MsgType.RESULT]) == x1.sum(axis=0).tolist()
    assert lanes_of(by_type[MsgType.AGG]) == x2.sum(axis=0).tolist()
    regs = sw.registers
    touched = np.flatnonzero(regs.slot_owner)
    assert touched.tolist() == [2, 6]  # session 1 slot 2, session 2 slot 4 + 2, both in set 0
    assert regs.slot_owner[2] == 11 and regs.slot_owner[6] == 22
    assert regs.hb_owner[1] == 11 and regs.hb_owner[2] == 0


# --- Ethernet frames -----------------------------------------------------------------------------

MAC_SW = "02:00:00:00:00:fe"
SERVICE_IP = "10.0.0.254"


def frame(src_rank: int, data: bytes, dport: int = 19541) -> bytes:
    return bytes(Ether(src=f"02:00:00:00:01:{src_rank:02x}", dst=MAC_SW)
                 / IP(src=f"10.0.1.{src_rank}", dst=SERVICE_IP, ttl=64, id=src_rank)
                 / UDP(sport=40000 + src_rank, dport=dport) / data)


def test_frames_per_replica_rewrite(sw):
    sw.process_frames([(1, frame(0, agg_packet(1, 0, 0, [1] * LANES))), (2, frame(1, agg_packet(1, 1, 0, [2] * LANES)))])
    out = sw.process_frames([(3, frame(2, agg_packet(1, 2, 0, [3] * LANES)))])
    assert [p for p, _ in out] == [1, 2, 3]
    for rank, (_, f) in enumerate(out):
        e = Ether(f)
        assert e.dst == f"02:00:00:00:01:{rank:02x}"  # endpoints[(1, rank)] of switch_setup.endpoint
        trigger = Ether(frame(2, agg_packet(1, 2, 0, [3] * LANES)))
        # sent from the address the triggering frame went to: the service address (protocol.md 2)
        assert e.src == trigger.dst and e[IP].src == trigger[IP].dst == SERVICE_IP
        assert e[IP].dst == f"10.1.0.{rank}" and e[IP].ttl == 64
        assert e[UDP].dport == 20000 + rank and e[UDP].sport == trigger[UDP].dport
        assert e[UDP].chksum == 0 and e[UDP].len == 8 + 32 + 4 * LANES
        ip = e[IP].copy()
        del ip.chksum
        assert IP(bytes(ip)).chksum == e[IP].chksum
        luwu = Luwu(bytes(e[UDP].payload))  # dport is the endpoint's now, so scapy does not bind it
        assert luwu.type == MsgType.RESULT and luwu.worker == NODE
        assert Packet.unpack(bytes(luwu)).lanes().tolist() == [6] * LANES


def test_frames_endpoint_miss_drops_only_that_copy(sw):
    sw.tables.delete("endpoints", {"session": 1, "dst": 1})
    sw.process_frames([(1, frame(0, agg_packet(1, 0, 0, [1] * LANES))), (2, frame(1, agg_packet(1, 1, 0, [2] * LANES)))])
    out = sw.process_frames([(3, frame(2, agg_packet(1, 2, 0, [3] * LANES)))])
    assert [p for p, _ in out] == [1, 3]
    assert count(sw, "drops", DropReason.NO_ROUTE) == 1


def test_frames_and_datagrams_agree_on_luwu_bytes(sw):
    other = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    other.load_runtime(runtime())
    rng = np.random.default_rng(1)
    items = [(r + 1, agg_packet(s % 5 if s % 5 in (1, 2) else 1, r, s, rng.integers(-9, 9, LANES),
                                mtype=MsgType.GRAD if s % 2 else MsgType.ALLREDUCE))
             for s in range(8) for r in range(3)]
    items += [(NODE_PORT, param(2)), (1, heartbeat(2, 0, 1, 2)), (2, heartbeat(2, 1, 1, 2)), (3, heartbeat(2, 2, 1, 2))]
    dgrams = sw.process_datagrams(items)
    frames = other.process_frames([(p, frame(1, d)) for p, d in items])
    assert [p for p, _ in frames] == [p for p, _ in dgrams]
    assert [bytes(Ether(f)[UDP].payload) for _, f in frames] == [d for _, d in dgrams]
    assert sw.counters()["events"] == {k: (v[0], v[1] - 42 * v[0]) for k, v in other.counters()["events"].items()}


def l3_frame(dst_ip: str, ttl: int = 64) -> bytes:
    return bytes(Ether(src="02:00:00:00:01:01", dst=MAC_SW) / IP(src="10.0.1.1", dst=dst_ip, ttl=ttl)
                 / UDP(sport=5000, dport=80) / b"hello")


def test_l3_forwarding_and_no_route(sw):
    sw.tables.insert("LuwuIngress.forwarder.ipv4_lpm", {"hdr.ipv4.dst_addr": ("10.9.0.0", 16)}, "ipv4_forward",
                     {"port": 6, "dst_mac": "02:00:00:00:09:09"})
    sw.tables.insert("ipv4_lpm", {"dst_addr": "10.9.9.0/24"}, "ipv4_forward", {"port": 7, "dst_mac": 0x020000000707})
    sw.tables.insert("ipv4_lpm", {"dst_addr": ("10.9.8.0", 24)}, "drop", {})
    out = sw.process_frames([(1, l3_frame("10.9.1.1")), (1, l3_frame("10.9.9.9")), (1, l3_frame("10.9.8.1")),
                             (1, l3_frame("10.8.0.1")), (1, l3_frame("10.9.1.1", ttl=1))])
    assert [p for p, _ in out] == [6, 7]  # longest prefix wins
    e = Ether(out[0][1])
    assert e.dst == "02:00:00:00:09:09" and e.src == MAC_SW and e[IP].ttl == 63 and bytes(e[UDP].payload) == b"hello"
    ip = e[IP].copy()
    del ip.chksum
    assert IP(bytes(ip)).chksum == e[IP].chksum
    assert count(sw, "drops", DropReason.NO_ROUTE) == 3 and count(sw, "events", Event.FORWARDED) == 2
    sw.tables.set_default("ipv4_lpm", "ipv4_forward", {"port": 9, "dst_mac": 1})
    assert [p for p, _ in sw.process_frames([(1, l3_frame("192.168.0.1"))])] == [9]


def test_non_ip_and_short_frames_are_dropped(sw):
    arp = bytes(Ether(src="02:00:00:00:01:01", dst="ff:ff:ff:ff:ff:ff") / ARP(pdst=SERVICE_IP))
    assert sw.process_frames([(1, arp), (1, b"\x00" * 10), (1, frame(0, b"\x10" * 20))]) == []
    assert count(sw, "drops", DropReason.NO_ROUTE) == 1 and count(sw, "drops", DropReason.MALFORMED) == 2
