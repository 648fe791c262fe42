/* parsers and deparsers (TNA).
 *
 * Ingress: the intrinsic and port metadata, then a harvest header on packets coming back from
 * the recirculation port (pass 2), then the same Ethernet / IPv4 / UDP / luwu / lanes as the
 * v1model parser. Egress: only what the sender rewrites (Ethernet, IPv4, UDP, the common
 * luwu header for the session); the rest is payload. The bridge header carries ingress's
 * decision to egress; the egress deparser recomputes the IPv4 checksum (Checksum extern).
 * Parser errors (a truncated payload) reach the control as parser_err, counted MALFORMED.
 */
#ifndef LUWU_TNA_PARSER_P4
#define LUWU_TNA_PARSER_P4

parser LuwuIngressParser(packet_in pkt, out headers_t hdr, out metadata_t meta,
                         out ingress_intrinsic_metadata_t ig_intr_md) {
    state start {
        meta = {...};  // every field 0: what Tofino's parser gives metadata (@pa_auto_init_metadata), said in P4
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition select(ig_intr_md.ingress_port) {
            RECIRC_PORT: parse_harvest;
            default: parse_ethernet;
        }
    }

    state parse_harvest {
        pkt.extract(hdr.harvest);
        transition parse_ethernet;
    }

    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (IPV4_MIN_IHL, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            LUWU_UDP_PORT: parse_luwu;
            default: accept;
        }
    }

    state parse_luwu {
        pkt.extract(hdr.luwu);
        transition select(hdr.luwu.msg_type) {
            TYPE_GRAD: parse_aggregation;
            TYPE_AGG: parse_aggregation;
            TYPE_ALLREDUCE: parse_aggregation;
            TYPE_RESULT: parse_aggregation;
            TYPE_PARAM: parse_data;
            TYPE_PULL: parse_data;
            TYPE_HEARTBEAT: parse_heartbeat;
            default: parse_data;  /* BAD_TYPE after the header check (its 30 bytes are the data layout's) */
        }
    }

    state parse_aggregation {
        pkt.extract(hdr.data);
        /* a header-only ZERO contribution carries no lanes (docs/protocol.md 3.2): the ingress
         * makes them valid with zeros once the classifier accepted it (zero_lanes.p4) */
        transition select(hdr.luwu.flags) {
            FLAG_ZERO &&& FLAG_ZERO: accept;
            default: parse_lanes;
        }
    }

    state parse_lanes {
        pkt.extract(hdr.lanes);
        transition accept;
    }

    state parse_data {
        pkt.extract(hdr.data);
        transition accept;
    }

    state parse_heartbeat {
        pkt.extract(hdr.hb);
        transition accept;
    }
}

control LuwuIngressDeparser(packet_out pkt, inout headers_t hdr, in metadata_t meta,
                            in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(hdr.bridge);
        pkt.emit(hdr.harvest);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.luwu);
        pkt.emit(hdr.data);
        pkt.emit(hdr.hb);
        pkt.emit(hdr.lanes);
    }
}

parser LuwuEgressParser(packet_in pkt, out headers_t hdr, out metadata_t meta,
                        out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        meta = {...};
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        transition select(hdr.bridge.harvest) {
            1: parse_harvest;
            default: parse_ethernet;
        }
    }

    state parse_harvest {
        pkt.extract(hdr.harvest);
        transition parse_ethernet;
    }

    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (IPV4_MIN_IHL, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            LUWU_UDP_PORT: parse_luwu;
            default: accept;
        }
    }

    state parse_luwu {
        pkt.extract(hdr.luwu);
        transition accept;
    }
}

control LuwuEgressDeparser(packet_out pkt, inout headers_t hdr, in metadata_t meta,
                           in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        hdr.ipv4.hdr_checksum = ipv4_checksum.update({
            hdr.ipv4.version,
            hdr.ipv4.ihl,
            hdr.ipv4.diffserv,
            hdr.ipv4.total_len,
            hdr.ipv4.identification,
            hdr.ipv4.flags,
            hdr.ipv4.frag_offset,
            hdr.ipv4.ttl,
            hdr.ipv4.protocol,
            hdr.ipv4.src_addr,
            hdr.ipv4.dst_addr });
        pkt.emit(hdr.harvest);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.luwu);
    }
}

#endif
