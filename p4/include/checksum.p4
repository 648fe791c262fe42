/* checksum (v1model): the luwu header check and the IPv4 header checksum.
 *
 * The luwu header check (`hcheck`, bytes 26..27 of the 32-byte header, docs/protocol.md 3.5) is
 * CRC-16/ARC of the other 30 header bytes: v1model's HashAlgorithm.crc16 over the header fields
 * in wire order without hcheck (dataplane/integrity.py `header_check`). It is verified here for
 * every luwu packet whose data or heartbeat part was parsed; a mismatch sets
 * standard_metadata.checksum_error, which ingress turns into a BAD_CHECKSUM drop before any
 * table or register is touched. It is recomputed on everything emitted, since the switch
 * rewrites type, worker, flags and exponent (hop by hop).
 *
 * Incoming IPv4 checksums are not verified (a corrupted header fails the luwu checks or the
 * route anyway). Every emitted IPv4 header gets a fresh checksum: the sender rewrites dst_addr of
 * luwu packets and the forwarder decrements the TTL. UDP checksums of emitted luwu packets
 * are set to 0 by the sender (docs/protocol.md 2), so no payload checksum is needed.
 */
#ifndef LUWU_CHECKSUM_P4
#define LUWU_CHECKSUM_P4

control LuwuVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        verify_checksum(
            hdr.luwu.isValid() && hdr.data.isValid(),
            { hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session, hdr.luwu.worker,
              hdr.luwu.count,
              hdr.data.seq, hdr.data.slot, hdr.data.tensor, hdr.data.offset, hdr.data.exponent,
              hdr.data.dtype, hdr.data.numel },
            hdr.data.hcheck,
            HashAlgorithm.crc16);
        verify_checksum(
            hdr.luwu.isValid() && hdr.hb.isValid(),
            { hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session, hdr.luwu.worker,
              hdr.luwu.count,
              hdr.hb.seq, hdr.hb.ack, hdr.hb.credit, hdr.hb.reserved0, hdr.hb.reserved1 },
            hdr.hb.hcheck,
            HashAlgorithm.crc16);
    }
}

control LuwuComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(
            hdr.luwu.isValid() && hdr.data.isValid(),
            { hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session, hdr.luwu.worker,
              hdr.luwu.count,
              hdr.data.seq, hdr.data.slot, hdr.data.tensor, hdr.data.offset, hdr.data.exponent,
              hdr.data.dtype, hdr.data.numel },
            hdr.data.hcheck,
            HashAlgorithm.crc16);
        update_checksum(
            hdr.luwu.isValid() && hdr.hb.isValid(),
            { hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session, hdr.luwu.worker,
              hdr.luwu.count,
              hdr.hb.seq, hdr.hb.ack, hdr.hb.credit, hdr.hb.reserved0, hdr.hb.reserved1 },
            hdr.hb.hcheck,
            HashAlgorithm.crc16);
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
