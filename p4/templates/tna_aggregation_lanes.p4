/* aggregation_lanes (TNA): the running sums, one register per pair of lanes.
 *
 * Register lane_pair_k holds lanes 2k (lo) and 2k+1 (hi) of every cell (set * SLOTS + slot),
 * so 64 lanes take 32 stateful ALUs instead of 64 (SwitchML's layout). One register action
 * per pair per pass, chosen by meta.lane_op: write (first contributor), add, signed max,
 * and read -- a duplicate zeroes its lanes and adds, which leaves the sums alone. A pair's
 * action returns one 32-bit value, so pass 1 puts the new lo lanes into the packet and an
 * emitted result is recirculated once (`harvest`, pass 2) to read the hi lanes of the same
 * cell with the fourth action. The cell cannot change in between: its next write needs every
 * worker to have received the result being harvested (docs/protocol.md 4).
 */
#ifndef LUWU_TNA_AGGREGATION_LANES_P4
#define LUWU_TNA_AGGREGATION_LANES_P4

struct lane_pair_t {
    int<32> lo;
    int<32> hi;
}

control AggregationLanes(inout headers_t hdr, in bit<2> lane_op, in bit<32> cell, in bool harvest) {
@@PAIR_BEGIN
    @id({id}) Register<lane_pair_t, bit<32>>(SLOT_CELLS) lane_pair_{k};
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_{k}) write_{k} = {
        void apply(inout lane_pair_t value, out bit<32> lo) {
            value.lo = (int<32>)hdr.lanes.lane_{lo};
            value.hi = (int<32>)hdr.lanes.lane_{hi};
            lo = (bit<32>)value.lo;
        }
    };
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_{k}) add_{k} = {
        void apply(inout lane_pair_t value, out bit<32> lo) {
            value.lo = value.lo + (int<32>)hdr.lanes.lane_{lo};
            value.hi = value.hi + (int<32>)hdr.lanes.lane_{hi};
            lo = (bit<32>)value.lo;
        }
    };
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_{k}) max_{k} = {
        void apply(inout lane_pair_t value, out bit<32> lo) {
            if ((int<32>)hdr.lanes.lane_{lo} > value.lo) {
                value.lo = (int<32>)hdr.lanes.lane_{lo};
            }
            if ((int<32>)hdr.lanes.lane_{hi} > value.hi) {
                value.hi = (int<32>)hdr.lanes.lane_{hi};
            }
            lo = (bit<32>)value.lo;
        }
    };
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_{k}) read_hi_{k} = {
        void apply(inout lane_pair_t value, out bit<32> hi) {
            hi = (bit<32>)value.hi;
        }
    };
@@PAIR_END

    apply {
        if (hdr.lanes.isValid()) {  // the caller applies it to GRAD/ALLREDUCE only; p4test cannot see that
            if (harvest) {
@@PAIR_BEGIN
                hdr.lanes.lane_{hi} = read_hi_{k}.execute(cell);
@@PAIR_END
            } else {
                if (lane_op == LANE_READ) {
@@LANE_BEGIN
                    hdr.lanes.lane_{k} = 0;
@@LANE_END
                }
@@PAIR_BEGIN
                if (lane_op == LANE_WRITE) {
                    hdr.lanes.lane_{lo} = write_{k}.execute(cell);
                } else if (lane_op == LANE_MAX) {
                    hdr.lanes.lane_{lo} = max_{k}.execute(cell);
                } else {
                    hdr.lanes.lane_{lo} = add_{k}.execute(cell);
                }
@@PAIR_END
            }
        }
    }
}

#endif
