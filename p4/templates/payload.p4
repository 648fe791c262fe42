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

#endif
