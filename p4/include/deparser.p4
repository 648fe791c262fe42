/* deparser (v1model): emits the valid headers in wire order; invalid ones are skipped, so
 * exactly one of data/hb is emitted after the common luwu header, and lanes only for
 * aggregation types (every dtype's, FIXED16's too). Unparsed bytes (PARAM, PULL payloads) follow unchanged. */
#ifndef LUWU_DEPARSER_P4
#define LUWU_DEPARSER_P4

control LuwuDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.luwu);
        packet.emit(hdr.data);
        packet.emit(hdr.hb);
        packet.emit(hdr.lanes);
    }
}

#endif
