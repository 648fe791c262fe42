"""Conformance runner (a'): the software switch programmed over P4Runtime, as BMv2 is.

Same vectors, same frames through `process_frames`, but the runtime JSON goes through
luwu.dataplane.p4runtime.bmv2 (finsy entities, forced pipeline, device id 0) to the software switch's P4Runtime
server, and the counters come back through P4Runtime reads: the BMv2 runner's control path
(entity encoding, counter families, the committed P4Info) checked on a machine without BMv2.
"""

from __future__ import annotations

import pytest
from bmv2_harness import P4RuntimeSession
from conformance_suite import all_vectors, run_vector
from conformance_topology import LANES, SLOTS, UDP_PORT, runtime_for

from luwu.dataplane.p4runtime import device_config_marker

switch = pytest.importorskip("luwu.dataplane.switch", reason="the software switch (dataplane/switch) is not importable")
p4rt = pytest.importorskip("luwu.dataplane.switch.p4runtime_server", reason="no software switch P4Runtime server")

VECTORS = all_vectors()


@pytest.fixture
def device_config(tmp_path):
    path = tmp_path / "device_config.bin"
    path.write_bytes(device_config_marker(LANES, SLOTS))
    return path


@pytest.mark.parametrize("vector", [pytest.param(v, id=v.name) for v in VECTORS])
def test_vector_over_p4runtime(vector, device_config):
    from luwu.p4 import P4INFO_TXTPB

    sw = switch.SoftwareSwitch(switch.SwitchConfig(lanes=LANES, slots=SLOTS, udp_port=UDP_PORT))
    server = p4rt.serve(sw, "127.0.0.1:0", P4INFO_TXTPB)
    session = None
    try:
        session = P4RuntimeSession(server.address, P4INFO_TXTPB, device_config)
        session.program(runtime_for(vector.extra))
        run_vector(vector, lambda step: sw.process_frames([(step.port, step.frame)]), session.counters)
    finally:
        if session is not None:
            session.close()
        server.stop(None)
