"""Counters (docs/protocol.md 6.6): every drop reason is counted with its packets and bytes, and
nothing else moves; rx_types and session_packets follow what arrived."""

from __future__ import annotations

import socket
import time

import pytest
from switch_setup import LANES, SLOTS, agg_packet, heartbeat, runtime

from luwu.dataplane.integrity import sealed
from luwu.dataplane.protocol import NODE, VERSION, DropReason, Event, MsgType, Packet
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

V = [1] * LANES


def fresh():
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=3))
    sw.load_runtime(runtime())
    return sw


def bad_version() -> bytes:
    b = bytearray(agg_packet(1, 0, 0, V))
    b[0] = ((VERSION + 1) << 4) | MsgType.ALLREDUCE
    return sealed(bytes(b))


def bad_type() -> bytes:
    b = bytearray(agg_packet(1, 0, 0, V))
    b[0] = (VERSION << 4) | 9
    return sealed(bytes(b))


def bad_checksum() -> bytes:
    b = bytearray(agg_packet(1, 0, 0, V))
    b[12] ^= 0x04  # one bit of the sequence number flipped in flight
    return bytes(b)


CASES = {
    DropReason.MALFORMED: [b"\x13" * 10],
    DropReason.BAD_VERSION: [bad_version()],
    DropReason.BAD_TYPE: [bad_type()],
    DropReason.BAD_CHECKSUM: [bad_checksum()],
    DropReason.UNKNOWN_SESSION: [agg_packet(77, 0, 0, V)],
    DropReason.UNKNOWN_WORKER: [agg_packet(1, 9, 0, V)],
    DropReason.FOREIGN_SLOT: [agg_packet(1, 0, 0, V, slot=9)],
    DropReason.DUPLICATE: [agg_packet(1, 0, 0, V), agg_packet(1, 0, 0, V)],
    DropReason.NO_ROUTE: [agg_packet(4, 2, 0, V)],  # N = 1 completes; multicast group 4 has no replicas
    DropReason.BAD_DIRECTION: [agg_packet(1, 0, 0, V, mtype=MsgType.AGG)],
}


@pytest.mark.parametrize("reason", list(CASES), ids=lambda r: r.name)
def test_each_drop_reason_is_counted(reason):
    sw = fresh()
    items = [(1 if reason != DropReason.NO_ROUTE else 3, d) for d in CASES[reason]]
    assert sw.process_datagrams(items) == []
    drops = sw.counters()["drops"]
    victim = items[-1][1]
    assert drops[int(reason)] == (1, len(victim))
    assert all(v == (0, 0) for code, v in drops.items() if code != int(reason))


def test_simulated_loss_is_counted():
    sw = fresh()
    sw.set_drop_sim(1, ingress=1.0)
    sw.set_drop_sim(2, egress=1.0)
    d = agg_packet(1, 0, 0, V)
    assert sw.process_datagrams([(1, d)]) == []  # ingress loss on port 1
    sw.process_datagrams([(2, agg_packet(1, 1, 0, V))])
    out = sw.process_datagrams([(3, agg_packet(1, 2, 0, V))])  # incomplete: worker 0's packet was lost
    assert out == []
    sw.process_datagrams([(4, agg_packet(1, 0, 0, V))])  # worker 0's id from another port: a forgery
    sw.set_drop_sim(1, ingress=0.0)
    sw.process_datagrams([(1, agg_packet(1, 0, 0, V))])  # worker 0 retransmits on its own port
    out = sw.process_datagrams([])
    drops = sw.counters()["drops"]
    assert drops[int(DropReason.SIMULATED_LOSS)] == (2, 2 * len(d))  # ingress on port 1, egress replica to port 2
    assert drops[int(DropReason.SPOOFED)] == (1, len(d))
    assert all(v == (0, 0) for code, v in drops.items() if code not in (DropReason.SIMULATED_LOSS, DropReason.SPOOFED))


def test_unknown_port_is_counted_on_a_udp_attachment():
    sw = fresh()
    good = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bad = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        good.bind(("127.0.0.1", 0))
        bad.bind(("127.0.0.1", 0))
        addr = sw.attach_udp(1, ("127.0.0.1", 0), peer=good.getsockname())
        sw.start()
        d = heartbeat(2, 0, 1, 2)
        bad.sendto(d, addr)
        for _ in range(200):  # bounded wait for the loop to count it
            if sw.counters()["drops"][int(DropReason.UNKNOWN_PORT)][0]:
                break
            time.sleep(0.01)
        assert sw.counters()["drops"][int(DropReason.UNKNOWN_PORT)] == (1, len(d))
        assert sw.counters()["rx_types"][int(MsgType.HEARTBEAT)] == (0, 0)  # never reached the parser
    finally:
        sw.stop()
        good.close()
        bad.close()


def test_rx_types_sessions_and_events_count_packets_and_bytes():
    sw = fresh()
    a = agg_packet(1, 0, 0, V)
    h = heartbeat(2, 0, 5, 6)
    sw.process_datagrams([(1, a), (1, h), (1, b"\x13" * 40), (1, agg_packet(77, 0, 0, V))])
    c = sw.counters()
    assert c["rx_types"][int(MsgType.ALLREDUCE)] == (3, 2 * len(a) + 40)
    assert c["rx_types"][int(MsgType.HEARTBEAT)] == (1, len(h))
    assert c["session_packets"] == {1: (1, len(a)), 2: (1, len(h))}  # unknown/malformed are not counted
    assert c["events"][int(Event.ABSORBED)] == (1, len(a)) and c["events"][int(Event.HB_ABSORBED)] == (1, len(h))
    sw.reset_counters()
    assert sw.counters()["rx_types"][int(MsgType.ALLREDUCE)] == (0, 0)


def test_node_heartbeat_from_unknown_session_is_unknown_session():
    sw = fresh()
    assert sw.process_datagrams([(4, heartbeat(500, NODE, 1, 1))]) == []
    assert sw.counters()["drops"][int(DropReason.UNKNOWN_SESSION)][0] == 1
    assert Packet.unpack(heartbeat(500, NODE, 1, 1)).session == 500
