/* luwu switch program for the v1model architecture (BMv2 simple_switch_grpc): the reference.
 *
 * One pass per packet through the pipeline of docs/protocol.md section 6, one control per
 * file in include/ (mirrored by dataplane/switch/controls/<same name>.py):
 *   ingress: drop_simulator -> classifier -> zero_lanes -> slot_owner -> worker_bitmap ->
 *            contributor_counter -> exponent_max -> aggregation_lanes  (GRAD/ALLREDUCE)
 *                                 -> heartbeat_table                    (worker HEARTBEAT)
 *            -> next_step_selector;  forwarder for non-luwu traffic
 *   egress:  drop_simulator -> sender (endpoints rewrite, per replica)
 * The luwu header check (hcheck) is verified in LuwuVerifyChecksum (a mismatch: drop
 * BAD_CHECKSUM, first of the classifier's checks) and recomputed in LuwuComputeChecksum.
 * FIXED16 lanes are int32 lanes like every dtype's (two int16 values packed, docs/protocol.md 5.2).
 * The controls set metadata; the counters are counted here, once, at the end of each pass.
 *
 * Build: p4c --target bmv2 --arch v1model --p4runtime-files build/p4info.txtpb -o build luwu_v1model.p4
 * (parameters: include/parameters.p4; lanes: `luwu p4 generate --lanes N`).
 */
#include <core.p4>
#include <v1model.p4>

#include "include/headers.p4"
#include "include/parser.p4"
#include "include/checksum.p4"
#include "include/drop_simulator.p4"
#include "include/classifier.p4"
#include "include/zero_lanes.p4"
#include "include/slot_owner.p4"
#include "include/worker_bitmap.p4"
#include "include/contributor_counter.p4"
#include "include/exponent_max.p4"
#include "include/aggregation_lanes.p4"
#include "include/heartbeat_table.p4"
#include "include/next_step_selector.p4"
#include "include/forwarder.p4"
#include "include/sender.p4"
#include "include/deparser.p4"

control LuwuIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t standard_metadata) {
    /* docs/protocol.md 6.6: indexed by drop reason, event, message type and session id. */
    @id(1) counter(COUNTER_SIZE, CounterType.packets_and_bytes) drops;
    @id(2) counter(COUNTER_SIZE, CounterType.packets_and_bytes) events;
    @id(3) counter(COUNTER_SIZE, CounterType.packets_and_bytes) rx_types;
    @id(4) counter(MAX_SESSIONS, CounterType.packets_and_bytes) session_packets;

    IngressDropSimulator() drop_simulator;
    Classifier() classifier;
    ZeroLanes() zero_lanes;
    SlotOwner() slot_owner;
    WorkerBitmap() worker_bitmap;
    ContributorCounter() contributor_counter;
    ExponentMax() exponent_max;
    AggregationLanes() aggregation_lanes;
    HeartbeatTable() heartbeat_table;
    NextStepSelector() next_step_selector;
    Forwarder() forwarder;

    apply {
        meta.drop_reason = 0;
        meta.event = 0;
        meta.delivery = 0;
        meta.saturated = 0;
        meta.session_known = 0;
        meta.emit = 0;
        meta.multicast = 0;

        /* A luwu packet has its whole 32-byte header; shorter ones are malformed frames. */
        bool known_type = hdr.luwu.msg_type != 0 && hdr.luwu.msg_type <= TYPE_PULL;
        bool luwu = hdr.luwu.isValid()
                    && (bit<32>)hdr.udp.length >= LUWU_UDP_HEADERS_LEN
                    && (hdr.data.isValid() || hdr.hb.isValid() || !known_type);
        if (luwu) {
            rx_types.count((bit<32>)hdr.luwu.msg_type);
        }

        if (hdr.luwu.isValid() && !luwu) {
            meta.drop_reason = DROP_MALFORMED;
        } else if (!luwu && standard_metadata.parser_error != error.NoError) {
            meta.drop_reason = DROP_MALFORMED;
        } else if (!hdr.ipv4.isValid()) {
            meta.drop_reason = DROP_NO_ROUTE;   /* not IPv4: hosts use static ARP */
        } else {
            bit<32> draw;
            random(draw, 32w0, 32w0xFFFFFFFF);
            drop_simulator.apply(meta, standard_metadata.ingress_port, draw);
        }

        if (meta.drop_reason != 0) {
            /* malformed, not routable, or lost on the simulated link */
        } else if (luwu) {
            classifier.apply(hdr, meta, standard_metadata.parser_error == error.NoError,
                             standard_metadata.checksum_error == 0, standard_metadata.ingress_port);
            zero_lanes.apply(hdr, meta);
            if (meta.session_known == 1) {
                session_packets.count((bit<32>)hdr.luwu.session);
            }
            if (meta.op == OP_AGGREGATE) {
                slot_owner.apply(meta);
                worker_bitmap.apply(meta);
                contributor_counter.apply(meta);
                exponent_max.apply(hdr, meta);
                aggregation_lanes.apply(hdr, meta);
            } else if (meta.op == OP_HEARTBEAT) {
                heartbeat_table.apply(hdr, meta);
            }
            next_step_selector.apply(hdr, meta);
        } else {
            forwarder.apply(hdr, meta);
        }

        if (meta.drop_reason != 0) {
            drops.count((bit<32>)meta.drop_reason);
        }
        if (meta.event != 0) {
            events.count((bit<32>)meta.event);
        }
        if (meta.delivery != 0 && meta.drop_reason == 0) {
            events.count((bit<32>)meta.delivery);
        }
        if (meta.saturated == 1) {
            events.count((bit<32>)EVENT_SATURATED);
        }
        /* Absorbed and dropped packets go nowhere (egress_spec 0 would be port 0). */
        if (meta.drop_reason != 0 || (luwu && meta.emit == 0)) {
            mark_to_drop(standard_metadata);
        } else if (meta.multicast == 1) {
            standard_metadata.mcast_grp = meta.mcast_grp;
        } else {
            standard_metadata.egress_spec = meta.out_port;
        }
    }
}

control LuwuEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t standard_metadata) {
    /* Drops of emitted copies: SIMULATED_LOSS on the egress link, NO_ROUTE for a luwu copy
     * whose destination has no `endpoints` entry (the ingress counter is not reachable here). */
    @id(5) counter(COUNTER_SIZE, CounterType.packets_and_bytes) drops;

    EgressDropSimulator() drop_simulator;
    Sender() sender;

    apply {
        meta.drop_reason = 0;
        bit<32> draw;
        random(draw, 32w0, 32w0xFFFFFFFF);
        drop_simulator.apply(meta, standard_metadata.egress_port, draw);
        if (meta.drop_reason != 0) {
            drops.count((bit<32>)meta.drop_reason);
            mark_to_drop(standard_metadata);
        } else if (meta.emit == 1) {
            sender.apply(hdr, meta, standard_metadata.egress_rid);
            if (meta.drop_reason != 0) {
                drops.count((bit<32>)meta.drop_reason);
                mark_to_drop(standard_metadata);
            }
        }
    }
}

V1Switch(LuwuParser(), LuwuVerifyChecksum(), LuwuIngress(), LuwuEgress(), LuwuComputeChecksum(), LuwuDeparser()) main;
