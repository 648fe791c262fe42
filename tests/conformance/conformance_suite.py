"""Every conformance vector, and the checks both runners (software switch, BMv2) apply.

A runner supplies `send(step) -> [(port, frame)]` (the step's one frame through a switch
that started fresh with the vector's runtime JSON) and `counters() -> {kind: {code: packets}}`; the
suite compares outputs after every step and counter deltas at the end, with readable diffs.
"""

from __future__ import annotations

from collections.abc import Callable

import conformance_vectors_messages
import conformance_vectors_slots
import conformance_vectors_v2
import conformance_vectors_zero
from conformance_frames import compare_outputs
from conformance_vectors import COUNTER_KINDS, Step, Vector


def all_vectors() -> list[Vector]:
    return [make() for make in conformance_vectors_slots.VECTORS + conformance_vectors_messages.VECTORS
            + conformance_vectors_zero.VECTORS + conformance_vectors_v2.VECTORS]


def packets(snapshot: dict) -> dict[str, dict[int, int]]:
    """{kind: {code: packets}} from a switch's counter snapshot ({code: (packets, bytes)} per kind)."""
    out = {}
    for kind in COUNTER_KINDS:
        table = snapshot.get(kind, {})
        out[kind] = {int(code): int(v[0] if isinstance(v, (tuple, list)) else v) for code, v in table.items()}
    return out


def counter_problems(before: dict, after: dict, vector: Vector) -> list[str]:
    want = vector.expected_counters()
    problems = []
    for kind in COUNTER_KINDS:
        codes = set(before[kind]) | set(after[kind]) | set(want[kind])
        for code in sorted(codes):
            delta = after[kind].get(code, 0) - before[kind].get(code, 0)
            if delta != want[kind].get(code, 0):
                problems.append(f"  {kind}[{_name(kind, code)}]: moved by {delta}, want {want[kind].get(code, 0)}")
    return problems


def _name(kind: str, code: int) -> str:
    from luwu.dataplane.protocol import DropReason, Event, MsgType

    enum = {"drops": DropReason, "events": Event, "rx_types": MsgType}.get(kind)
    try:
        return f"{code} {enum(code).name}" if enum else str(code)
    except ValueError:
        return str(code)


def run_vector(vector: Vector, send: Callable[[Step], list], counters: Callable[[], dict]) -> None:
    """Run one vector; AssertionError with every difference found."""
    before = packets(counters())
    for n, step in enumerate(vector.steps):
        got = send(step)
        problems = compare_outputs(got, step.out)
        if problems:
            raise AssertionError(f"{vector.name} step {n} (port {step.port}: {step.note or 'no note'}):\n"
                                 + "\n".join(problems))
    problems = counter_problems(before, packets(counters()), vector)
    if problems:
        raise AssertionError(f"{vector.name}: counters (docs/protocol.md 6.6):\n" + "\n".join(problems))
