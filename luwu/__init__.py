"""luwu: in-network aggregation and optimizer offload for PyTorch data-parallel training.

The import package gathers the project's parts (each a top-level folder of the repository):
`luwu.dataplane` (wire protocol, software switch, SmartNIC engine, optimizer node),
`luwu.controller`, `luwu.worker` (torch.distributed backend, model-in-network training),
`luwu.proto`, `luwu.mininet` and `luwu.p4`. See docs/architecture.md.
"""

__version__ = "0.1.0"
