/* luwu switch program for TNA (Tofino): the v1model program's pipeline with Tofino externs.
 *
 * Shared with luwu_v1model.p4 (include/): headers, constants, parameters, drop_simulator,
 * classifier, next_step_selector, forwarder, sender -- the same tables, actions and @ids.
 * TNA's own (tna/): parsers/deparsers, and the register controls written as RegisterActions
 * (slot_owner, worker_bitmap, contributor_counter, exponent_max, heartbeat_table, the
 * generated aggregation_lanes with two lanes per register).
 *
 * Two passes for an emitted aggregation result: pass 1 runs the slot state machine and
 * writes the new even lanes into the packet, then sends it to RECIRC_PORT with a harvest
 * header; pass 2 reads the odd lanes of the same cell and delivers the packet as pass 1
 * decided; it also reads the cell's stored flags (SATURATED) from the exponent/flags pair.
 * Absorbed and dropped packets, and every other type, take one pass. The header check (hcheck)
 * is verified in pass 1 with a CRC16 Hash (tna/header_check.p4; BAD_CHECKSUM) and recomputed at
 * the end of ingress on whatever leaves. FIXED16 lanes are int32 lanes like every dtype's (two
 * int16 values packed, docs/protocol.md 5.2): no widening, no header of their own.
 * Counters are counted in pass 1, except SATURATED, known in pass 2. A session's ports and
 * RECIRC_PORT must be in one pipe (registers are per pipe); p4/README.md has the resource budget.
 *
 * Build: bf-p4c --target tofino --arch tna --std p4-16 -o build/tofino luwu_tna.p4
 */
#include <core.p4>
#include <tna.p4>

#define LUWU_TNA
#include "include/headers.p4"

/* Recirculation port of the pipe that holds the registers (Tofino 1 pipe 0: 68). */
#ifndef RECIRC_PORT
#define RECIRC_PORT 68
#endif

#include "tna/parser.p4"
#include "tna/header_check.p4"
#include "include/drop_simulator.p4"
#include "include/classifier.p4"
#include "include/zero_lanes.p4"
#include "tna/slot_owner.p4"
#include "tna/worker_bitmap.p4"
#include "tna/contributor_counter.p4"
#include "tna/exponent_max.p4"
#include "tna/aggregation_lanes.p4"
#include "tna/heartbeat_table.p4"
#include "include/next_step_selector.p4"
#include "include/forwarder.p4"
#include "include/sender.p4"

control LuwuIngress(inout headers_t hdr, inout metadata_t meta,
                    in ingress_intrinsic_metadata_t ig_intr_md,
                    in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                    inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                    inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* docs/protocol.md 6.6. A TNA counter counts once per pass, so the delivery event and the
     * SATURATED event have counters of their own (same codes as `events`). */
    @id(1) Counter<bit<64>, bit<8>>(COUNTER_SIZE, CounterType_t.PACKETS_AND_BYTES) drops;
    @id(2) Counter<bit<64>, bit<8>>(COUNTER_SIZE, CounterType_t.PACKETS_AND_BYTES) events;
    @id(3) Counter<bit<64>, bit<4>>(COUNTER_SIZE, CounterType_t.PACKETS_AND_BYTES) rx_types;
    @id(4) Counter<bit<64>, bit<16>>(MAX_SESSIONS, CounterType_t.PACKETS_AND_BYTES) session_packets;
    @id(6) Counter<bit<64>, bit<8>>(COUNTER_SIZE, CounterType_t.PACKETS_AND_BYTES) delivery_events;
    @id(7) Counter<bit<64>, bit<8>>(COUNTER_SIZE, CounterType_t.PACKETS_AND_BYTES) saturated_events;
    Random<bit<32>>() rng;

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
    HeaderCheckVerify() verify_hcheck;
    HeaderCheckSeal() seal_hcheck;

    apply {
        meta.drop_reason = 0;
        meta.event = 0;
        meta.delivery = 0;
        meta.saturated = 0;
        meta.session_known = 0;
        meta.emit = 0;
        meta.multicast = 0;
        meta.recirculate = 0;
        meta.op = OP_NONE;

        if (hdr.harvest.isValid()) {
            /* pass 2: the odd lanes, then the delivery pass 1 chose */
            aggregation_lanes.apply(hdr, LANE_READ, hdr.harvest.cell, true);
            meta.exponent_in = 0;  /* register-action inputs unused by the reads of pass 2 */
            meta.saturated_in = 0;
            exponent_max.apply(hdr, meta, true, hdr.harvest.cell);
            if (meta.saturated == 1) {
                saturated_events.count(EVENT_SATURATED);
            }
            meta.emit = 1;
            meta.multicast = hdr.harvest.multicast;
            meta.dst = hdr.harvest.dst;
            meta.mcast_grp = hdr.harvest.mcast_grp;
            meta.out_port = hdr.harvest.out_port;
            hdr.harvest.setInvalid();
        } else {
            bool known_type = hdr.luwu.msg_type != 0 && hdr.luwu.msg_type <= TYPE_PULL;
            bool luwu = hdr.luwu.isValid()
                        && (bit<32>)hdr.udp.length >= LUWU_UDP_HEADERS_LEN
                        && (hdr.data.isValid() || hdr.hb.isValid() || !known_type);
            bool parsed = ig_prsr_md.parser_err == 0;
            bool header_ok;
            verify_hcheck.apply(hdr, header_ok);
            if (luwu) {
                rx_types.count(hdr.luwu.msg_type);
            }
            if (hdr.luwu.isValid() && !luwu) {
                meta.drop_reason = DROP_MALFORMED;
            } else if (!luwu && !parsed) {
                meta.drop_reason = DROP_MALFORMED;
            } else if (!hdr.ipv4.isValid()) {
                meta.drop_reason = DROP_NO_ROUTE;
            } else {
                bit<32> draw = rng.get();
                drop_simulator.apply(meta, ig_intr_md.ingress_port, draw);
            }

            if (meta.drop_reason != 0) {
                /* malformed, not routable, or lost on the simulated link */
            } else if (luwu) {
                classifier.apply(hdr, meta, parsed, header_ok, ig_intr_md.ingress_port);
                zero_lanes.apply(hdr, meta);
                if (meta.session_known == 1) {
                    session_packets.count(hdr.luwu.session);
                }
                /* register-action inputs, ready before the stages that use them */
                meta.worker_clear = ~meta.worker_bit;
                meta.first_remaining = (bit<32>)meta.num_workers - 1;
                meta.exponent_in = (int<32>)(int<8>)hdr.data.exponent;
                meta.saturated_in = (bit<32>)(hdr.luwu.flags & FLAG_SATURATED);
                meta.hb_rest = meta.worker_mask & ~meta.worker_bit;
                meta.hb_single = meta.worker_bit == meta.worker_mask ? 1w1 : 1w0;
                if (meta.op == OP_AGGREGATE) {
                    slot_owner.apply(meta);
                    worker_bitmap.apply(meta);
                    contributor_counter.apply(meta);
                    exponent_max.apply(hdr, meta, false, meta.cell);
                    aggregation_lanes.apply(hdr, meta.lane_op, meta.cell, false);
                } else if (meta.op == OP_HEARTBEAT) {
                    heartbeat_table.apply(hdr, meta);
                }
                next_step_selector.apply(hdr, meta);
                if (meta.op == OP_AGGREGATE && meta.emit == 1 && meta.drop_reason == 0) {
                    meta.recirculate = 1;
                    hdr.harvest.setValid();
                    hdr.harvest.cell = meta.cell;
                    hdr.harvest.dst = meta.dst;
                    hdr.harvest.mcast_grp = meta.mcast_grp;
                    hdr.harvest.out_port = meta.out_port;
                    hdr.harvest.multicast = meta.multicast;
                    hdr.harvest.pad0 = 0;
                    hdr.harvest.pad1 = 0;
                }
            } else {
                forwarder.apply(hdr, meta);
            }

            if (meta.drop_reason != 0) {
                drops.count(meta.drop_reason);
            }
            if (meta.event != 0) {
                events.count(meta.event);
            }
            if (meta.delivery != 0 && meta.drop_reason == 0) {
                delivery_events.count(meta.delivery);
            }
            if (meta.saturated == 1) {
                saturated_events.count(EVENT_SATURATED);
            }
            if (meta.drop_reason != 0 || (luwu && meta.emit == 0)) {
                ig_dprsr_md.drop_ctl = 1;
            }
        }

        if (meta.recirculate == 0 && hdr.luwu.isValid()) {
            seal_hcheck.apply(hdr);  /* hcheck of what leaves (pass 2 seals a recirculated result) */
        }

        hdr.bridge.setValid();
        hdr.bridge.pad = 0;
        hdr.bridge.harvest = meta.recirculate;
        hdr.bridge.dst = meta.dst;
        hdr.bridge.multicast = meta.multicast;
        if (meta.recirculate == 1) {
            hdr.bridge.emit = 0;  /* the recirculating copy is not addressed yet */
            ig_tm_md.ucast_egress_port = RECIRC_PORT;
        } else {
            hdr.bridge.emit = meta.emit;
            if (meta.multicast == 1) {
                ig_tm_md.mcast_grp_a = meta.mcast_grp;
            } else {
                ig_tm_md.ucast_egress_port = meta.out_port;
            }
        }
    }
}

control LuwuEgress(inout headers_t hdr, inout metadata_t meta,
                   in egress_intrinsic_metadata_t eg_intr_md,
                   in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                   inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                   inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    /* Drops of emitted copies: SIMULATED_LOSS on the egress link, NO_ROUTE without an endpoint. */
    @id(5) Counter<bit<64>, bit<8>>(COUNTER_SIZE, CounterType_t.PACKETS_AND_BYTES) drops;
    Random<bit<32>>() rng;

    EgressDropSimulator() drop_simulator;
    Sender() sender;

    apply {
        meta.drop_reason = 0;
        meta.emit = hdr.bridge.emit;
        meta.multicast = hdr.bridge.multicast;
        meta.dst = hdr.bridge.dst;
        hdr.bridge.setInvalid();
        if (!hdr.harvest.isValid()) {  /* on its way to pass 2: left alone */
            bit<32> draw = rng.get();
            drop_simulator.apply(meta, eg_intr_md.egress_port, draw);
            if (meta.drop_reason == 0 && meta.emit == 1) {
                sender.apply(hdr, meta, eg_intr_md.egress_rid);
            }
            if (meta.drop_reason != 0) {
                drops.count(meta.drop_reason);
                eg_dprsr_md.drop_ctl = 1;
            }
        }
    }
}

Pipeline(LuwuIngressParser(), LuwuIngress(), LuwuIngressDeparser(),
         LuwuEgressParser(), LuwuEgress(), LuwuEgressDeparser()) pipe;

Switch(pipe) main;
