"""Conformance runner (b): every vector against BMv2 running p4/luwu_v1model.p4.

Needs p4c and simple_switch_grpc on PATH and root (veth pairs, a network namespace); skipped
otherwise with what is missing. The program is the committed p4c build (tests/p4 recompiles it). Per vector: a fresh simple_switch_grpc (empty registers), the
pipeline and the vector's runtime JSON pushed over P4Runtime with finsy (device id 0), frames
sent and captured on veth host ends, counters read back over P4Runtime.
"""

from __future__ import annotations

import os

import pytest
from bmv2_harness import Bmv2, Ports, compiled_program, missing_binaries
from conformance_suite import all_vectors, run_vector
from conformance_topology import runtime_for

pytestmark = pytest.mark.bmv2

_MISSING = missing_binaries()
if _MISSING:
    pytest.skip(f"BMv2 conformance needs {' and '.join(_MISSING)} on PATH (p4c and behavioral-model)",
                allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("BMv2 conformance needs root for veth pairs and a network namespace", allow_module_level=True)

HOST_PORTS = 8  # workers 1-4, node 5, parent 6, an unknown host 7, a child switch 8 (conformance_topology)
VECTORS = all_vectors()


@pytest.fixture(scope="module")
def compiled():
    return compiled_program()


@pytest.fixture(scope="module")
def ports():
    p = Ports(HOST_PORTS)
    yield p
    p.close()


@pytest.mark.parametrize("vector", [pytest.param(v, id=v.name) for v in VECTORS])
def test_vector(vector, compiled, ports, tmp_path):
    bmv2_json, p4info = compiled
    sw = Bmv2(ports, bmv2_json, p4info, tmp_path)
    try:
        sw.program(runtime_for(vector.extra))
        run_vector(vector, lambda step: ports.exchange(step.port, step.frame, len(step.out)), sw.counters)
    finally:
        sw.close()
