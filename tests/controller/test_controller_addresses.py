"""Every address an RPC takes goes through controller/addresses.py (the rules are in
proto/controller.proto): data-plane addresses are IPv4 only and a refused one stores nothing;
addresses the controller dials may be IPv4, a host name or a bracketed IPv6 address, stored and
dialled as given. Against a real in-process controller over gRPC (issue 27: JoinJob with an IPv6
endpoint used to answer OK and store an address that was neither the old one nor the new one)."""

from __future__ import annotations

import grpc
import pytest
from ctl_helpers import job, node, star_switch
from fake_p4runtime import serve_fake

from luwu.controller.addresses import check_control_address, check_data_address, check_port_address
from luwu.controller.client import ControllerClient, ControllerRefused

BAD_ENDPOINTS = {
    "[::1]:9100": "IPv6 is not accepted",
    "::1:9100": "IPv6 address without brackets",
    "[2001:db8::7]:9100": "IPv6 is not accepted",
    "localhost:9100": "a host name is not accepted",
    "0.0.0.0:9100": "0.0.0.0 names no host",
    "999.0.0.1:9100": "is not an IPv4 address",
    "010.0.0.1:9100": "is not an IPv4 address",
    "127.0.0.1:0": "must be 1..65535",
    "127.0.0.1:65536": "must be 1..65535",
    "127.0.0.1:\uff19\uff11": "must be 1..65535",  # full-width digits: str.isdigit() says yes
    "127.0.0.1": "has no port",
    "": "is empty",
}


def endpoints_of(bc, switch: str, rank: int) -> list[tuple[int, int]]:
    return [(e.action_params["dst_ip"], e.action_params["dst_udp"]) for e in bc.server.core.desired(switch).entries
            if e.table == "endpoints" and e.match["dst"] == rank]


@pytest.fixture
def planned(controller, fake_switch):
    """A two-rank job planned on a fake switch: (BackgroundController, admin client, job id, job token)."""
    bc, admin = controller
    _, address = fake_switch()
    admin.register_node(node("n0"))
    admin.register_switch(star_switch("s1", address, 2, ["n0"]))
    created, token = admin.create_job(job("a", 2, [100]))
    return bc, admin, created.job_id, token


def test_join_job_refuses_what_the_data_plane_cannot_hold(planned):
    bc, admin, job_id, token = planned
    before = endpoints_of(bc, "s1", 0)
    with ControllerClient(bc.address, token) as worker:
        for endpoint, why in BAD_ENDPOINTS.items():
            with pytest.raises(ControllerRefused) as err:
                worker.join_job(job_id, 0, endpoint)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, endpoint
            assert why in err.value.message and "A.B.C.D:PORT" in err.value.message, (endpoint, err.value.message)
    assert bc.server.core.store.job(job_id).joined == {}  # nothing stored, the switch entries untouched
    assert endpoints_of(bc, "s1", 0) == before
    assert list(admin.job(job_id).joined_ranks) == []


def test_an_ipv4_endpoint_round_trips_and_an_ipv6_one_leaves_it_alone(planned):
    bc, admin, job_id, token = planned
    with ControllerClient(bc.address, token) as worker:
        plan, _ = worker.join_job(job_id, 0, "127.0.0.2:9100")
        assert tuple(plan.wiring.local) == ("127.0.0.2", 9100)
    assert bc.server.core.store.job(job_id).joined == {0: "127.0.0.2:9100"}
    assert endpoints_of(bc, "s1", 0) and set(endpoints_of(bc, "s1", 0)) == {(0x7F000002, 9100)}
    assert list(admin.job(job_id).joined_ranks) == [0]
    with pytest.raises(ControllerRefused) as err:  # the admin's repoint to IPv6 (before: OK, and a mangled entry)
        admin.join_job(job_id, 0, "[::1]:9200")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert bc.server.core.store.job(job_id).joined == {0: "127.0.0.2:9100"}
    assert set(endpoints_of(bc, "s1", 0)) == {(0x7F000002, 9100)}
    admin.join_job(job_id, 0, "127.0.0.3:9200")  # an IPv4 repoint is stored exactly
    assert set(endpoints_of(bc, "s1", 0)) == {(0x7F000003, 9200)}


def test_a_switch_dialled_over_ipv6_is_registered_programmed_and_listed_as_given(controller):
    _, admin = controller
    fake, handle = serve_fake("[::1]:0")
    try:
        assert handle.address.startswith("[::1]:")
        sw = star_switch("s6", handle.address, 2, [])
        sw.metrics_address = "[::1]:9100"
        assert admin.register_switch(sw).message == "registered and programmed"
        (listed,) = admin.switches()
        assert (listed.p4runtime_address, listed.metrics_address) == (handle.address, "[::1]:9100")
        assert listed.programmed == "ok" and fake.pipeline_sets >= 1  # dialled at the address as given
    finally:
        handle.stop()
    unbracketed = star_switch("s7", "::1:" + handle.address.rpartition(":")[2], 2, [])
    with pytest.raises(ControllerRefused) as err:
        admin.register_switch(unbracketed)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "without brackets" in err.value.message
    assert [s.name for s in admin.switches()] == ["s6"]


@pytest.mark.parametrize("field,value,why", [
    ("data_address", "[::1]:9000", "IPv6 is not accepted"),
    ("data_address", "localhost:9000", "a host name is not accepted"),
    ("udp_address", "[::1]:9000", "IPv6 is not accepted"),
    ("udp_address", "switch-1:9000", "a host name is not accepted"),
])
def test_data_plane_registrations_are_ipv4_only(controller, field, value, why):
    _, admin = controller
    if field == "data_address":
        call, record = admin.register_node, node("n9")
        record.data_address = value
    else:
        call, record = admin.register_switch, star_switch("s9", "127.0.0.1:1", 1, [])
        record.ports[0].udp_address = value
    with pytest.raises(ControllerRefused) as err:
        call(record)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert why in err.value.message and "shm:/dev/shm/NAME" in err.value.message, err.value.message
    assert admin.nodes() == [] and admin.switches() == []


@pytest.mark.parametrize("text,expected", [
    ("10.1.2.3:50051", ("10.1.2.3", 50051)),
    ("localhost:9559", ("localhost", 9559)),
    ("switch-1.rack-a.example:9559", ("switch-1.rack-a.example", 9559)),
    ("[::1]:50051", ("::1", 50051)),
    ("[2001:db8::1]:1", ("2001:db8::1", 1)),
])
def test_control_addresses_accepted(text, expected):
    assert check_control_address(text, "p4runtime_address") == expected


@pytest.mark.parametrize("text,why", [
    ("::1:50051", "without brackets"),
    ("[::1]", "must be"),
    ("[::1]50051", "must be"),
    ("[not-v6]:1", "is not an IPv6 address"),
    ("1.2.3:1", "is not an IPv4 address"),
    ("256.1.1.1:1", "is not an IPv4 address"),
    ("-sw:1", "is not a host name"),
    ("sw_1:1", "is not a host name"),
    ("a..b:1", "is not a host name"),
    ("sw 1:1", "is not a host name"),
    ("sw:0", "must be 1..65535"),
    ("sw:+1", "must be 1..65535"),
    ("sw", "has no port"),
])
def test_control_addresses_refused(text, why):
    with pytest.raises(ValueError, match="p4runtime_address") as err:
        check_control_address(text, "p4runtime_address")
    assert why in str(err.value) and "[IPV6]:PORT" in str(err.value)


def test_data_and_port_addresses():
    assert check_data_address("192.168.0.9:7000", "endpoint_address") == ("192.168.0.9", 7000)
    assert check_port_address("shm:/dev/shm/luwu-sw-1-0-p1", "udp_address") == ("shm", ("/dev/shm/luwu-sw-1-0-p1", 0))
    assert check_port_address("127.0.0.1:9001", "udp_address") == ("udp", ("127.0.0.1", 9001))
