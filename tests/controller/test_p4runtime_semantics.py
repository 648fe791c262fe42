"""The software switch's P4Runtime server where BMv2 (PI) fixes a behaviour the spec leaves open
(dataplane/switch/p4runtime_semantics.py), driven by stock finsy and raw P4Runtime messages:
finsy's `delete_all()` (it resets every default entry with a MODIFY without action), a default
entry reset to the P4 program's initial default action, replicas written with the deprecated
`egress_port` read back in that field, and refusals that name the spec's section."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from ctl_helpers import LANES, SLOTS
from finsy import P4MulticastGroupEntry, P4Schema, P4TableAction, P4TableEntry, Switch, SwitchOptions
from finsy.proto import U128, p4r, p4r_grpc
from test_p4runtime_audit import _program

from luwu.controller.programmer import SwitchProgrammer, SwitchTarget
from luwu.dataplane.p4runtime import device_config_marker

_LOOP = asyncio.new_event_loop()  # one loop for the module: grpc.aio binds its poller to the first loop
TIMEOUT = 30.0
ELECTION = 1000  # above finsy's default (10): primary even while the stream finsy set the pipeline on still closes


def run(coro):
    return _LOOP.run_until_complete(asyncio.wait_for(coro, TIMEOUT))


def _finsy(address: str, p4info) -> Switch:
    return Switch("s1", address, SwitchOptions(p4info=p4info, p4blob=device_config_marker(LANES, SLOTS), device_id=0))


def test_finsy_delete_all_empties_the_switch_and_resets_default_entries(software_switch, p4info):
    sw, address = software_switch()
    run(SwitchProgrammer(p4info, lambda t: device_config_marker(LANES, SLOTS), TIMEOUT).program(
        SwitchTarget("s1", address, 0), _program()))
    assert sw.tables.entries("sessions") and sw.tables.multicast_groups()

    async def body():
        async with _finsy(address, p4info) as fs:
            # a default route, then finsy's delete_all(): every entry, group and default goes
            await fs.write([~P4TableEntry("ipv4_lpm", action=P4TableAction("ipv4_forward", port=3, dst_mac=2),
                                          is_default_action=True)])
            assert sw.tables.default("ipv4_lpm") == ("ipv4_forward", {"dst_mac": 2, "port": 3})
            await fs.delete_all()
            left = [e async for e in fs.read([P4TableEntry(), P4MulticastGroupEntry()])]
            return left

    assert run(body()) == []
    assert all(not sw.tables.entries(t) for t in ("sessions", "workers", "endpoints", "ipv4_lpm"))
    assert sw.tables.multicast_groups() == {}
    # the P4 program's initial default action of ipv4_lpm (drop), not NoAction and not the route
    assert sw.tables.default("ipv4_lpm") == ("drop", {})


def _primary(stub, stop):
    """A StreamChannel that won arbitration with election id ELECTION, held until `stop` is set."""

    def requests():
        yield p4r.StreamMessageRequest(arbitration=p4r.MasterArbitrationUpdate(device_id=0,
                                                                               election_id=U128.encode(ELECTION)))
        stop.wait(TIMEOUT)

    responses = stub.StreamChannel(requests())
    first = next(responses)
    assert first.arbitration.status.code == 0, first
    return responses


def test_replicas_read_back_in_the_field_they_were_written_in(software_switch, p4info):
    _, address = software_switch()

    async def pipeline():  # finsy sets the pipeline (and leaves)
        async with _finsy(address, p4info):
            pass

    run(pipeline())
    stop = threading.Event()
    with grpc.insecure_channel(address) as channel:
        stub = p4r_grpc.P4RuntimeStub(channel)
        stream = _primary(stub, stop)
        try:
            _groups_and_refusals(stub, P4Schema(p4info).tables["ipv4_lpm"].id)
        finally:
            stop.set()
            stream.cancel()


def _groups_and_refusals(stub, ipv4_lpm: int) -> None:
    def write(update_type, entity):
        stub.Write(p4r.WriteRequest(device_id=0, election_id=U128.encode(ELECTION),
                                    updates=[p4r.Update(type=update_type, entity=entity)]), timeout=TIMEOUT)

    def group(g):
        return p4r.Entity(packet_replication_engine_entry=p4r.PacketReplicationEngineEntry(multicast_group_entry=g))

    old = p4r.MulticastGroupEntry(multicast_group_id=7, replicas=[p4r.Replica(egress_port=3, instance=0),
                                                                  p4r.Replica(egress_port=5, instance=1)])
    new = p4r.MulticastGroupEntry(multicast_group_id=8, replicas=[p4r.Replica(port=b"\x04", instance=0)])
    write(p4r.Update.INSERT, group(old))
    write(p4r.Update.INSERT, group(new))
    read = list(stub.Read(p4r.ReadRequest(device_id=0, entities=[group(p4r.MulticastGroupEntry())]), timeout=TIMEOUT))
    groups = {e.packet_replication_engine_entry.multicast_group_entry.multicast_group_id:
              e.packet_replication_engine_entry.multicast_group_entry for r in read for e in r.entities}
    assert [(r.WhichOneof("port_kind"), r.egress_port, r.instance) for r in groups[7].replicas] == \
        [("egress_port", 3, 0), ("egress_port", 5, 1)]
    assert [(r.WhichOneof("port_kind"), int.from_bytes(r.port, "big")) for r in groups[8].replicas] == [("port", 4)]

    # refusals name the spec's section
    with pytest.raises(grpc.RpcError) as err:
        write(p4r.Update.INSERT, group(old))
    assert "multicast group 7 exists (P4Runtime spec: PacketReplicationEngineEntry" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        write(p4r.Update.INSERT, p4r.Entity(table_entry=p4r.TableEntry(table_id=ipv4_lpm, is_default_action=True)))
    assert "can only be MODIFIED (P4Runtime spec: TableEntry: Default Entry)" in err.value.details()
