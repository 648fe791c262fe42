/* classifier (v1model): the receiver. Validates a luwu packet, looks up its session and
 * sender, checks the slot pool and decides what the rest of the pipeline does (meta.op).
 * docs/protocol.md 3, 6.1, 6.3 (validation, pool check, fallback), 6.5 (directions).
 *
 * `parsed` is false when the architecture's parser stopped early (v1model parser_error,
 * TNA parser_err); `header_ok` is false when the header check (hcheck) does not match
 * (v1model verify_checksum, TNA a CRC16 Hash in ingress). Checks, in order, each ending the
 * packet with one drop reason:
 *   hcheck mismatch (any type: the parser reads bytes 8..31 of an unknown type as the data
 *   part, so its check covers the same 30 bytes) ......... BAD_CHECKSUM
 *   version != LUWU_VERSION .............................. BAD_VERSION
 *   type not 1..7 ........................................ BAD_TYPE
 *   parse failure, or a length that is not the type's ... MALFORMED
 *     (GRAD/AGG/ALLREDUCE/RESULT: 32 + 4 * LANES bytes, every dtype, and count <= LANES
 *      (FIXED16: count <= 2 * LANES, its int16 values, two a lane: docs/protocol.md 5.2): the
 *      whole chunks a count needs (docs/protocol.md 3.3), one chunk in a program of
 *      LANES <= LUWU_LANE_CHUNK (payload.p4),
 *      or 32 bytes with FLAG_ZERO for an INT32 GRAD/ALLREDUCE; HEARTBEAT: 32;
 *      PARAM: 32 + count * itemsize(dtype) + 4 (trailer), known dtype; PULL: 32 + 12 * count + 4)
 *   no `sessions` entry .................................. UNKNOWN_SESSION
 *   sender is a rank (not NODE) without a `workers` entry  UNKNOWN_WORKER
 *     (except a GRAD already marked FALLBACK: it passes through toward the node, but only
 *      from a port of a child switch of the session, a `child_ports` entry; else SPOOFED)
 *   a rank not on its entry's port, or NODE not on the session's up_port ... SPOOFED
 * then by type (NODE = the session's optimizer node, or the parent switch):
 *   GRAD from a rank: in the pool and no FALLBACK flag -> AGGREGATE, else FALLBACK
 *   ALLREDUCE from a rank: in the pool -> AGGREGATE, else drop FOREIGN_SLOT
 *   HEARTBEAT: from a rank -> HEARTBEAT round; from NODE -> MULTICAST
 *   PARAM from NODE, RESULT from NODE at an UPSTREAM switch -> MULTICAST
 *   PULL from a rank -> UNICAST toward the node / parent
 *   anything else (AGG; PARAM, RESULT from a rank; RESULT at a root; GRAD, ALLREDUCE or
 *   PULL claiming to be NODE) -> drop BAD_DIRECTION
 */
#ifndef LUWU_CLASSIFIER_P4
#define LUWU_CLASSIFIER_P4


control Classifier(inout headers_t hdr, inout metadata_t meta, in bool parsed, in bool header_ok,
                   in port_t ingress_port) {
    @id(3) action set_session(bit<32> pool_base, bit<32> pool_size, bit<8> num_workers,
                              bit<32> worker_mask, bit<32> epoch, bit<16> mcast_grp,
                              bit<8> next_step, port_t up_port, bit<16> up_worker) {
        meta.pool_base = pool_base;
        meta.pool_size = pool_size;
        meta.num_workers = num_workers;
        meta.worker_mask = worker_mask;
        meta.epoch = epoch;
        meta.mcast_grp = mcast_grp;
        meta.next_step = next_step;
        meta.up_port = up_port;
        meta.up_worker = up_worker;
        meta.session_known = 1;
    }

    @id(3) table sessions {
        key = { hdr.luwu.session: exact @name("session"); }
        actions = { set_session; @defaultonly NoAction; }
        default_action = NoAction();
        size = MAX_SESSIONS;
    }

    @id(4) action set_worker(bit<32> worker_bit, port_t port) {
        meta.worker_bit = worker_bit;
        meta.worker_port = port;
    }

    @id(4) table workers {
        key = {
            hdr.luwu.session: exact @name("session");
            hdr.luwu.worker: exact @name("worker");
        }
        actions = { set_worker; @defaultonly NoAction; }
        default_action = NoAction();
        size = WORKER_ENTRIES;
    }

    @id(8) action child_port() { }

    /* The ports of a session's child switches: a GRAD passing through toward the node (a rank
     * this switch does not know) is accepted from these only (docs/protocol.md 6.8). */
    @id(7) table child_ports {
        key = {
            hdr.luwu.session: exact @name("session");
            ingress_port: exact @name("port");
        }
        actions = { child_port; @defaultonly NoAction; }
        default_action = NoAction();
        size = CHILD_PORT_ENTRIES;
    }

    apply {
        meta.op = OP_NONE;
        bit<4> t = hdr.luwu.msg_type;
        bool aggregation = t == TYPE_GRAD || t == TYPE_AGG || t == TYPE_ALLREDUCE || t == TYPE_RESULT;
        bool from_node = hdr.luwu.worker == NODE;
        bit<32> count = (bit<32>)hdr.luwu.count;
        bit<32> payload = 0;  /* the type's payload bytes for this count */
        bool length_ok = true;
        if (aggregation && (hdr.luwu.flags & FLAG_ZERO) != 0) {
            /* header-only ZERO contribution: an INT32 GRAD or ALLREDUCE only (protocol.md 3.2) */
            payload = 0;
            length_ok = count <= LANES && (t == TYPE_GRAD || t == TYPE_ALLREDUCE) && hdr.data.dtype == DTYPE_INT32;
        } else if (aggregation) {
            payload = 4 * LANES;  /* every dtype: FIXED16 packs two int16 values a lane (5.2) */
            length_ok = count <= LANES || (hdr.data.dtype == DTYPE_FIXED16 && count <= 2 * LANES);
        } else if (t == TYPE_PARAM) {
            payload = param_payload_bytes(hdr.data.dtype, count) + TRAILER_LEN;
            length_ok = dtype_known(hdr.data.dtype);
        } else if (t == TYPE_PULL) {
            payload = pull_payload_bytes(count) + TRAILER_LEN;
        }
        length_ok = length_ok && (bit<32>)hdr.udp.length == LUWU_UDP_HEADERS_LEN + payload;

        if (!header_ok) {
            meta.drop_reason = DROP_BAD_CHECKSUM;
        } else if (hdr.luwu.version != LUWU_VERSION) {
            meta.drop_reason = DROP_BAD_VERSION;
        } else if (t == 0 || t > TYPE_PULL) {
            meta.drop_reason = DROP_BAD_TYPE;
        } else if (!parsed || !length_ok) {
            meta.drop_reason = DROP_MALFORMED;
        } else if (!sessions.apply().hit) {
            meta.drop_reason = DROP_UNKNOWN_SESSION;
        } else if (!from_node) {
            /* A GRAD already marked FALLBACK was aggregated nowhere: its worker is a rank of a
             * switch below, and it only passes through toward the node. */
            bool passing = t == TYPE_GRAD && (hdr.luwu.flags & FLAG_FALLBACK) != 0;
            if (workers.apply().hit) {
                /* source guard: a rank speaks only on the port its entry binds it to */
                if (ingress_port != meta.worker_port) {
                    meta.drop_reason = DROP_SPOOFED;
                }
            } else if (!passing) {
                meta.drop_reason = DROP_UNKNOWN_WORKER;
            } else if (!child_ports.apply().hit) {
                /* passing GRADs come up from child switches, never from a rank's own port */
                meta.drop_reason = DROP_SPOOFED;
            }
        } else if (ingress_port != meta.up_port) {
            /* the node (or the parent switch) speaks only on the session's up_port */
            meta.drop_reason = DROP_SPOOFED;
        }
        if (meta.drop_reason == 0) {
            meta.src_worker = hdr.luwu.worker;
            /* (slot - pool_base) < pool_size, unsigned: one compare covers both ends. */
            bool in_pool = false;
            if (t == TYPE_GRAD || t == TYPE_ALLREDUCE) {
                in_pool = hdr.data.slot - meta.pool_base < meta.pool_size && hdr.data.slot < SLOTS;
                meta.slot = hdr.data.slot;
                meta.set = (hdr.luwu.flags & FLAG_SET) != 0 ? 1w1 : 1w0;
                meta.cell = meta.set == 1 ? hdr.data.slot + SLOTS : hdr.data.slot;
            }
            if (t == TYPE_GRAD && !from_node) {
                if (in_pool && (hdr.luwu.flags & FLAG_FALLBACK) == 0) {
                    meta.op = OP_AGGREGATE;
                } else {
                    meta.op = OP_FALLBACK;
                }
            } else if (t == TYPE_ALLREDUCE && !from_node) {
                if (in_pool) {
                    meta.op = OP_AGGREGATE;
                } else {
                    meta.drop_reason = DROP_FOREIGN_SLOT;
                }
            } else if (t == TYPE_HEARTBEAT) {
                meta.op = from_node ? OP_MULTICAST : OP_HEARTBEAT;
            } else if (t == TYPE_PARAM && from_node) {
                meta.op = OP_MULTICAST;
            } else if (t == TYPE_RESULT && from_node && meta.next_step == NEXT_STEP_UPSTREAM) {
                meta.op = OP_MULTICAST;
            } else if (t == TYPE_PULL && !from_node) {
                meta.op = OP_UNICAST;
            } else {
                meta.drop_reason = DROP_BAD_DIRECTION;
            }
        }
    }
}

#endif
