/* The aggregation payload: `lanes` int32 values in one header (docs/protocol.md 3.3, 3.4).
 * GRAD, AGG, ALLREDUCE and RESULT always carry exactly LANES of them. */
#ifndef LUWU_PAYLOAD_P4
#define LUWU_PAYLOAD_P4

#define LANES @@LANES

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
