"""Switch port addresses through the controller: a software switch with shared-memory ports
registers them as shm:/dev/shm/NAME (`software_switch_record`), the controller accepts them, plans
the job and hands workers and nodes a `Wiring(transport="shm")` on the switch's rings; a malformed
address is refused at registration with one line naming the port and the syntax."""

from __future__ import annotations

import pytest
from ctl_helpers import job, node, star_switch

from luwu.controller.client import ControllerRefused, software_switch_record
from luwu.controller.registry import validate_switch
from luwu.dataplane.net.shm_ring import supported
from luwu.dataplane.session import parse_port_address


@pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")
def test_shm_ports_are_registered_planned_and_handed_to_workers_and_nodes(controller, software_switch):
    _, client = controller
    sw, address = software_switch()
    prefixes = {p: sw.attach_shm(p) for p in (1, 2)}
    sw.attach_udp(3, ("127.0.0.1", 0))  # one UDP port beside them: the node's
    try:
        record = software_switch_record(sw, "s1", address, nodes={3: "n0"})
        assert {p.number: p.udp_address for p in record.ports}[1] == f"shm:{prefixes[1]}"
        client.register_node(node("n0"))
        client.register_switch(record)
        created, token = client.create_job(job("a", 2, [1000, 500]))
        for rank in range(2):
            plan, _ = client.join_job(created.job_id, rank, "127.0.0.1:40000", token)
            w = plan.wiring
            assert (w.transport, w.switch, w.switch_port) == ("shm", (prefixes[w.switch_port], 0), rank + 1)
        (node_plan,) = client.node_plans(created.job_id, "n0", token=token)
        assert node_plan.wiring.transport == "udp" and node_plan.wiring.switch == sw.ports[3].address
    finally:
        sw.stop()


@pytest.mark.parametrize("bad", ["shm:/tmp/luwu-sw-1", "shm:/dev/shm/../etc/passwd", "shm:/dev/shm/.x", "shm:",
                                 "localhost", "127.0.0.1:0", "/dev/shm/luwu-sw-1-0-p1"])
def test_a_malformed_port_address_is_refused_in_one_line(controller, bad):
    _, client = controller
    sw = star_switch("s1", "127.0.0.1:50001", 2, [])
    sw.ports[0].udp_address = bad
    with pytest.raises(ValueError, match=r"switch s1 port 1: udp_address") as direct:
        validate_switch(sw)
    with pytest.raises(ControllerRefused) as err:
        client.register_switch(sw)
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert str(direct.value) in err.value.message and "\n" not in err.value.message
    assert ("shm:/dev/shm/NAME" in err.value.message), err.value.message


def test_port_address_syntax_round_trips():
    assert parse_port_address("shm:/dev/shm/luwu-sw-7-0-p1", "p") == ("shm", ("/dev/shm/luwu-sw-7-0-p1", 0))
    assert parse_port_address("127.0.0.1:9001", "p") == ("udp", ("127.0.0.1", 9001))
