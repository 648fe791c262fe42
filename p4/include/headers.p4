/* Packet headers and per-packet metadata shared by the v1model and TNA programs.
 *
 * The luwu header layout is docs/protocol.md section 3: an 8-byte common part, then either
 * the 24-byte data part (GRAD, AGG, ALLREDUCE, RESULT, PARAM, PULL) or the 24-byte heartbeat
 * part. Both parts are separate headers (no header_union); the parser extracts exactly one.
 * The aggregation payload (`lanes`, int32 for every dtype: a FIXED16 lane packs two int16 values,
 * docs/protocol.md 5.2) is the generated header in payload.p4.
 */
#ifndef LUWU_HEADERS_P4
#define LUWU_HEADERS_P4

#include "constants.p4"
#include "parameters.p4"
#include "payload.p4"

/* IEEE/IANA numbers of the carrier headers (not luwu wire numbers). */
const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8>  IP_PROTO_UDP = 17;
const bit<4>  IPV4_MIN_IHL = 5;
const bit<16> UDP_HEADER_LEN = 8;
/* UDP length of a luwu packet without payload. */
const bit<32> LUWU_UDP_HEADERS_LEN = (bit<32>)(UDP_HEADER_LEN + LUWU_HEADER_LEN);

typedef bit<9>  port_t;
typedef bit<48> mac_t;
typedef bit<32> ipv4_addr_t;

header ethernet_t {
    mac_t   dst_addr;
    mac_t   src_addr;
    bit<16> ether_type;
}

header ipv4_t {
    bit<4>      version;
    bit<4>      ihl;
    bit<8>      diffserv;
    bit<16>     total_len;
    bit<16>     identification;
    bit<3>      flags;
    bit<13>     frag_offset;
    bit<8>      ttl;
    bit<8>      protocol;
    bit<16>     hdr_checksum;
    ipv4_addr_t src_addr;
    ipv4_addr_t dst_addr;
}

header udp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* Bytes 0..7 of every luwu packet. `msg_type` is the spec's `type` (a P4 keyword). */
header luwu_common_t {
    bit<4>  version;
    bit<4>  msg_type;
    bit<8>  flags;
    bit<16> session;
    bit<16> worker;
    bit<16> count;
}

/* Bytes 8..31 of GRAD, AGG, ALLREDUCE, RESULT, PARAM and PULL. */
header luwu_data_t {
    bit<32> seq;
    bit<32> slot;
    bit<32> tensor;
    bit<32> offset;
    bit<8>  exponent;   /* int8 on the wire; compared as int<8> */
    bit<8>  dtype;
    bit<16> hcheck;     /* CRC-16/ARC of the other 30 header bytes (docs/protocol.md 3.5) */
    bit<32> numel;
}

/* Bytes 8..31 of HEARTBEAT. */
header luwu_heartbeat_t {
    bit<32> seq;
    bit<32> ack;
    bit<32> credit;
    bit<48> reserved0;
    bit<16> hcheck;     /* bytes 26..27, as in the data part */
    bit<32> reserved1;
}

#ifdef LUWU_TNA
/* TNA only: what egress needs from ingress (TNA does not carry user metadata across). */
header bridge_t {
    bit<1>  emit;       /* a luwu packet the switch emits: rewrite it from `endpoints` */
    bit<1>  multicast;  /* a replica: its endpoints key is egress_rid */
    bit<1>  harvest;    /* a harvest header follows (pass 1 on its way to recirculation) */
    bit<5>  pad;
    bit<16> dst;
}

/* TNA only: pass 1 -> pass 2 of an emitted aggregation result. A lane-pair register returns
 * one 32-bit value per pass, so the odd lanes are read back after one recirculation. */
header harvest_t {
    bit<32> cell;
    bit<16> dst;
    bit<16> mcast_grp;
    bit<7>  pad0;
    port_t  out_port;
    bit<1>  multicast;
    bit<7>  pad1;
}
#endif

struct headers_t {
#ifdef LUWU_TNA
    bridge_t         bridge;
    harvest_t        harvest;
#endif
    ethernet_t       ethernet;
    ipv4_t           ipv4;
    udp_t            udp;
    luwu_common_t    luwu;
    luwu_data_t      data;
    luwu_heartbeat_t hb;
    luwu_lanes_t     lanes;
}

/* What the classifier decided to do with a luwu packet (meta.op). */
const bit<3> OP_NONE = 0;       /* dropped or absorbed: nothing to emit */
const bit<3> OP_AGGREGATE = 1;  /* GRAD/ALLREDUCE in the pool: slot state machine */
const bit<3> OP_FALLBACK = 2;   /* GRAD outside the pool (or FALLBACK set): toward the node */
const bit<3> OP_HEARTBEAT = 3;  /* worker HEARTBEAT: min-aggregation round */
const bit<3> OP_MULTICAST = 4;  /* PARAM, node HEARTBEAT, RESULT from the parent */
const bit<3> OP_UNICAST = 5;    /* PULL: toward the node or the parent */

/* How aggregation_lanes combines a packet's lane with the stored one (meta.lane_op). */
const bit<2> LANE_WRITE = 0;    /* first contributor: overwrite */
const bit<2> LANE_ADD = 1;      /* wrapping 32-bit add */
const bit<2> LANE_MAX = 2;      /* signed 32-bit max (FLAG_MAX) */
const bit<2> LANE_READ = 3;     /* duplicate: leave the sum, copy it into the packet */

struct metadata_t {
    /* outcome, counted at the end of the pass (0 = none) */
    bit<8>  drop_reason;
    bit<8>  event;          /* state machine event: COMPLETED, ABSORBED, RESENT, ... */
    bit<8>  delivery;       /* MULTICAST, UNICAST or FORWARDED */
    bit<1>  saturated;      /* the emitted result carries SATURATED: event SATURATED */
    bit<3>  op;

    /* drop simulator */
    bit<32> drop_threshold;

    /* sessions table */
    bit<1>  session_known;  /* counted in session_packets */
    bit<32> pool_base;
    bit<32> pool_size;
    bit<8>  num_workers;
    bit<32> worker_mask;
    bit<32> epoch;
    bit<16> mcast_grp;
    bit<8>  next_step;
    port_t  up_port;
    bit<16> up_worker;

    /* workers table */
    bit<32> worker_bit;
    port_t  worker_port;

    /* slot state machine */
    bit<32> slot;           /* absolute slot index, < SLOTS */
    bit<1>  set;            /* shadow set (FLAG_SET of the packet) */
    bit<32> cell;           /* register index set * SLOTS + slot */
    bit<1>  fresh;
    bit<1>  first;
    bit<1>  dup;
    bit<32> remaining;
    bit<8>  exponent;
    bit<8>  stored_flags;   /* OR of the contributors' SATURATED */
    bit<2>  lane_op;

    /* heartbeat round */
    bit<1>  hb_full;
    bit<32> hb_ack;
    bit<32> hb_credit;

    /* where it goes (set by next_step_selector / forwarder, acted on by the architecture) */
    port_t  out_port;
    /* egress rewrite: endpoints key (session, dst); multicast replicas use egress_rid */
    bit<1>  emit;
    bit<1>  multicast;
    bit<16> dst;
    bit<16> src_worker;     /* the sender's rank before the header is rewritten */
#ifdef LUWU_TNA
    /* TNA only: register-action inputs prepared by ordinary ALUs in earlier stages */
    bit<32> worker_clear;     /* ~worker_bit */
    bit<32> first_remaining;  /* num_workers - 1 */
    int<32> exponent_in;      /* the packet's int8 exponent, sign-extended */
    bit<32> saturated_in;     /* the packet's SATURATED flag */
    bit<32> hb_rest;          /* worker_mask & ~worker_bit */
    bit<1>  hb_single;        /* worker_bit == worker_mask */
    bit<1>  recirculate;
#endif
}

#endif
