"""Conformance vectors of heartbeats, PARAM, PULL, the upstream (ToR) paths, validation drops,
L3 forwarding and the drop simulator (docs/protocol.md 2, 3, 6.1, 6.4-6.6)."""

from __future__ import annotations

from conformance_frames import arp_request, frame_in, lanes_bytes, luwu_layer, plain_udp, routed
from conformance_topology import DATA, LANES, NODE_HOST, NODE_S, OUTSIDER, PARENT, TOR, WORKERS
from conformance_vectors import Script, Vector, agg, to_group, to_up
from scapy.packet import Raw

from luwu.dataplane.integrity import trailer
from luwu.dataplane.p4runtime.entries import drop_rate_entry
from luwu.dataplane.protocol import NODE, VERSION, DropReason, Dtype, Event, MsgType

W0, W1, W2, W3 = WORKERS
ALWAYS = 0xFFFFFFFF  # drop threshold: every packet but one in 2^32
NEVER = 0


def hb(s, src, seq: int, ack: int, credit: int, worker: int | None = None, flags: int = 0):
    return luwu_layer(MsgType.HEARTBEAT, s.id, src.rank if worker is None else worker, seq=seq, ack=ack,
                      credit=credit, flags=flags)


def heartbeat_rounds() -> Vector:
    """Two rounds at a root: ack and credit are the minimum over the round; a full round resets."""
    s = Script()
    rounds = [
        [(W0, 100, 400), (W1, 90, 420), (W2, 120, 380), (W3, 95, 500)],
        [(W2, 200, 600), (W0, 210, 610), (W0, 230, 640), (W3, 205, 590), (W1, 220, 700)],
    ]
    for n, beats in enumerate(rounds):
        for k, (h, ack, credit) in enumerate(beats):
            layer = hb(NODE_S, h, 10 * n + k, ack, credit)
            if k < len(beats) - 1:
                s.send(h, layer, note="absorbed into the round")
            else:
                acks = min(a for _, a, _ in beats)
                credits = min(c for _, _, c in beats)
                out = hb(NODE_S, h, 10 * n + k, acks, credits, worker=NODE)
                s.send(h, layer, out=to_up(NODE_S, h, out), note=f"round {n} full: min ack {acks}, credit {credits}")
    return Vector("heartbeat_rounds", "6.4", ("hb_round", "hb_absorbed", "hb_reset"), s.steps,
                  events={Event.HB_ABSORBED: 7, Event.HB_ROUND: 2, Event.UNICAST: 2})


def heartbeat_wraparound() -> Vector:
    """Serial-number minimum across the 2^32 wrap (an unsigned minimum would pick 5 and 7)."""
    s = Script()
    beats = [(W0, 0xFFFFFFF0, 0x100), (W1, 0x10, 0xFFFFFF00), (W2, 0xFFFFFFFE, 0x50), (W3, 5, 7)]
    for k, (h, ack, credit) in enumerate(beats[:3]):
        s.send(h, hb(NODE_S, h, k, ack, credit))
    out = hb(NODE_S, W3, 3, 0xFFFFFFF0, 0xFFFFFF00, worker=NODE)
    s.send(W3, hb(NODE_S, W3, 3, 5, 7), out=to_up(NODE_S, W3, out))
    return Vector("heartbeat_wraparound", "1, 6.4", ("hb_serial_wrap",), s.steps,
                  events={Event.HB_ABSORBED: 3, Event.HB_ROUND: 1, Event.UNICAST: 1})


def heartbeat_node_multicast() -> Vector:
    s = Script()
    layer = hb(NODE_S, NODE_HOST, 44, 1000, 1255, worker=NODE)
    s.send(NODE_HOST, layer, out=to_group(NODE_S, NODE_HOST, layer), note="the node's heartbeat, to every worker")
    return Vector("heartbeat_node_multicast", "6.4", ("hb_node_multicast",), s.steps, events={Event.MULTICAST: 1})


def heartbeat_upstream() -> Vector:
    """A ToR sends its round upstream as its up_worker; the parent's heartbeat is multicast down."""
    s = Script()
    s.send(W0, hb(TOR, W0, 1, 10, 20))
    s.send(W1, hb(TOR, W1, 2, 12, 18), out=to_up(TOR, W1, hb(TOR, W1, 2, 10, 18, worker=TOR.up_worker)))
    down = hb(TOR, PARENT, 9, 33, 64, worker=NODE)
    s.send(PARENT, down, out=to_group(TOR, PARENT, down), note="from the parent: multicast")
    return Vector("heartbeat_upstream", "6.4, 6.5", ("hb_upstream", "hb_from_parent"), s.steps,
                  events={Event.HB_ABSORBED: 1, Event.HB_ROUND: 1, Event.UNICAST: 1, Event.MULTICAST: 1})


def t(body: bytes) -> bytes:
    """A PARAM or PULL payload with its trailer (docs/protocol.md 3.7)."""
    return body + trailer(body)


def param_multicast() -> Vector:
    """PARAM from the node: one copy per worker, each rewritten for its replica (FP32 and BF16)."""
    s = Script()
    fp32 = luwu_layer(MsgType.PARAM, NODE_S.id, NODE, count=10, seq=3, slot=77, tensor=5, offset=640,
                      dtype=int(Dtype.FP32), numel=4096)
    body = t(bytes(range(40)))
    s.send(NODE_HOST, fp32, body, out=to_group(NODE_S, NODE_HOST, fp32, body))
    bf16 = luwu_layer(MsgType.PARAM, NODE_S.id, NODE, count=7, seq=4, slot=78, tensor=6, dtype=int(Dtype.BF16),
                      numel=7)
    body2 = t(bytes(range(100, 114)))
    s.send(NODE_HOST, bf16, body2, out=to_group(NODE_S, NODE_HOST, bf16, body2))
    return Vector("param_multicast", "3.3, 6.5", ("param_multicast", "replica_rewrite"), s.steps,
                  events={Event.MULTICAST: 2})


def pull_unicast() -> Vector:
    s = Script()
    layer = luwu_layer(MsgType.PULL, NODE_S.id, W2.rank, count=2, seq=8)
    body = t(bytes(range(24)))  # two 12-byte requests
    s.send(W2, layer, body, out=to_up(NODE_S, W2, layer, body), note="PULL to the node, sender's rank kept")
    return Vector("pull_unicast", "6.5, 7.3", ("pull",), s.steps, events={Event.UNICAST: 1})


def tor_paths() -> Vector:
    """At a ToR: PULL goes to the parent as up_worker; RESULT and PARAM from the parent are multicast."""
    s = Script()
    pull = luwu_layer(MsgType.PULL, TOR.id, W1.rank, count=1, seq=2)
    body = t(bytes(12))
    s.send(W1, pull, body, out=to_up(TOR, W1, luwu_layer(MsgType.PULL, TOR.id, TOR.up_worker, count=1, seq=2), body))
    res = agg(MsgType.RESULT, TOR, PARENT, 17, list(range(LANES)))
    res.layer.worker = NODE
    s.send(PARENT, res.layer, res.payload, out=to_group(TOR, PARENT, res.layer, res.payload))
    param = luwu_layer(MsgType.PARAM, TOR.id, NODE, count=4, seq=1, slot=3, dtype=int(Dtype.FP16), numel=4)
    s.send(PARENT, param, t(bytes(8)), out=to_group(TOR, PARENT, param, t(bytes(8))))
    return Vector("tor_paths", "6.1, 6.5", ("pull_upstream", "result_from_parent", "param_from_parent"), s.steps,
                  events={Event.UNICAST: 1, Event.MULTICAST: 2})


def bad_direction() -> Vector:
    """Types that do not flow this way from this sender: BAD_DIRECTION (after the session and worker checks)."""
    s = Script()
    s.send(W1, luwu_layer(MsgType.PARAM, NODE_S.id, W1.rank, count=1, dtype=int(Dtype.FP32)), t(bytes(4)),
           note="PARAM from a worker")
    a = agg(MsgType.AGG, NODE_S, W0, 1, [1])
    s.send(W0, a.layer, a.payload, note="AGG at a switch")
    r = agg(MsgType.RESULT, NODE_S, NODE_HOST, 1, [1])
    s.send(NODE_HOST, r.layer, r.payload, note="RESULT at a root")
    r2 = agg(MsgType.RESULT, TOR, W0, 1, [1])
    s.send(W0, r2.layer, r2.payload, note="RESULT from a worker at a ToR")
    for mtype in (MsgType.GRAD, MsgType.ALLREDUCE):
        g = agg(mtype, NODE_S, NODE_HOST, 2, [1])  # from the node's own port: not SPOOFED
        s.send(NODE_HOST, g.layer, g.payload, note=f"{mtype.name} claiming to be the node")
    s.send(NODE_HOST, luwu_layer(MsgType.PULL, NODE_S.id, NODE, count=1), t(bytes(12)), note="PULL from the node")
    return Vector("bad_direction", "6.5", ("bad_direction",), s.steps, drops={DropReason.BAD_DIRECTION: 7})


def unknown_session_worker() -> Vector:
    s = Script()
    g = agg(MsgType.GRAD, NODE_S, W0, 1, [1])
    g.layer.session = 77
    s.send(W0, g.layer, g.payload, note="no sessions entry")
    a = agg(MsgType.ALLREDUCE, DATA, OUTSIDER, 1, [1])
    s.send(OUTSIDER, a.layer, a.payload, note="rank 9 has no workers entry")
    return Vector("unknown_session_worker", "6.1, 6.6", ("unknown_session", "unknown_worker"), s.steps,
                  drops={DropReason.UNKNOWN_SESSION: 1, DropReason.UNKNOWN_WORKER: 1},
                  session_packets={DATA.id: 1})


def malformed() -> Vector:
    """Lengths that are not the type's, count > lanes, a header cut short."""
    s = Script()
    short = agg(MsgType.ALLREDUCE, DATA, W0, 1, [1])
    s.send(W0, short.layer, lanes_bytes([1] * LANES)[:-4], note=f"{LANES - 1} lanes: truncated")
    s.send(W0, short.layer, lanes_bytes([1] * (LANES + 1)), note=f"{LANES + 1} lanes: oversized")
    big = agg(MsgType.ALLREDUCE, DATA, W0, 1, [1], count=LANES + 1)
    s.send(W0, big.layer, big.payload, note="count > lanes")
    s.send(W0, None, frame=frame_in(W0, Raw(bytes(short.layer)[:20])), note="20-byte header")
    s.send(NODE_HOST, luwu_layer(MsgType.PARAM, NODE_S.id, NODE, count=10, dtype=int(Dtype.FP32)), bytes(36),
           note="PARAM of 10 fp32 with 36 bytes")
    s.send(NODE_HOST, luwu_layer(MsgType.PARAM, NODE_S.id, NODE, count=1, dtype=9), bytes(4), note="unknown dtype")
    s.send(W0, luwu_layer(MsgType.HEARTBEAT, NODE_S.id, W0.rank), bytes(4), note="HEARTBEAT with 4 extra bytes")
    s.send(W0, luwu_layer(MsgType.PULL, NODE_S.id, W0.rank, count=2), bytes(20), note="PULL of 2 with 20 bytes")
    return Vector("malformed", "3.3, 6.6", ("malformed_truncated", "malformed_oversized", "malformed_count",
                                            "malformed_header", "malformed_param", "malformed_hb", "malformed_pull"),
                  s.steps, drops={DropReason.MALFORMED: 8}, session_packets={})


def bad_version_type() -> Vector:
    s = Script()
    g = agg(MsgType.GRAD, NODE_S, W0, 1, [1])
    g.layer.version = VERSION + 1
    s.send(W0, g.layer, g.payload, note=f"version {VERSION + 1}")
    for t in (0, 9, 15):
        s.send(W0, luwu_layer(t, NODE_S.id, W0.rank), note=f"type {t}")
    return Vector("bad_version_type", "3, 6.6", ("bad_version", "bad_type"), s.steps,
                  drops={DropReason.BAD_VERSION: 1, DropReason.BAD_TYPE: 3}, session_packets={})


def l3() -> Vector:
    """Plain IPv4 is routed by ipv4_lpm (TTL - 1, MACs rewritten); misses, TTL 1 and non-IPv4 drop."""
    s = Script()
    f = plain_udp(W0, W2.ip)
    s.send(W0, None, frame=f, out=[(W2.port, routed(f, W2.mac))], note="routed to w2")
    f2 = plain_udp(W1, NODE_HOST.ip, dport=80, ttl=2)
    s.send(W1, None, frame=f2, out=[(NODE_HOST.port, routed(f2, NODE_HOST.mac))], note="routed to the node, TTL 2")
    s.send(W0, None, frame=plain_udp(W0, "192.168.7.7"), note="no route")
    s.send(W0, None, frame=plain_udp(W0, W3.ip, ttl=1), note="TTL would reach 0")
    s.send(W0, None, frame=arp_request(W0, W1.ip), note="not IPv4")
    return Vector("l3", "2, 6.1", ("l3_forward", "l3_no_route"), s.steps,
                  drops={DropReason.NO_ROUTE: 3}, events={Event.FORWARDED: 2})


def drop_simulator() -> Vector:
    """Thresholds 0 (never) and 2^32 - 1 (always), at ingress and egress."""
    s = Script()
    extra = [drop_rate_entry("ingress", W0.port, threshold=NEVER),
             drop_rate_entry("ingress", W2.port, threshold=ALWAYS),
             drop_rate_entry("egress", W1.port, threshold=ALWAYS),
             drop_rate_entry("egress", NODE_HOST.port, threshold=NEVER)]
    pull = luwu_layer(MsgType.PULL, NODE_S.id, W0.rank, count=1)
    s.send(W0, pull, t(bytes(12)), out=to_up(NODE_S, W0, pull, t(bytes(12))), note="ingress 0 and egress 0: delivered")
    s.send(W2, luwu_layer(MsgType.PULL, NODE_S.id, W2.rank, count=1), t(bytes(12)), note="ingress always: lost")
    s.send(W2, None, frame=plain_udp(W2, W3.ip), note="plain IPv4 is lost on that link too")
    param = luwu_layer(MsgType.PARAM, NODE_S.id, NODE, count=1, dtype=int(Dtype.FP32))
    copies = [c for c in to_group(NODE_S, NODE_HOST, param, t(bytes(4))) if c[0] != W1.port]
    s.send(NODE_HOST, param, t(bytes(4)), out=copies, note="egress always on w1's port: that replica is lost")
    return Vector("drop_simulator", "6.1", ("drop_sim_never", "drop_sim_always_ingress", "drop_sim_always_egress"),
                  s.steps, drops={DropReason.SIMULATED_LOSS: 3}, events={Event.UNICAST: 1, Event.MULTICAST: 1},
                  session_packets={NODE_S.id: 2}, extra=extra)


VECTORS = [heartbeat_rounds, heartbeat_wraparound, heartbeat_node_multicast, heartbeat_upstream, param_multicast,
           pull_unicast, tor_paths, bad_direction, unknown_session_worker, malformed, bad_version_type, l3,
           drop_simulator]
