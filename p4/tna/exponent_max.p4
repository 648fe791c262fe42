/* exponent_max (TNA): the phase's shared exponent (signed max, held sign-extended in int<32>)
 * and the OR of SATURATED (docs/protocol.md 5, 6.3); also picks the lanes' combine op. */
#ifndef LUWU_TNA_EXPONENT_MAX_P4
#define LUWU_TNA_EXPONENT_MAX_P4

control ExponentMax(in headers_t hdr, inout metadata_t meta) {
    @id(5) Register<int<32>, bit<32>>(SLOT_CELLS) exponents;
    @id(6) Register<bit<32>, bit<32>>(SLOT_CELLS) slot_flags;

    RegisterAction<int<32>, bit<32>, int<32>>(exponents) set_exponent = {
        void apply(inout int<32> value, out int<32> e) {
            value = meta.exponent_in;
            e = value;
        }
    };
    RegisterAction<int<32>, bit<32>, int<32>>(exponents) keep_exponent = {
        void apply(inout int<32> value, out int<32> e) {
            e = value;
        }
    };
    RegisterAction<int<32>, bit<32>, int<32>>(exponents) max_exponent = {
        void apply(inout int<32> value, out int<32> e) {
            if (meta.exponent_in > value) {
                value = meta.exponent_in;
            }
            e = value;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(slot_flags) set_flags = {
        void apply(inout bit<32> value, out bit<32> f) {
            value = meta.saturated_in;
            f = value;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(slot_flags) keep_flags = {
        void apply(inout bit<32> value, out bit<32> f) {
            f = value;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(slot_flags) or_flags = {
        void apply(inout bit<32> value, out bit<32> f) {
            value = value | meta.saturated_in;
            f = value;
        }
    };

    apply {
        int<32> e;
        bit<32> f;
        if (meta.first == 1) {
            e = set_exponent.execute(meta.cell);
            f = set_flags.execute(meta.cell);
            meta.lane_op = LANE_WRITE;
        } else if (meta.dup == 1) {
            e = keep_exponent.execute(meta.cell);
            f = keep_flags.execute(meta.cell);
            meta.lane_op = LANE_READ;
        } else {
            e = max_exponent.execute(meta.cell);
            f = or_flags.execute(meta.cell);
            meta.lane_op = (hdr.luwu.flags & FLAG_MAX) != 0 ? LANE_MAX : LANE_ADD;
        }
        meta.exponent = (bit<8>)e;
        meta.stored_flags = (bit<8>)f;
    }
}

#endif
