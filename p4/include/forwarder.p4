/* forwarder (v1model): plain IPv4 routing for everything that is not luwu (docs/protocol.md 2).
 *
 * ipv4_lpm on the destination address; ipv4_forward sets the port and next-hop MAC, moves the
 * old destination MAC to the source and decrements the TTL (the checksum control recomputes
 * the header checksum). A miss, the explicit `drop` action, non-IPv4 frames and a TTL that
 * would reach 0 (a loop guard) drop NO_ROUTE; a delivered packet counts event FORWARDED.
 */
#ifndef LUWU_FORWARDER_P4
#define LUWU_FORWARDER_P4

control Forwarder(inout headers_t hdr, inout metadata_t meta) {
    @id(6) action ipv4_forward(port_t port, mac_t dst_mac) {
        meta.out_port = port;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
        meta.delivery = EVENT_FORWARDED;
    }

    @id(7) action drop() {
        meta.drop_reason = DROP_NO_ROUTE;
    }

    @id(6) table ipv4_lpm {
        key = { hdr.ipv4.dst_addr: lpm @name("dst_addr"); }
        actions = { ipv4_forward; drop; }
        default_action = drop();
        size = ROUTES;
    }

    apply {
        if (hdr.ipv4.isValid() && hdr.ipv4.ttl > 1) {
            ipv4_lpm.apply();
        } else {
            meta.drop_reason = DROP_NO_ROUTE;
        }
    }
}

#endif
