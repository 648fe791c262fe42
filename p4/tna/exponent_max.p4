/* exponent_max (TNA): the phase's shared exponent (signed max, held sign-extended in int<32>)
 * and the OR of SATURATED (docs/protocol.md 5, 6.3); also picks the lanes' combine op.
 *
 * One register of pairs, so both take one stateful ALU (the Tofino 1 budget in p4/README.md):
 * lo = exponent, hi = stored flags. A pair action returns one 32-bit value, so pass 1 returns
 * the exponent and an emitted result reads the flags in pass 2 (`harvest_flags`, on the same
 * recirculation that reads the odd lanes): nothing before delivery needs them. */
#ifndef LUWU_TNA_EXPONENT_MAX_P4
#define LUWU_TNA_EXPONENT_MAX_P4

struct exponent_flags_t {
    int<32> exponent;
    bit<32> flags;
}

control ExponentMax(inout headers_t hdr, inout metadata_t meta, in bool harvest, in bit<32> cell) {
    @id(5) Register<exponent_flags_t, bit<32>>(SLOT_CELLS) exponent_flags;

    RegisterAction<exponent_flags_t, bit<32>, int<32>>(exponent_flags) first = {
        void apply(inout exponent_flags_t value, out int<32> e) {
            value.exponent = meta.exponent_in;
            value.flags = meta.saturated_in;
            e = value.exponent;
        }
    };
    RegisterAction<exponent_flags_t, bit<32>, int<32>>(exponent_flags) keep = {
        void apply(inout exponent_flags_t value, out int<32> e) {
            e = value.exponent;
        }
    };
    RegisterAction<exponent_flags_t, bit<32>, int<32>>(exponent_flags) combine = {
        void apply(inout exponent_flags_t value, out int<32> e) {
            if (meta.exponent_in > value.exponent) {
                value.exponent = meta.exponent_in;
            }
            value.flags = value.flags | meta.saturated_in;
            e = value.exponent;
        }
    };
    RegisterAction<exponent_flags_t, bit<32>, bit<32>>(exponent_flags) read_flags = {
        void apply(inout exponent_flags_t value, out bit<32> f) {
            f = value.flags;
        }
    };

    apply {
        if (harvest) {
            /* pass 2 of an emitted result: the flags the contributors ORed into the cell */
            bit<32> f = read_flags.execute(cell);
            if (f & (bit<32>)FLAG_SATURATED != 0) {
                hdr.luwu.flags = hdr.luwu.flags | FLAG_SATURATED;
                meta.saturated = 1;
            }
        } else {
            int<32> e;
            if (meta.first == 1) {
                e = first.execute(cell);
                meta.lane_op = LANE_WRITE;
            } else if (meta.dup == 1) {
                e = keep.execute(cell);
                meta.lane_op = LANE_READ;
            } else {
                e = combine.execute(cell);
                meta.lane_op = (hdr.luwu.flags & FLAG_MAX) != 0 ? LANE_MAX : LANE_ADD;
            }
            meta.exponent = (bit<8>)(bit<32>)e;  // P4_16 changes sign and width in separate casts
            meta.stored_flags = 0;  // read in pass 2 (above); the selector ORs in nothing now
        }
    }
}

#endif
