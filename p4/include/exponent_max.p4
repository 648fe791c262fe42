/* exponent_max (v1model): the phase's shared exponent and SATURATED flag.
 *
 * docs/protocol.md 5 and 6.3:
 *   exponent = first ? pkt.e : dup ? exponents[s] : max(exponents[s], pkt.e)   (int8)
 *   flags    = first ? pkt.sat : dup ? slot_flags[s] : slot_flags[s] | pkt.sat
 * Also chooses how the lanes combine (meta.lane_op): overwrite, add, signed max or read.
 */
#ifndef LUWU_EXPONENT_MAX_P4
#define LUWU_EXPONENT_MAX_P4

control ExponentMax(in headers_t hdr, inout metadata_t meta) {
    @id(5) register<bit<32>>(SLOT_CELLS) exponents;
    @id(6) register<bit<32>>(SLOT_CELLS) slot_flags;

    apply {
        bit<32> stored_exponent;
        bit<32> stored_flags;
        exponents.read(stored_exponent, meta.cell);
        slot_flags.read(stored_flags, meta.cell);
        bit<8> e = hdr.data.exponent;
        bit<8> sat = hdr.luwu.flags & FLAG_SATURATED;
        bit<8> old_e = stored_exponent[7:0];
        bit<8> old_sat = stored_flags[7:0];
        if (meta.first == 1) {
            meta.exponent = e;
            meta.stored_flags = sat;
            meta.lane_op = LANE_WRITE;
        } else if (meta.dup == 1) {
            meta.exponent = old_e;
            meta.stored_flags = old_sat;
            meta.lane_op = LANE_READ;
        } else {
            meta.exponent = (int<8>)e > (int<8>)old_e ? e : old_e;
            meta.stored_flags = old_sat | sat;
            meta.lane_op = (hdr.luwu.flags & FLAG_MAX) != 0 ? LANE_MAX : LANE_ADD;
        }
        exponents.write(meta.cell, (bit<32>)meta.exponent);
        slot_flags.write(meta.cell, (bit<32>)meta.stored_flags);
    }
}

#endif
