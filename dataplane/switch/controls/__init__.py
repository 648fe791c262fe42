"""The pipeline's controls, one module per P4 control file (p4/include/<same name>.p4).

Each works on whole batches with numpy; register controls are applied in rounds in which every
register index appears at most once (see pipeline.py), which makes them exact per packet.
"""
