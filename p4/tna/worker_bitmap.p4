/* worker_bitmap (TNA): contributors seen per set (docs/protocol.md 6.3), one register per set.
 * The set being joined runs join (before = value; value |= bit) or, on a fresh cell,
 * join_fresh (before = 0; value = bit); the other set runs leave (value &= ~bit). */
#ifndef LUWU_TNA_WORKER_BITMAP_P4
#define LUWU_TNA_WORKER_BITMAP_P4

control WorkerBitmap(inout metadata_t meta) {
    @id(2) Register<bit<32>, bit<32>>(SLOTS) bitmap_set0;
    @id(3) Register<bit<32>, bit<32>>(SLOTS) bitmap_set1;

    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_set0) join0 = {
        void apply(inout bit<32> value, out bit<32> before) {
            before = value;
            value = value | meta.worker_bit;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_set0) join0_fresh = {
        void apply(inout bit<32> value, out bit<32> before) {
            before = 0;
            value = meta.worker_bit;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_set0) leave0 = {
        void apply(inout bit<32> value) {
            value = value & meta.worker_clear;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_set1) join1 = {
        void apply(inout bit<32> value, out bit<32> before) {
            before = value;
            value = value | meta.worker_bit;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_set1) join1_fresh = {
        void apply(inout bit<32> value, out bit<32> before) {
            before = 0;
            value = meta.worker_bit;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(bitmap_set1) leave1 = {
        void apply(inout bit<32> value) {
            value = value & meta.worker_clear;
        }
    };

    apply {
        bit<32> before;
        if (meta.set == 0) {
            if (meta.fresh == 1) {
                before = join0_fresh.execute(meta.slot);
            } else {
                before = join0.execute(meta.slot);
            }
            leave1.execute(meta.slot);
        } else {
            if (meta.fresh == 1) {
                before = join1_fresh.execute(meta.slot);
            } else {
                before = join1.execute(meta.slot);
            }
            leave0.execute(meta.slot);
        }
        meta.dup = (before & meta.worker_bit) != 0 ? 1w1 : 1w0;
        meta.first = before == 0 ? 1w1 : 1w0;
    }
}

#endif
