/* zero_lanes: a header-only ZERO contribution becomes the packet it stands for.
 * docs/protocol.md 3.2 (ZERO), 6.3.
 *
 * A GRAD or ALLREDUCE with FLAG_ZERO (INT32 only) carries the 32-byte header and no lanes: its
 * lanes are all zero, and the sender saves their bytes on its upstream link (broadcast and
 * all_gather fill most of every rank's buffer with zeros). Once the classifier sent it on
 * (aggregate or fallback), the lanes header becomes valid with zeros, ZERO is cleared and the
 * IPv4/UDP lengths grow by the lanes: the slot state machine is unchanged, and whatever the
 * packet turns into (a result emitted with the stored lanes, a resend, a fallback GRAD toward
 * the node) leaves full-sized with consistent lengths (the IPv4 checksum is computed on the
 * way out). Mirrored by dataplane/switch/controls/zero_lanes.py.
 */
#ifndef LUWU_ZERO_LANES_P4
#define LUWU_ZERO_LANES_P4

const bit<16> LANES_BYTES = 4 * LANES;

control ZeroLanes(inout headers_t hdr, in metadata_t meta) {
    apply {
        if ((hdr.luwu.flags & FLAG_ZERO) != 0 && (meta.op == OP_AGGREGATE || meta.op == OP_FALLBACK)) {
            fill_zero_lanes(hdr.lanes);
            hdr.luwu.flags = hdr.luwu.flags & ~FLAG_ZERO;
            hdr.ipv4.total_len = hdr.ipv4.total_len + LANES_BYTES;
            hdr.udp.length = hdr.udp.length + LANES_BYTES;
        }
    }
}

#endif
