/* contributor_counter (v1model): the countdown of contributors a slot still misses.
 *
 * docs/protocol.md 6.3:
 *   remaining = first ? num_workers - 1 : dup ? contributors[s] : contributors[s] - 1
 * It reaches 0 exactly when the last distinct contributor arrives, and a duplicate leaves
 * it alone, so a duplicate of a completed phase (remaining == 0) is told apart from one of a
 * phase still in progress.
 */
#ifndef LUWU_CONTRIBUTOR_COUNTER_P4
#define LUWU_CONTRIBUTOR_COUNTER_P4

control ContributorCounter(inout metadata_t meta) {
    @id(4) register<bit<32>>(SLOT_CELLS) contributors;

    apply {
        bit<32> stored;
        contributors.read(stored, meta.cell);
        if (meta.first == 1) {
            meta.remaining = (bit<32>)meta.num_workers - 1;
        } else if (meta.dup == 1) {
            meta.remaining = stored;
        } else {
            meta.remaining = stored - 1;
        }
        contributors.write(meta.cell, meta.remaining);
    }
}

#endif
