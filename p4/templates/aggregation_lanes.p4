/* aggregation_lanes (v1model): the running sums of the slot pool, one register per lane.
 *
 * Indexed like the other slot registers (meta.cell = set * SLOTS + slot). meta.lane_op comes
 * from the slot state machine (docs/protocol.md 6.3): the first contributor overwrites, later
 * ones add (or take the signed max when FLAG_MAX is set), a duplicate only reads. Every lane
 * does exactly one read and one write per pass, and the packet leaves with the stored values,
 * which is what a completion or a resend emits.
 */
#ifndef LUWU_AGGREGATION_LANES_P4
#define LUWU_AGGREGATION_LANES_P4

bit<32> combine_lane(in bit<2> op, in bit<32> stored, in bit<32> x) {
    return (op == LANE_WRITE) ? x
         : ((op == LANE_ADD) ? (stored + x)
         : ((op == LANE_MAX) ? (((int<32>)x > (int<32>)stored) ? x : stored)
         : stored));
}

control AggregationLanes(inout headers_t hdr, in metadata_t meta) {
@@LANE_BEGIN
    @id({id}) register<bit<32>>(SLOT_CELLS) lane_{k};
@@LANE_END

    apply {
        bit<32> stored;
@@LANE_BEGIN
        lane_{k}.read(stored, meta.cell);
        stored = combine_lane(meta.lane_op, stored, hdr.lanes.lane_{k});
        lane_{k}.write(meta.cell, stored);
        hdr.lanes.lane_{k} = stored;
@@LANE_END
    }
}

#endif
