/* contributor_counter (TNA): the countdown of missing contributors (docs/protocol.md 6.3):
 * first -> num_workers - 1, duplicate -> unchanged, otherwise -> minus one. */
#ifndef LUWU_TNA_CONTRIBUTOR_COUNTER_P4
#define LUWU_TNA_CONTRIBUTOR_COUNTER_P4

control ContributorCounter(inout metadata_t meta) {
    @id(4) Register<bit<32>, bit<32>>(SLOT_CELLS) contributors;

    RegisterAction<bit<32>, bit<32>, bit<32>>(contributors) start = {
        void apply(inout bit<32> value, out bit<32> remaining) {
            value = meta.first_remaining;
            remaining = value;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(contributors) keep = {
        void apply(inout bit<32> value, out bit<32> remaining) {
            remaining = value;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(contributors) count_down = {
        void apply(inout bit<32> value, out bit<32> remaining) {
            value = value - 1;
            remaining = value;
        }
    };

    apply {
        if (meta.first == 1) {
            meta.remaining = start.execute(meta.cell);
        } else if (meta.dup == 1) {
            meta.remaining = keep.execute(meta.cell);
        } else {
            meta.remaining = count_down.execute(meta.cell);
        }
    }
}

#endif
