/* heartbeat_table (v1model): min-aggregation of the workers' HEARTBEATs, per session.
 *
 * docs/protocol.md 6.4, registers indexed by session id:
 *   fresh  = hb_owner != epoch; hb_owner = epoch
 *   before = fresh ? 0 : hb_bitmap; after = before | bit; full = after == worker_mask
 *   hb_bitmap = full ? 0 : after
 *   ack    = before == 0 ? pkt.ack    : serial_min(hb_ack, pkt.ack)       (stored)
 *   credit = before == 0 ? pkt.credit : serial_min(hb_credit, pkt.credit) (stored)
 * The packet leaves with the round's ack and credit; next_step_selector emits it when full.
 */
#ifndef LUWU_HEARTBEAT_TABLE_P4
#define LUWU_HEARTBEAT_TABLE_P4

/* RFC 1982: a precedes b iff (int32)(a - b) < 0; the minimum is the one that precedes. */
bit<32> serial_min(in bit<32> a, in bit<32> b) {
    return ((int<32>)(a - b) < 0) ? a : b;
}

control HeartbeatTable(inout headers_t hdr, inout metadata_t meta) {
    @id(7) register<bit<32>>(MAX_SESSIONS) hb_owner;
    @id(8) register<bit<32>>(MAX_SESSIONS) hb_bitmap;
    @id(9) register<bit<32>>(MAX_SESSIONS) hb_ack;
    @id(10) register<bit<32>>(MAX_SESSIONS) hb_credit;

    apply {
        bit<32> index = (bit<32>)hdr.luwu.session;
        bit<32> owner;
        bit<32> bitmap;
        bit<32> ack;
        bit<32> credit;

        hb_owner.read(owner, index);
        hb_owner.write(index, meta.epoch);

        hb_bitmap.read(bitmap, index);
        bit<32> before = owner != meta.epoch ? 32w0 : bitmap;
        bit<32> after = before | meta.worker_bit;
        meta.hb_full = after == meta.worker_mask ? 1w1 : 1w0;
        hb_bitmap.write(index, meta.hb_full == 1 ? 32w0 : after);

        hb_ack.read(ack, index);
        ack = before == 0 ? hdr.hb.ack : serial_min(ack, hdr.hb.ack);
        hb_ack.write(index, ack);

        hb_credit.read(credit, index);
        credit = before == 0 ? hdr.hb.credit : serial_min(credit, hdr.hb.credit);
        hb_credit.write(index, credit);

        hdr.hb.ack = ack;
        hdr.hb.credit = credit;
    }
}

#endif
