/* slot_owner (TNA): which session instance last used each (set, slot) cell.
 * Same state machine as include/slot_owner.p4 (docs/protocol.md 6.3), as one register action:
 * fresh = slot_owner[cell] != epoch; slot_owner[cell] = epoch. */
#ifndef LUWU_TNA_SLOT_OWNER_P4
#define LUWU_TNA_SLOT_OWNER_P4

control SlotOwner(inout metadata_t meta) {
    @id(1) Register<bit<32>, bit<32>>(SLOT_CELLS) slot_owner;
    RegisterAction<bit<32>, bit<32>, bit<1>>(slot_owner) claim = {
        void apply(inout bit<32> owner, out bit<1> fresh) {
            if (owner != meta.epoch) {
                fresh = 1;
            } else {
                fresh = 0;
            }
            owner = meta.epoch;
        }
    };

    apply {
        meta.fresh = claim.execute(meta.cell);
    }
}

#endif
