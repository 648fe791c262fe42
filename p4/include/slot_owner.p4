/* slot_owner (v1model): which session instance last used each (set, slot) cell.
 *
 * docs/protocol.md 6.3: fresh = slot_owner[s] != epoch; slot_owner[s] = epoch. A new session
 * reusing slots has a new epoch, so its first packet on a cell finds stale bitmaps, counts
 * and sums and must treat them as empty; no controller ever clears a register.
 */
#ifndef LUWU_SLOT_OWNER_P4
#define LUWU_SLOT_OWNER_P4

control SlotOwner(inout metadata_t meta) {
    @id(1) register<bit<32>>(SLOT_CELLS) slot_owner;

    apply {
        bit<32> owner;
        slot_owner.read(owner, meta.cell);
        meta.fresh = owner != meta.epoch ? 1w1 : 1w0;
        slot_owner.write(meta.cell, meta.epoch);
    }
}

#endif
