"""The optimizer node's exceptions: every rejection of caller input is a `ValueError` subclass
that says what to fix, so a daemon can catch `ValueError` around untrusted input and keep running.

Rejected input never changes the node's state; each rejection is also counted in `stats()`
under `rejected[<reason>]`.
"""

from __future__ import annotations


class OptimizerInputError(ValueError):
    """Base of every rejection of caller input (bad spec, bad gradient, bad id)."""

    reason = "invalid"


class UnknownJob(OptimizerInputError, KeyError):
    reason = "unknown_job"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownLayer(OptimizerInputError, KeyError):
    reason = "unknown_layer"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class BadGradient(OptimizerInputError):
    """Wrong dtype, shape or size, or a non-contiguous buffer."""

    reason = "bad_gradient"


class NonFiniteGradient(BadGradient):
    reason = "non_finite"


class StepOutOfOrder(OptimizerInputError):
    reason = "step_out_of_order"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupted or truncated: refused, never loaded."""


class NodeFailed(RuntimeError):
    """An internal failure (e.g. the disk) stopped the pipeline; the node must be restored from a checkpoint."""
