/* header_check (TNA): the luwu header check (hcheck, docs/protocol.md 3.5) without a checksum
 * unit. TNA's Checksum extern is the ones'-complement sum, so the CRC-16/ARC of the other 30
 * header bytes (dataplane/integrity.py `header_check`; poly 0x8005 reflected, init 0, no final
 * xor) is a `Hash` with that CRCPolynomial, over the header fields in wire order without hcheck:
 *   HeaderCheckVerify  ingress pass 1: ok = the packet's hcheck matches (true for a luwu packet
 *                      whose data/heartbeat part was not parsed: a header cut short, MALFORMED);
 *                      the classifier's first check (BAD_CHECKSUM)
 *   HeaderCheckSeal    the end of ingress, every packet that leaves (not one on its way to pass
 *                      2): hcheck recomputed after the rewrites (type, worker, flags, exponent).
 * Egress changes only Ethernet/IPv4/UDP, so the hcheck written in ingress is the one on the wire.
 * Each Hash runs on the hash units of the stage that uses it (one 16-bit hash output each).
 */
#ifndef LUWU_TNA_HEADER_CHECK_P4
#define LUWU_TNA_HEADER_CHECK_P4

control HeaderCheckVerify(in headers_t hdr, out bool ok) {
    CRCPolynomial<bit<16>>(16w0x8005, true, false, false, 16w0x0000, 16w0x0000) data_poly;
    CRCPolynomial<bit<16>>(16w0x8005, true, false, false, 16w0x0000, 16w0x0000) hb_poly;
    Hash<bit<16>>(HashAlgorithm_t.CUSTOM, data_poly) data_crc;
    Hash<bit<16>>(HashAlgorithm_t.CUSTOM, hb_poly) hb_crc;

    apply {
        ok = true;
        if (hdr.data.isValid()) {
            bit<16> c = data_crc.get({ hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session,
                                       hdr.luwu.worker, hdr.luwu.count,
                                       hdr.data.seq, hdr.data.slot, hdr.data.tensor, hdr.data.offset,
                                       hdr.data.exponent, hdr.data.dtype, hdr.data.numel });
            ok = c == hdr.data.hcheck;
        } else if (hdr.hb.isValid()) {
            bit<16> c = hb_crc.get({ hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session,
                                     hdr.luwu.worker, hdr.luwu.count,
                                     hdr.hb.seq, hdr.hb.ack, hdr.hb.credit, hdr.hb.reserved0, hdr.hb.reserved1 });
            ok = c == hdr.hb.hcheck;
        }
    }
}

control HeaderCheckSeal(inout headers_t hdr) {
    CRCPolynomial<bit<16>>(16w0x8005, true, false, false, 16w0x0000, 16w0x0000) data_poly;
    CRCPolynomial<bit<16>>(16w0x8005, true, false, false, 16w0x0000, 16w0x0000) hb_poly;
    Hash<bit<16>>(HashAlgorithm_t.CUSTOM, data_poly) data_crc;
    Hash<bit<16>>(HashAlgorithm_t.CUSTOM, hb_poly) hb_crc;

    apply {
        if (hdr.data.isValid()) {
            hdr.data.hcheck = data_crc.get({ hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session,
                                             hdr.luwu.worker, hdr.luwu.count,
                                             hdr.data.seq, hdr.data.slot, hdr.data.tensor, hdr.data.offset,
                                             hdr.data.exponent, hdr.data.dtype, hdr.data.numel });
        } else if (hdr.hb.isValid()) {
            hdr.hb.hcheck = hb_crc.get({ hdr.luwu.version, hdr.luwu.msg_type, hdr.luwu.flags, hdr.luwu.session,
                                         hdr.luwu.worker, hdr.luwu.count,
                                         hdr.hb.seq, hdr.hb.ack, hdr.hb.credit, hdr.hb.reserved0, hdr.hb.reserved1 });
        }
    }
}

#endif
