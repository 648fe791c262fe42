"""Conformance runner (a): every vector against the software switch, in process.

A fresh `SoftwareSwitch` per vector, programmed with the vector's runtime JSON; packets go
through `process_frames` one at a time, so each step's outputs are exactly that packet's.
"""

from __future__ import annotations

import pytest
from conformance_suite import all_vectors, run_vector
from conformance_topology import LANES, SLOTS, UDP_PORT, runtime_for

switch = pytest.importorskip("luwu.dataplane.switch", reason="the software switch (dataplane/switch) is not importable")

# vector name -> why the software switch is known to disagree with the spec (strict xfail).
DISAGREES: dict[str, str] = {}

VECTORS = all_vectors()


def _params() -> list:
    return [pytest.param(v, id=v.name, marks=[pytest.mark.xfail(strict=True, reason=DISAGREES[v.name])]
                         if v.name in DISAGREES else []) for v in VECTORS]


@pytest.mark.parametrize("vector", _params())
def test_vector(vector):
    sw = switch.SoftwareSwitch(switch.SwitchConfig(lanes=LANES, slots=SLOTS, udp_port=UDP_PORT))
    sw.load_runtime(runtime_for(vector.extra))
    run_vector(vector, lambda step: sw.process_frames([(step.port, step.frame)]), sw.counters)
