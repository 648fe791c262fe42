/* The aggregation payload: `lanes` int32 values in one header (docs/protocol.md 3.3, 3.4).
 * GRAD, AGG, ALLREDUCE and RESULT carry LANES of them: int32 lanes, or int16 lanes for dtype
 * FIXED16 (`lanes16`, 2 * LANES bytes), which the switch sign-extends into the same 32-bit lane
 * registers and emits truncated to 16 bits (exact: the sender leaves headroom for the
 * contributor count, docs/protocol.md 5.2).
 *
 * Aggregation packets carry their lanes in whole chunks of LUWU_LANE_CHUNK lanes, the fewest
 * their count needs (docs/protocol.md 3.3). A program of at most one chunk (the 64-lane build:
 * BMv2, Tofino) has exactly one length per dtype, the whole packet, which is what this header
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

header luwu_lanes16_t {
@@LANE_BEGIN
    bit<16> lane_{k};
@@LANE_END
}

/* FIXED16: the int16 lanes sign-extended into the int32 lanes the aggregation controls use.
 * (Unused by a TNA build too narrow for FIXED16: include/headers.p4 LUWU_NO_FIXED16.) */
@noWarn("unused")
void widen_lanes16(in luwu_lanes16_t l16, inout luwu_lanes_t lanes) {
    lanes.setValid();
@@LANE_BEGIN
    lanes.lane_{k} = (bit<32>)(int<32>)(int<16>)l16.lane_{k};
@@LANE_END
}

/* FIXED16: the stored int32 sums back into the int16 lanes (low 16 bits), `lanes` invalid again,
 * so the packet leaves with its own 2 * LANES-byte payload. */
@noWarn("unused")
void narrow_lanes16(inout luwu_lanes16_t l16, inout luwu_lanes_t lanes) {
    l16.setValid();
@@LANE_BEGIN
    l16.lane_{k} = lanes.lane_{k}[15:0];
@@LANE_END
    lanes.setInvalid();
}

#endif
