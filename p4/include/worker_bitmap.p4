/* worker_bitmap (v1model): which contributors a slot has seen, one bitmap per set.
 *
 * docs/protocol.md 6.3:
 *   before = fresh ? 0 : bitmap[set][slot]; bitmap[set][slot] = before | bit;
 *   bitmap[!set][slot] &= ~bit; dup = (before & bit) != 0; first = before == 0.
 * Clearing the sender's bit in the other set is what makes slots clean themselves: when a
 * worker moves to the next phase of a slot, the phase it leaves forgets it (SwitchML).
 * Both registers take exactly one read and one write per pass.
 */
#ifndef LUWU_WORKER_BITMAP_P4
#define LUWU_WORKER_BITMAP_P4

control WorkerBitmap(inout metadata_t meta) {
    @id(2) register<bit<32>>(SLOTS) bitmap_set0;
    @id(3) register<bit<32>>(SLOTS) bitmap_set1;

    apply {
        bit<32> map0;
        bit<32> map1;
        bit<32> before;
        bitmap_set0.read(map0, meta.slot);
        bitmap_set1.read(map1, meta.slot);
        if (meta.set == 0) {
            before = meta.fresh == 1 ? 32w0 : map0;
            map0 = before | meta.worker_bit;
            map1 = map1 & ~meta.worker_bit;
        } else {
            before = meta.fresh == 1 ? 32w0 : map1;
            map1 = before | meta.worker_bit;
            map0 = map0 & ~meta.worker_bit;
        }
        bitmap_set0.write(meta.slot, map0);
        bitmap_set1.write(meta.slot, map1);
        meta.dup = (before & meta.worker_bit) != 0 ? 1w1 : 1w0;
        meta.first = before == 0 ? 1w1 : 1w0;
    }
}

#endif
