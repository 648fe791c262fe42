/* parser (v1model): Ethernet / IPv4 / UDP, then the luwu header when the UDP destination port
 * is LUWU_UDP_PORT (docs/protocol.md 2, 3).
 *
 * The parser never rejects on purpose: BMv2 hands a packet whose parse failed (e.g. a
 * truncated payload: PacketTooShort) to ingress with standard_metadata.parser_error set, and
 * the classifier turns that into a MALFORMED drop. Fixed-size headers only: the aggregation
 * payload is one LANES-field header; PARAM and PULL payloads stay unparsed bytes that the
 * deparser re-emits untouched. Every dtype's aggregation payload is `lanes` (FIXED16's lanes
 * are int32 lanes too, each two int16 values packed: docs/protocol.md 5.2).
 */
#ifndef LUWU_PARSER_P4
#define LUWU_PARSER_P4

parser LuwuParser(packet_in packet, out headers_t hdr, inout metadata_t meta,
                  inout standard_metadata_t standard_metadata) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        /* Options and fragments are never luwu: such packets are routed as plain IPv4. */
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (IPV4_MIN_IHL, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            LUWU_UDP_PORT: parse_luwu;
            default: accept;
        }
    }

    state parse_luwu {
        packet.extract(hdr.luwu);
        transition select(hdr.luwu.msg_type) {
            TYPE_GRAD: parse_aggregation;
            TYPE_AGG: parse_aggregation;
            TYPE_ALLREDUCE: parse_aggregation;
            TYPE_RESULT: parse_aggregation;
            TYPE_PARAM: parse_data;
            TYPE_PULL: parse_data;
            TYPE_HEARTBEAT: parse_heartbeat;
            default: parse_data;  /* BAD_TYPE, decided by the classifier after the header check */
        }
    }

    state parse_aggregation {
        packet.extract(hdr.data);
        /* a header-only ZERO contribution carries no lanes (docs/protocol.md 3.2): the ingress
         * makes them valid with zeros once the classifier accepted it (zero_lanes.p4) */
        transition select(hdr.luwu.flags) {
            FLAG_ZERO &&& FLAG_ZERO: accept;
            default: parse_lanes;
        }
    }

    state parse_lanes {
        packet.extract(hdr.lanes);
        transition accept;
    }

    state parse_data {
        packet.extract(hdr.data);
        transition accept;
    }

    state parse_heartbeat {
        packet.extract(hdr.hb);
        transition accept;
    }
}

#endif
