/* drop_simulator (v1model): per-port loss for testing loss recovery (docs/protocol.md 6.1).
 *
 * A port's threshold t drops a packet when a uniform 32-bit random number is < t, so
 * t = p * 2^32: 0 never drops, 0xFFFFFFFF drops all but one packet in 2^32. Ports without an
 * entry never drop. Ingress applies it to every packet as it arrives, egress to every copy
 * as it leaves (each multicast replica separately), both before anything else: the
 * simulated link loses a packet whatever it holds. Drop reason SIMULATED_LOSS.
 * The architecture supplies the port and a fresh 32-bit random draw (v1model `random()`,
 * TNA `Random<bit<32>>`), so this file serves both programs.
 */
#ifndef LUWU_DROP_SIMULATOR_P4
#define LUWU_DROP_SIMULATOR_P4

control IngressDropSimulator(inout metadata_t meta, in port_t port, in bit<32> draw) {
    @id(1) action set_ingress_drop_rate(bit<32> threshold) {
        meta.drop_threshold = threshold;
    }

    @id(1) table ingress_drop_sim {
        key = { port: exact @name("port"); }
        actions = { set_ingress_drop_rate; @defaultonly NoAction; }
        default_action = NoAction();
        size = PORT_ENTRIES;
    }

    apply {
        meta.drop_threshold = 0;
        if (ingress_drop_sim.apply().hit) {
            if (draw < meta.drop_threshold) {
                meta.drop_reason = DROP_SIMULATED_LOSS;
            }
        }
    }
}

control EgressDropSimulator(inout metadata_t meta, in port_t port, in bit<32> draw) {
    @id(2) action set_egress_drop_rate(bit<32> threshold) {
        meta.drop_threshold = threshold;
    }

    @id(2) table egress_drop_sim {
        key = { port: exact @name("port"); }
        actions = { set_egress_drop_rate; @defaultonly NoAction; }
        default_action = NoAction();
        size = PORT_ENTRIES;
    }

    apply {
        meta.drop_threshold = 0;
        if (egress_drop_sim.apply().hit) {
            if (draw < meta.drop_threshold) {
                meta.drop_reason = DROP_SIMULATED_LOSS;
            }
        }
    }
}

#endif
