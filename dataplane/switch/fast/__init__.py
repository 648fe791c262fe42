"""The software switch's fast paths: each does, for turns of one kind, exactly what a reference
stage does (same outputs, registers, counters, ring contents), with fewer numpy calls, and
declines (returns False or None, having changed nothing) whatever it does not finish, which
then takes the reference. The reference is the pipeline of `../pipeline.py` and its controls
(`../controls/`), and `SoftwareSwitch.emit` in `../switch.py`; the slot state machine is
`Pipeline._aggregate` (one round of `controls/slot_owner`, `worker_bitmap`, `contributor_counter`,
`exponent_max`, `aggregation_lanes`).

| module | mirrors | takes |
|---|---|---|
| `classify_few` | `controls/classifier.py` `classify` | turns of up to `pipeline.SMALL_TURN` packets |
| `route_few` | `pipeline.py` `Pipeline.run` after the slot registers (`heartbeat_table.apply`, `next_step_selector.select`, `sender.expand`) | the same small turns, no fallback GRAD, no Ethernet frame, no egress loss |
| `aggregate_groups` | `pipeline.py` `Pipeline._aggregate` (the slot state machine, in rounds) | the contributions to one slot in a batch, folded in one pass when that equals the rounds |
| `aggregate_turn` | `pipeline.py` `Pipeline.run` (parser, classifier, zero_lanes, `Pipeline._aggregation`, `select`, `expand`) | a shm turn of 2+ contributions (`pipeline.AGGREGATE_TURN`) that all fold in one pass (`aggregate_groups`' kernel) |
| `forward_one` | `pipeline.py` `Pipeline.run` + `switch.py` `SoftwareSwitch.emit` | a shm turn of one heartbeat, PULL or multicast |
| `aggregate_one` | `pipeline.py` `Pipeline.run` (with `Pipeline._aggregate`) + `switch.py` `SoftwareSwitch.emit` | a shm turn of one GRAD or ALLREDUCE |
| `emit_shm` | `switch.py` `SoftwareSwitch.emit` | a shm turn's up to 32 copies, all to shm ports without impairments; or more, all into one multicast pool |

Each module's docstring starts with `Mirrors:` (the reference files and functions, which
tests/switch/test_switch_fast_mirrors.py imports) and `Declines:` (when it leaves the turn to the
reference). The tests comparing each with its reference: tests/switch/test_switch_small_turns.py
(classify_few, route_few), test_switch_phase_groups_kernel.py and test_switch_vectorised_equivalence.py
(aggregate_groups), test_switch_lone_turns.py (forward_one, aggregate_one), test_switch_shm_arena.py
(emit_shm), test_switch_aggregate_turns.py (aggregate_turn, emit_shm's `emit_pooled`).
"""
