"""The conformance vectors themselves: they cover the spec, and their expected frames are sane
on their own (addressed to the host on the port they leave by, checksums right), whatever a
switch does."""

from __future__ import annotations

from conformance_suite import all_vectors
from conformance_topology import CHILD, NODE_HOST, OUTSIDER, PARENT, UDP_PORT, WORKERS, runtime_for
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from luwu.dataplane.integrity import crc16_arc, header_check
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
    # issues 27 and 29: packet format v2
    "bad_checksum", "bad_checksum_no_state", "hcheck_recomputed", "fixed16_sum", "fixed16_negative", "fixed16_resent",
    "fixed16_max", "fixed16_agg", "check_words_sum", "check_words_corrupt_lane", "check_words_fixed16",
    "param_trailer", "pull_trailer", "malformed_trailer", "malformed_fixed16",
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


def test_every_luwu_header_is_sealed():
    """Every luwu frame in and out carries its header check (bytes 26..27), except the few that
    the vectors corrupt on purpose (BAD_CHECKSUM): those are sent, never expected out."""
    assert crc16_arc(b"123456789") == 0xBB3D  # CRC-16/ARC = P4 HashAlgorithm.crc16 on BMv2
    bad_in = 0
    for v in VECTORS:
        frames = [(True, s.frame) for s in v.steps] + [(False, f) for s in v.steps for _, f in s.out]
        for sent, frame in frames:
            pkt = Ether(frame)
            if UDP not in pkt or pkt[UDP].dport != UDP_PORT or len(bytes(pkt[UDP].payload)) < 32:
                continue
            head = bytes(pkt[UDP].payload)[:32]
            if int.from_bytes(head[26:28], "big") != header_check(head):
                assert sent, f"{v.name}: an expected output without its hcheck"
                bad_in += 1
    assert bad_in == 4  # bad_header_check's four corrupted headers
