/* checksum (v1model): the IPv4 header checksum.
 *
 * Incoming checksums are not verified (a corrupted header fails the luwu checks or the route
 * anyway). Every emitted IPv4 header gets a fresh checksum: the sender rewrites dst_addr of
 * luwu packets and the forwarder decrements the TTL. UDP checksums of emitted luwu packets
 * are set to 0 by the sender (docs/protocol.md 2), so no payload checksum is needed.
 */
#ifndef LUWU_CHECKSUM_P4
#define LUWU_CHECKSUM_P4

control LuwuVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control LuwuComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid(),
            { hdr.ipv4.version,
              hdr.ipv4.ihl,
              hdr.ipv4.diffserv,
              hdr.ipv4.total_len,
              hdr.ipv4.identification,
              hdr.ipv4.flags,
              hdr.ipv4.frag_offset,
              hdr.ipv4.ttl,
              hdr.ipv4.protocol,
              hdr.ipv4.src_addr,
              hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

#endif
