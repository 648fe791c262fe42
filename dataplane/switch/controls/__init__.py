"""The pipeline's controls, one module per P4 control file (p4/include/<same name>.p4).

Each works on whole batches with numpy; register controls are applied in rounds in which every
register index appears at most once (see pipeline.py), which makes them exact per packet.

The slot state machine is the register controls in order -- slot_owner, worker_bitmap,
contributor_counter, exponent_max, aggregation_lanes -- run by ../pipeline.py `Pipeline._aggregate`,
its outcome routed by next_step_selector; the fast paths that mirror it are in ../fast/.
"""
