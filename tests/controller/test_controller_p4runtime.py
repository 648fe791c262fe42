"""Programming over P4Runtime with finsy: the software switch's server and the fake, failures included."""

from __future__ import annotations

import asyncio
import itertools
import json

import grpc
import numpy as np
import pytest
from ctl_helpers import LANES, SLOTS
from finsy.proto import p4i, p4r, p4r_grpc
from google.protobuf import text_format

from luwu.controller import topology as T
from luwu.controller.job_spec import JobSpec
from luwu.controller.planner import Planner
from luwu.controller.programmer import ProgramError, SwitchProgrammer, SwitchTarget
from luwu.controller.usage import SwitchUsage
from luwu.dataplane.p4runtime import device_config_marker
from luwu.dataplane.protocol import DropReason, Dtype, MsgType, Packet
from luwu.dataplane.switch.p4runtime_service import NO_PIPELINE


def star_plan(workers=3, nodes=1):
    topo = T.star(workers, nodes, lanes=LANES, slots=SLOTS)
    usage = SwitchUsage({"s1": SLOTS})
    counter = itertools.count(100)
    return Planner().plan("j", JobSpec("j", workers, [(0, 1000)], packet_mode="tofino", num_nodes=nodes), topo,
                          usage, lambda: next(counter))


def programmer(p4info, timeout=10.0):
    return SwitchProgrammer(p4info, lambda t: device_config_marker(LANES, SLOTS), timeout)


_LOOP = asyncio.new_event_loop()  # one loop for the module: grpc.aio binds its poller to the first loop


def run(coro):
    return _LOOP.run_until_complete(coro)


def test_no_pipeline_is_refused_with_the_text_finsy_matches(software_switch):
    _, address = software_switch()
    with grpc.insecure_channel(address) as channel:
        stub = p4r_grpc.P4RuntimeStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetForwardingPipelineConfig(p4r.GetForwardingPipelineConfigRequest(device_id=0))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and err.value.details() == NO_PIPELINE
        with pytest.raises(grpc.RpcError) as err:  # no arbitration: not primary
            stub.Write(p4r.WriteRequest(device_id=0))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_program_read_back_and_reprogram_idempotently(software_switch, p4info):
    sw, address = software_switch()
    plan = star_plan()
    prog = plan.programs["s1"]
    target = SwitchTarget("s1", address, 0)
    counts = run(programmer(p4info).program(target, prog))
    assert counts["inserted"] == len(prog.entries) and counts["groups"] == len(prog.groups)
    assert sum(len(sw.tables.entries(t)) for t in ("sessions", "workers", "endpoints")) == len(prog.entries)
    assert sw.tables.multicast_groups() == {g.multicast_group_id: g.pairs() for g in prog.groups}
    back = run(programmer(p4info).read_program(target))
    assert sorted((e.table, sorted(e.match.items()), e.action_name, sorted(e.action_params.items())) for e in back.entries) == \
        sorted((e.table, sorted(e.match.items()), e.action_name, sorted(e.action_params.items())) for e in prog.entries)
    assert run(programmer(p4info).program(target, prog)) == {"deleted": 0, "modified": 0, "inserted": 0, "groups": 0}
    prog.entries[0].action_params["epoch"] += 1
    removed = prog.entries.pop()
    counts = run(programmer(p4info).program(target, prog))
    assert counts["modified"] == 1 and counts["deleted"] == 1
    assert sw.tables.lookup(removed.table, removed.match) is None


def test_programmed_switch_aggregates_and_counters_read_back(software_switch, p4info):
    """Entries written over P4Runtime make the switch sum an allreduce and multicast the result."""
    sw, address = software_switch()
    plan = star_plan(workers=3, nodes=0)
    run(programmer(p4info).program(SwitchTarget("s1", address, 0), plan.programs["s1"]))
    data = next(s.spec for s in plan.sessions if s.spec.purpose == "data")
    port = {p.rank: p.port for p in plan.placements}
    out = []
    for rank in range(3):
        lanes = (np.arange(LANES) * (rank + 1)).astype(">i4")
        pkt = Packet(MsgType.ALLREDUCE, data.session, worker=rank, count=LANES, seq=0, slot=data.pool_base,
                     dtype=Dtype.INT32, numel=LANES, payload=lanes.tobytes())
        out += sw.process_datagrams([(port[rank], pkt.pack())])
    assert sorted(p for p, _ in out) == sorted(port.values())
    for _, raw in out:
        got = Packet.unpack(raw)
        assert got.type == MsgType.RESULT and got.session == data.session
        assert np.array_equal(got.lanes(), np.arange(LANES) * 6)
    sw.process_datagrams([(port[0], b"\x10\x01")])  # truncated: MALFORMED
    counters = run(programmer(p4info).read_counters(SwitchTarget("s1", address, 0)))
    assert counters["drops"][int(DropReason.MALFORMED)][0] == 1
    assert counters["session_packets"][data.session][0] == 3


def test_per_update_errors_and_bad_pipelines_are_reported(software_switch, p4info, tmp_path):
    _, address = software_switch()
    prog = star_plan().programs["s1"]
    bad = next(e for e in prog.entries if e.table == "sessions")
    bad.action_params["pool_size"] = 3
    with pytest.raises(ProgramError, match="power of two"):
        run(programmer(p4info).program(SwitchTarget("s1", address, 0), prog))
    with pytest.raises(ProgramError, match="device"):
        run(programmer(p4info, timeout=5).program(SwitchTarget("s1", address, 7), prog))
    info = text_format.Parse(p4info.read_text(), p4i.P4Info())
    extra = info.tables.add()
    extra.CopyFrom(info.tables[0])
    extra.preamble.id, extra.preamble.name, extra.preamble.alias = 0x02FFFFFF, "LuwuIngress.mystery", "mystery"
    odd = tmp_path / "odd.txtpb"
    odd.write_text(text_format.MessageToString(info))
    with pytest.raises(ProgramError, match="not implemented by the software switch"):
        run(programmer(odd).program(SwitchTarget("s1", address, 0), prog))


def test_register_reads_are_unimplemented_like_bmv2(software_switch, p4info):
    _, address = software_switch()
    run(programmer(p4info).program(SwitchTarget("s1", address, 0), star_plan().programs["s1"]))
    with grpc.insecure_channel(address) as channel:
        stub = p4r_grpc.P4RuntimeStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Read(p4r.ReadRequest(device_id=0, entities=[p4r.Entity(register_entry=p4r.RegisterEntry())])))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_fake_records_writes_and_injected_failures_surface(fake_switch, p4info):
    fake, address = fake_switch()
    prog = star_plan().programs["s1"]
    target = SwitchTarget("s1", address, 0)
    run(programmer(p4info).program(target, prog))
    assert fake.pipeline_sets == 1 and len(fake.entries) == len(prog.entries) and len(fake.groups) == len(prog.groups)
    writes = len(fake.writes)
    run(programmer(p4info).program(target, prog))
    assert len(fake.writes) == writes and fake.pipeline_sets == 1  # nothing to do, pipeline kept (same cookie)

    prog.entries[0].action_params["epoch"] += 1
    fake.fail_next_writes(1, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(ProgramError, match="injected failure"):
        run(programmer(p4info).program(target, prog))
    fake.fail_updates(lambda u: u.entity.HasField("table_entry") and u.type == p4r.Update.MODIFY)
    with pytest.raises(ProgramError, match="injected update failure"):
        run(programmer(p4info).program(target, prog))
    fake.fail_updates(None)
    assert run(programmer(p4info).program(target, prog))["modified"] == 1  # converges once the switch heals
    fresh, fresh_address = fake_switch()  # no pipeline yet: the programmer must set one, and that fails
    fresh.fail_pipeline()
    with pytest.raises(ProgramError, match="injected pipeline failure"):
        run(programmer(p4info).program(SwitchTarget("s2", fresh_address, 0), prog))
    assert not fresh.entries


def test_runtime_json_validates_and_loads_like_p4runtime_programming(software_switch, p4info):
    """The same plan through the runtime JSON file and through P4Runtime gives the same tables."""
    plan = star_plan()
    runtime = plan.programs["s1"].runtime_json(p4info=str(p4info))
    by_file, _ = software_switch()
    by_file.load_runtime(runtime)
    by_p4rt, address = software_switch()
    run(programmer(p4info).program(SwitchTarget("s1", address, 0), plan.programs["s1"]))
    for table in ("sessions", "workers", "endpoints"):
        key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
        assert sorted(map(key, by_file.tables.entries(table))) == sorted(map(key, by_p4rt.tables.entries(table)))
    assert by_file.tables.multicast_groups() == by_p4rt.tables.multicast_groups()
    from luwu.dataplane.p4runtime.entries import RuntimeConfigError

    plan.programs["s1"].entries[0].action_params["bogus"] = 1
    with pytest.raises(RuntimeConfigError):
        plan.programs["s1"].runtime_json(p4info=str(p4info))
