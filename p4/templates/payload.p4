/* The aggregation payload: `lanes` int32 values in one header (docs/protocol.md 3.3, 3.4).
 * GRAD, AGG, ALLREDUCE and RESULT carry LANES of them, whatever their dtype: a FIXED16 lane
 * holds two int16 values as `hi * 2^16 + lo`, and its wrapping int32 sum is the two sums packed
 * the same way (exact: the sender leaves headroom for the contributor count, docs/protocol.md
 * 5.2), so the switch sums it as any int32 lane.
 *
 * Aggregation packets carry their lanes in whole chunks of LUWU_LANE_CHUNK lanes, the fewest
 * their count needs (docs/protocol.md 3.3). A program of at most one chunk (the 64-lane build:
 * BMv2, Tofino) has exactly one length, the whole packet, which is what this header
 * and the classifier's length check implement. A wider program would have to parse a stack of
 * chunks up to the count's and sum only those; this one has a single header, so it refuses to
 * build rather than drop every short packet as MALFORMED. */
#ifndef LUWU_PAYLOAD_P4
#define LUWU_PAYLOAD_P4

#define LANES @@LANES
#if LANES > LUWU_LANE_CHUNK
#error "LANES is more than one chunk of LUWU_LANE_CHUNK lanes: short aggregation packets (docs/protocol.md 3.3) need a chunk stack this program does not have; build with --lanes 64 or fewer"
#endif

header luwu_lanes_t {
@@LANE_BEGIN
    bit<32> lane_{k};
@@LANE_END
}

/* What a header-only ZERO contribution stands for (docs/protocol.md 3.2): LANES zero lanes,
 * valid, so the aggregation controls treat it like any other contribution. */
void fill_zero_lanes(inout luwu_lanes_t lanes) {
    lanes.setValid();
@@LANE_BEGIN
    lanes.lane_{k} = 0;
@@LANE_END
}

#endif
