"""The drop simulator: P4 loss tables with seeded, batch-independent random numbers (statistics
checked against binomial bounds), and the software-only duplication and depth-1 reordering."""

from __future__ import annotations

import math

import pytest
from switch_setup import LANES, NODE_PORT, SLOTS, heartbeat, runtime

from luwu.dataplane.protocol import NODE, DropReason, Packet
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

N = 20000


def make(seed=0):
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=seed))
    sw.load_runtime(runtime())
    return sw


def node_heartbeats(n):
    """Node heartbeats of session 2: multicast to ports 1..3; seq numbers identify them."""
    return [(NODE_PORT, heartbeat(2, NODE, i, i, seq=i)) for i in range(n)]


def within(k: int, n: int, p: float, sigmas: float = 6.0) -> bool:
    return abs(k - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def losses(sw):
    return sw.counters()["drops"][int(DropReason.SIMULATED_LOSS)][0]


@pytest.mark.parametrize("p", [0.01, 0.3, 0.9])
def test_ingress_loss_rate(p):
    sw = make()
    sw.set_drop_sim(NODE_PORT, ingress=p)
    out = sw.process_datagrams(node_heartbeats(N))
    assert within(losses(sw), N, p)
    assert len(out) == 3 * (N - losses(sw))


def test_egress_loss_is_per_copy():
    sw = make()
    sw.set_drop_sim(2, egress=0.25)
    out = sw.process_datagrams(node_heartbeats(N))
    per_port = {p: sum(1 for q, _ in out if q == p) for p in (1, 2, 3)}
    assert per_port[1] == per_port[3] == N
    assert within(N - per_port[2], N, 0.25) and losses(sw) == N - per_port[2]


def test_never_and_always():
    sw = make()
    sw.set_drop_sim(NODE_PORT, ingress=0.0)
    assert len(sw.process_datagrams(node_heartbeats(500))) == 1500
    sw.set_drop_sim(NODE_PORT, ingress=1.0)  # threshold 2^32 - 1
    assert sw.process_datagrams(node_heartbeats(500)) == []


def test_seeded_and_independent_of_batching():
    items = node_heartbeats(3000)
    a, b, c = make(7), make(7), make(8)
    for sw in (a, b, c):
        sw.set_drop_sim(NODE_PORT, ingress=0.2, egress=0.1)
        sw.set_drop_sim(1, egress=0.3)
    out_a = a.process_datagrams(items)
    out_b = []
    for i in range(0, len(items), 37):  # other batch boundaries, same random stream
        out_b += b.process_datagrams(items[i:i + 37])
    out_c = c.process_datagrams(items)
    assert out_a == out_b
    assert out_a != out_c  # another seed, other losses


def test_duplicate_rate_both_directions():
    sw = make()
    sw.set_drop_sim(NODE_PORT, duplicate=0.1)  # the node's link: copies arrive at the switch
    sw.set_drop_sim(2, duplicate=0.1)  # worker 1's link: copies leave toward the worker
    out = sw.process_datagrams(node_heartbeats(N))
    ports = sw.counters()["ports"]
    dup_in, dup_out = ports[NODE_PORT]["sim_rx_duplicated"], ports[2]["sim_tx_duplicated"]
    assert within(dup_in, N, 0.1)
    seqs1 = [Packet.unpack(d).seq for p, d in out if p == 1]
    assert len(seqs1) == N + dup_in  # every copy that entered is multicast once
    assert sorted(set(seqs1)) == list(range(N)) and seqs1 == sorted(seqs1)  # copies follow their original
    seqs2 = [Packet.unpack(d).seq for p, d in out if p == 2]
    assert len(seqs2) == N + dup_in + dup_out and within(dup_out, N + dup_in, 0.1)


def test_reorder_moves_packets_by_at_most_one():
    sw = make(3)
    sw.set_drop_sim(1, reorder=0.2)
    out = sw.process_datagrams(node_heartbeats(N))
    seqs = [Packet.unpack(d).seq for p, d in out if p == 1]
    held = sw.links_out[1].held
    assert len(seqs) == N - (1 if held is not None else 0)
    for i, s in enumerate(seqs):
        assert abs(s - i) <= 1  # depth 1: nothing moves further
    swaps = sum(1 for i in range(len(seqs) - 1) if seqs[i] > seqs[i + 1])
    # a packet is held with probability 0.2 when none is held: swap fraction = 0.2 / 1.2
    assert within(swaps, N, 0.2 / 1.2)
    other = [Packet.unpack(d).seq for p, d in out if p == 2]
    assert other == list(range(N))  # other ports keep their order
