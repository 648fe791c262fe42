/* worker_bitmap (TNA): contributors seen per set (docs/protocol.md 6.3), both sets in one
 * register of pairs (lo = set 0, hi = set 1), as in SwitchML, so they take one stateful ALU.
 * Joining set s returns the set's bitmap before the join (`before`) and ORs the worker's bit in
 * (on a fresh cell: before = 0, bitmap = bit); the same action clears the bit in the other set. */
#ifndef LUWU_TNA_WORKER_BITMAP_P4
#define LUWU_TNA_WORKER_BITMAP_P4

struct bitmap_pair_t {
    bit<32> set0;
    bit<32> set1;
}

control WorkerBitmap(inout metadata_t meta) {
    @id(2) Register<bitmap_pair_t, bit<32>>(SLOTS) bitmap;

    RegisterAction<bitmap_pair_t, bit<32>, bit<32>>(bitmap) join0 = {
        void apply(inout bitmap_pair_t value, out bit<32> before) {
            before = value.set0;
            value.set0 = value.set0 | meta.worker_bit;
            value.set1 = value.set1 & meta.worker_clear;
        }
    };
    RegisterAction<bitmap_pair_t, bit<32>, bit<32>>(bitmap) join0_fresh = {
        void apply(inout bitmap_pair_t value, out bit<32> before) {
            before = 0;
            value.set0 = meta.worker_bit;
            value.set1 = value.set1 & meta.worker_clear;
        }
    };
    RegisterAction<bitmap_pair_t, bit<32>, bit<32>>(bitmap) join1 = {
        void apply(inout bitmap_pair_t value, out bit<32> before) {
            before = value.set1;
            value.set1 = value.set1 | meta.worker_bit;
            value.set0 = value.set0 & meta.worker_clear;
        }
    };
    RegisterAction<bitmap_pair_t, bit<32>, bit<32>>(bitmap) join1_fresh = {
        void apply(inout bitmap_pair_t value, out bit<32> before) {
            before = 0;
            value.set1 = meta.worker_bit;
            value.set0 = value.set0 & meta.worker_clear;
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
        } else {
            if (meta.fresh == 1) {
                before = join1_fresh.execute(meta.slot);
            } else {
                before = join1.execute(meta.slot);
            }
        }
        meta.dup = (before & meta.worker_bit) != 0 ? 1w1 : 1w0;
        meta.first = before == 0 ? 1w1 : 1w0;
    }
}

#endif
