/* sender (v1model, egress): addresses every luwu packet the switch emits (docs/protocol.md 2, 6.1).
 *
 * `endpoints` maps (session, dst) to the endpoint's MAC, IPv4 address and UDP port; dst is
 * the replica's instance (`replica`: v1model egress_rid, TNA eg_intr_md.egress_rid = the
 * worker's rank, or a rack's up_worker) for a
 * multicast copy, else the rank or NODE chosen in ingress. The source becomes the address the
 * packet was sent to (the switch's service address). The UDP checksum is zeroed (the
 * payload changed) and the IPv4 checksum is recomputed by the checksum control. A copy whose
 * destination has no entry is dropped NO_ROUTE: it must never leave addressed to the
 * switch's own service address.
 */
#ifndef LUWU_SENDER_P4
#define LUWU_SENDER_P4

control Sender(inout headers_t hdr, inout metadata_t meta, in bit<16> replica) {
    @id(5) action set_endpoint(mac_t dst_mac, ipv4_addr_t dst_ip, bit<16> dst_udp) {
        /* reply from the address the packet was sent to: the switch's service address */
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.udp.src_port = hdr.udp.dst_port;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.dst_addr = dst_ip;
        hdr.udp.dst_port = dst_udp;
    }

    @id(5) table endpoints {
        key = {
            hdr.luwu.session: exact @name("session");
            meta.dst: exact @name("dst");
        }
        actions = { set_endpoint; @defaultonly NoAction; }
        default_action = NoAction();
        size = ENDPOINT_ENTRIES;
    }

    apply {
        if (meta.multicast == 1) {
            meta.dst = replica;
        }
        if (endpoints.apply().hit) {
            hdr.udp.checksum = 0;
        } else {
            meta.drop_reason = DROP_NO_ROUTE;
        }
    }
}

#endif
