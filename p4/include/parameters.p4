/* Build parameters of the luwu switch programs (v1model and TNA).
 *
 * Every value is a default that a build overrides with -DNAME=value, e.g.
 *   p4c --target bmv2 --arch v1model -DSLOTS=8192 ...
 * LUWU_UDP_PORT and MAX_SESSIONS default to luwu.dataplane.protocol (see constants.p4);
 * the lane count is not a -D parameter: it is baked into the generated payload.p4 and
 * aggregation_lanes.p4 (`luwu p4 generate --lanes N`).
 */
#ifndef LUWU_PARAMETERS_P4
#define LUWU_PARAMETERS_P4

/* Aggregation slots per set. Slot registers hold two sets (index set * SLOTS + slot); the
 * controller carves session pools out of [0, SLOTS). */
#ifndef SLOTS
#define SLOTS 4096
#endif
#define SLOT_CELLS (2 * SLOTS)

/* Entries of the `workers` table: (session, rank) pairs, up to MAX_CONTRIBUTORS per session. */
#ifndef WORKER_ENTRIES
#define WORKER_ENTRIES 32768
#endif

/* Entries of the `child_ports` table: (session, port of a child switch) pairs. */
#ifndef CHILD_PORT_ENTRIES
#define CHILD_PORT_ENTRIES 4096
#endif

/* Entries of the egress `endpoints` table: (session, rank or NODE) pairs. */
#ifndef ENDPOINT_ENTRIES
#define ENDPOINT_ENTRIES 32768
#endif

/* Entries of the `ipv4_lpm` routing table. */
#ifndef ROUTES
#define ROUTES 1024
#endif

/* Entries of each drop simulator table (one per switch port). */
#ifndef PORT_ENTRIES
#define PORT_ENTRIES 512
#endif

#endif
