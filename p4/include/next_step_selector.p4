/* next_step_selector (v1model): what leaves the switch, and where (docs/protocol.md 6.3-6.5).
 *
 * Aggregation (the slot state machine's outcome):
 *   !dup, remaining == 0  COMPLETED  emit the result
 *   !dup, remaining > 0   ABSORBED   nothing leaves
 *   dup,  remaining == 0  RESENT     emit the stored result again with RETX
 *   dup,  remaining > 0   drop DUPLICATE
 * A result carries the triggering header with the phase's exponent and
 * flags = (pkt.flags & (SET|MAX)) | stored SATURATED | RETX (resent). At a root (next_step 0)
 * it becomes AGG unicast to the node (GRAD) or RESULT multicast to the workers (ALLREDUCE; a
 * resent RESULT goes to its sender only), with worker = NODE. At an UPSTREAM switch it keeps
 * its type, gets worker = up_worker and goes to the parent on up_port.
 * Everything sent on up_port is addressed to dst = NODE (the node or the parent); multicast
 * copies are addressed per replica by the sender (egress). Delivery events: MULTICAST or
 * UNICAST; SATURATED when an emitted result carries SATURATED. The decision is left in
 * meta (emit, multicast, out_port, mcast_grp, dst) for the architecture to act on.
 */
#ifndef LUWU_NEXT_STEP_SELECTOR_P4
#define LUWU_NEXT_STEP_SELECTOR_P4

control NextStepSelector(inout headers_t hdr, inout metadata_t meta) {
    apply {
        bool up = false;        /* unicast on up_port to the node / parent */
        bool to_group = false;  /* multicast on the session's group */
        bool to_sender = false; /* unicast back to the sender (resent RESULT) */

        if (meta.op == OP_AGGREGATE) {
            bool result = false;
            bit<8> retx = 0;
            if (meta.dup == 0) {
                if (meta.remaining == 0) {
                    meta.event = EVENT_COMPLETED;
                    result = true;
                } else {
                    meta.event = EVENT_ABSORBED;
                }
            } else {
                if (meta.remaining == 0) {
                    meta.event = EVENT_RESENT;
                    result = true;
                    retx = FLAG_RETX;
                } else {
                    meta.drop_reason = DROP_DUPLICATE;
                }
            }
            if (result) {
                hdr.data.exponent = meta.exponent;
                hdr.luwu.flags = (hdr.luwu.flags & (FLAG_SET | FLAG_MAX)) | meta.stored_flags | retx;
                meta.saturated = meta.stored_flags != 0 ? 1w1 : 1w0;
                if (meta.next_step == NEXT_STEP_UPSTREAM) {
                    hdr.luwu.worker = meta.up_worker;
                    up = true;
                } else {
                    hdr.luwu.worker = NODE;
                    if (hdr.luwu.msg_type == TYPE_GRAD) {
                        hdr.luwu.msg_type = TYPE_AGG;
                        up = true;
                    } else {
                        hdr.luwu.msg_type = TYPE_RESULT;
                        if (retx != 0) {
                            to_sender = true;
                        } else {
                            to_group = true;
                        }
                    }
                }
            }
        } else if (meta.op == OP_FALLBACK) {
            /* The node aggregates it in software, so the sender's rank is kept. */
            meta.event = EVENT_FALLBACK;
            hdr.luwu.flags = hdr.luwu.flags | FLAG_FALLBACK;
            up = true;
        } else if (meta.op == OP_HEARTBEAT) {
            if (meta.hb_full == 1) {
                meta.event = EVENT_HB_ROUND;
                hdr.luwu.worker = meta.next_step == NEXT_STEP_UPSTREAM ? meta.up_worker : NODE;
                up = true;
            } else {
                meta.event = EVENT_HB_ABSORBED;
            }
        } else if (meta.op == OP_MULTICAST) {
            to_group = true;
        } else if (meta.op == OP_UNICAST) {
            /* A parent switch knows a rack only as its up_worker. */
            if (meta.next_step == NEXT_STEP_UPSTREAM) {
                hdr.luwu.worker = meta.up_worker;
            }
            up = true;
        }

        if (up) {
            meta.out_port = meta.up_port;
            meta.dst = NODE;
            meta.delivery = EVENT_UNICAST;
            meta.emit = 1;
        } else if (to_sender) {
            meta.out_port = meta.worker_port;
            meta.dst = meta.src_worker;
            meta.delivery = EVENT_UNICAST;
            meta.emit = 1;
        } else if (to_group && meta.mcast_grp == 0) {
            meta.drop_reason = DROP_NO_ROUTE;   /* group 0 means no multicast group */
        } else if (to_group) {
            meta.multicast = 1;
            meta.delivery = EVENT_MULTICAST;
            meta.emit = 1;
        }
    }
}

#endif
