/* heartbeat_table (TNA): min-aggregation of the workers' HEARTBEATs (docs/protocol.md 6.4).
 *
 * The rounds of include/heartbeat_table.p4 with one register action per register. A stateful
 * ALU compares but cannot test `(before | bit) == worker_mask`; for a sender not yet in the
 * round that is `before == worker_mask & ~bit` (meta.hb_rest), and a sender already in it can
 * never complete a round (the full round was reset), so `join` decides with a plain compare.
 * ack/credit keep the serial minimum: the packet's value wins when (int32)(stored - pkt) >= 0.
 */
#ifndef LUWU_TNA_HEARTBEAT_TABLE_P4
#define LUWU_TNA_HEARTBEAT_TABLE_P4

control HeartbeatTable(inout headers_t hdr, inout metadata_t meta) {
    @id(7) Register<bit<32>, bit<16>>(MAX_SESSIONS) hb_owner;
    @id(8) Register<bit<32>, bit<16>>(MAX_SESSIONS) hb_bitmap;
    @id(9) Register<bit<32>, bit<16>>(MAX_SESSIONS) hb_ack;
    @id(10) Register<bit<32>, bit<16>>(MAX_SESSIONS) hb_credit;

    RegisterAction<bit<32>, bit<16>, bit<1>>(hb_owner) claim = {
        void apply(inout bit<32> owner, out bit<1> fresh) {
            if (owner != meta.epoch) {
                fresh = 1;
            } else {
                fresh = 0;
            }
            owner = meta.epoch;
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(hb_bitmap) join_fresh = {
        void apply(inout bit<32> seen, out bit<32> before) {
            before = 0;
            if (meta.hb_single == 1) {
                seen = 0;
            } else {
                seen = meta.worker_bit;
            }
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(hb_bitmap) join = {
        void apply(inout bit<32> seen, out bit<32> before) {
            before = seen;
            if (seen == meta.hb_rest) {
                seen = 0;
            } else {
                seen = seen | meta.worker_bit;
            }
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(hb_ack) start_ack = {
        void apply(inout bit<32> value, out bit<32> ack) {
            value = hdr.hb.ack;
            ack = value;
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(hb_ack) min_ack = {
        void apply(inout bit<32> value, out bit<32> ack) {
            if ((int<32>)(value - hdr.hb.ack) >= 0) {
                value = hdr.hb.ack;
            }
            ack = value;
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(hb_credit) start_credit = {
        void apply(inout bit<32> value, out bit<32> credit) {
            value = hdr.hb.credit;
            credit = value;
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(hb_credit) min_credit = {
        void apply(inout bit<32> value, out bit<32> credit) {
            if ((int<32>)(value - hdr.hb.credit) >= 0) {
                value = hdr.hb.credit;
            }
            credit = value;
        }
    };

    apply {
        bit<16> index = hdr.luwu.session;
        bit<32> before;
        if (claim.execute(index) == 1) {
            before = join_fresh.execute(index);
        } else {
            before = join.execute(index);
        }
        meta.hb_full = (before == meta.hb_rest && (before & meta.worker_bit) == 0) ? 1w1 : 1w0;
        if (before == 0) {
            hdr.hb.ack = start_ack.execute(index);
            hdr.hb.credit = start_credit.execute(index);
        } else {
            hdr.hb.ack = min_ack.execute(index);
            hdr.hb.credit = min_credit.execute(index);
        }
    }
}

#endif
