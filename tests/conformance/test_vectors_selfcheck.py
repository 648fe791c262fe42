"""The conformance vectors themselves: they cover the spec, and their expected frames are sane
on their own (addressed to the host on the port they leave by, checksums right), whatever a
switch does."""

from __future__ import annotations

from conformance_suite import all_vectors
from conformance_topology import CHILD, NODE_HOST, OUTSIDER, PARENT, UDP_PORT, WORKERS, runtime_for
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from luwu.dataplane.p4runtime.entries import RuntimeConfig
from luwu.dataplane.protocol import MsgType
from luwu.dataplane.scapy_layer import Luwu

# every behaviour issue 3 asks the suite to cover
REQUIRED = {
    "first", "middle", "last", "shadow_set_reuse", "dup_incomplete", "resent_grad_root", "resent_allreduce_root",
    "resent_upstream", "exponent_max", "saturated_or", "max_op", "epoch_change", "n1", "fallback_outside",
    "fallback_flag", "fallback_passes_through", "fallback_pass_needs_child_port", "foreign_slot", "hb_round", "hb_serial_wrap", "hb_node_multicast", "param_multicast",
    "replica_rewrite", "pull", "upstream_result", "upstream_grad", "hb_upstream", "unknown_session", "unknown_worker",
    "malformed_truncated", "malformed_oversized", "bad_version", "bad_type", "malformed_count", "bad_direction",
    "l3_forward", "l3_no_route", "drop_sim_never", "drop_sim_always_ingress", "drop_sim_always_egress",
    # issue 13: header-only ZERO contributions
    "zero_first", "zero_middle", "zero_last", "zero_resent", "zero_duplicate", "zero_fallback", "zero_float_dropped",
}
HOSTS = {h.port: h for h in [*WORKERS, NODE_HOST, PARENT, OUTSIDER, CHILD]}
VECTORS = all_vectors()


def test_coverage():
    covered = {tag for v in VECTORS for tag in v.covers}
    assert not REQUIRED - covered, f"not covered: {sorted(REQUIRED - covered)}"
    assert len({v.name for v in VECTORS}) == len(VECTORS)
    sent = {Ether(s.frame)[Luwu].type for v in VECTORS for s in v.steps if Luwu in Ether(s.frame)}
    assert {int(t) for t in MsgType} <= sent


def test_expected_frames_are_addressed_to_their_port():
    frames = 0
    for v in VECTORS:
        for n, step in enumerate(v.steps):
            for port, frame in step.out:
                pkt = Ether(frame)
                where = f"{v.name} step {n} port {port}"
                assert pkt[Ether].dst == HOSTS[port].mac, where
                assert pkt[IP].dst == HOSTS[port].ip, where
                again = Ether(frame)
                del again[IP].chksum
                assert bytes(Ether(bytes(again))) == frame, f"{where}: IPv4 checksum"
                if pkt[UDP].dport == UDP_PORT:
                    assert pkt[UDP].chksum == 0, where
                frames += 1
    assert frames > 50


def test_runtime_validates_against_the_committed_p4info():
    for v in VECTORS:
        RuntimeConfig.from_dict(runtime_for(v.extra)).validate()


def test_every_vector_expects_counters():
    for v in VECTORS:
        want = v.expected_counters()
        assert any(want["drops"].values()) or any(want["events"].values()), v.name
