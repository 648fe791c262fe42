"""Static IPv4 routes a switch declares at registration (`Switch.routes`, `luwu switch --route`):
the controller installs exactly those in `ipv4_lpm` over P4Runtime (read back over P4Runtime),
keeps them while jobs come and go, refuses bad routes with one message naming the fix, and
repairs drift (a deleted route comes back, a stray one goes). Real software switches serving
P4Runtime on loopback, a real controller (in process, and `luwu controller` with a `luwu switch`
subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ctl_helpers import ADMIN, LANES, SLOTS, controller_process, job, node, star_switch
from finsy import P4TableAction, P4TableEntry, P4TableMatch, Switch, SwitchOptions

from luwu.controller.client import ControllerClient, ControllerRefused
from luwu.controller.programmer import SwitchProgrammer, SwitchTarget
from luwu.dataplane.p4runtime import device_config_marker
from luwu.proto import controller_pb2 as pb

MAC1 = "02:00:00:00:01:01"  # what is behind port 1 (declared as the port's MAC)
MAC2 = "02:00:00:00:02:02"  # a next hop named in the route itself
BIN = Path(sys.executable).parent


def routed(sw: pb.Switch) -> pb.Switch:
    """`sw` with a MAC on port 1 and two routes: a /32 by the port's MAC, a /16 by its own."""
    sw.ports[0].mac = MAC1
    sw.routes.add(prefix="10.1.0.5/32", port=1)
    sw.routes.add(prefix="10.2.0.0/16", port=2, mac=MAC2)
    return sw


def lpm_rows(p4info, address: str) -> list[tuple]:
    """ipv4_lpm as read over P4Runtime: sorted (prefix, length, action, port, dst_mac)."""
    prog = SwitchProgrammer(p4info, lambda t: device_config_marker(LANES, SLOTS), 10.0)
    read = __import__("asyncio").run(prog.read_program(SwitchTarget("s1", address, 0)))
    out = []
    for e in read.entries:
        if e.table.endswith("ipv4_lpm"):
            prefix, length = e.match["dst_addr"]
            out.append((prefix, length, e.action_name, e.action_params["port"], e.action_params["dst_mac"]))
    return sorted(out)


EXPECTED = sorted([(0x0A010005, 32, "ipv4_forward", 1, 0x020000000101),
                   (0x0A020000, 16, "ipv4_forward", 2, 0x020000000202)])


def test_declared_routes_are_installed_and_kept_across_jobs(controller, software_switch, p4info):
    _bc, admin = controller
    sw, address = software_switch()
    admin.register_node(node("n0"))
    resp = admin.register_switch(routed(star_switch("s1", address, 2, ["n0"])))
    assert resp.message == "registered and programmed", resp.message
    assert lpm_rows(p4info, address) == EXPECTED
    assert [r.prefix for r in admin.switches()[0].routes] == ["10.1.0.5/32", "10.2.0.0/16"]  # listed back
    created, _token = admin.create_job(job("a", 2, [100, 200]))  # re-programs the switch with the job
    assert sw.tables.entries("sessions")
    assert lpm_rows(p4info, address) == EXPECTED
    admin.end_job(created.job_id)
    assert not sw.tables.entries("sessions")
    assert lpm_rows(p4info, address) == EXPECTED
    # a re-registration without routes takes them out: the controller keeps exactly what is declared
    assert admin.register_switch(star_switch("s1", address, 2, ["n0"])).message == "registered and programmed"
    assert lpm_rows(p4info, address) == []


@pytest.mark.parametrize("route, says", [
    (pb.Ipv4Route(prefix="10.1.0.5/32", port=7), "port 7 is not one of the switch's ports (1, 2, 3)"),
    (pb.Ipv4Route(prefix="10.1.0.5/24", port=1), "is not an IPv4 network"),
    (pb.Ipv4Route(prefix="10.1.0.5", port=1), "must be A.B.C.D/LEN with LEN 1..32"),
    (pb.Ipv4Route(prefix="0.0.0.0/0", port=1), "must be A.B.C.D/LEN with LEN 1..32"),
    (pb.Ipv4Route(prefix="10.1.300.5/32", port=1), "is not an IPv4 network"),
    (pb.Ipv4Route(prefix="10.1.0.5/32", port=2, mac="02:00:00:00:01"), "must look like aa:bb:cc:dd:ee:ff"),
    (pb.Ipv4Route(prefix="10.1.0.5/32", port=2), "no next-hop MAC"),
    (pb.Ipv4Route(prefix="10.1.0.0/16", port=1), "declared twice"),
])
def test_a_bad_route_is_refused_and_changes_nothing(controller, software_switch, p4info, route, says):
    _bc, admin = controller
    _sw, address = software_switch()
    good = routed(star_switch("s1", address, 2, ["n0"]))
    assert admin.register_switch(good).message == "registered and programmed"
    bad = star_switch("s1", address, 2, ["n0"])
    bad.ports[0].mac = MAC1
    if "twice" in says:
        bad.routes.add().CopyFrom(route)
    bad.routes.add().CopyFrom(route)
    with pytest.raises(ControllerRefused) as refused:
        admin.register_switch(bad)
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert says in refused.value.message and "route" in refused.value.message
    assert lpm_rows(p4info, address) == EXPECTED  # the switch keeps what the good registration declared


async def _operator(address: str, p4info) -> None:
    """Another P4Runtime client deletes the declared /32 and adds a route of its own."""
    opts = SwitchOptions(p4info=p4info, device_id=0, initial_election_id=1 << 40)
    async with Switch("operator", address, opts) as sw:
        mine = [e async for e in sw.read(P4TableEntry("ipv4_lpm")) if e.match["dst_addr"] == (0x0A010005, 32)]
        assert len(mine) == 1, mine
        await sw.write([-mine[0], +P4TableEntry("ipv4_lpm", match=P4TableMatch(dst_addr=("10.9.0.0", 16)),
                                               action=P4TableAction("ipv4_forward", port=1, dst_mac=1))])


def test_drift_restores_a_deleted_route_and_deletes_a_stray_one(controller, software_switch, p4info):
    bc, admin = controller
    _sw, address = software_switch()
    assert admin.register_switch(routed(star_switch("s1", address, 2, ["n0"]))).message == "registered and programmed"
    assert bc.call(bc.server.core.check_drift(), 60) == {}  # in sync: nothing to repair
    bc.call(_operator(address, p4info), 60)
    assert lpm_rows(p4info, address) != EXPECTED
    found = bc.call(bc.server.core.check_drift(), 60)
    assert "1 missing entry re-inserted (ipv4_lpm)" in found["s1"]
    assert "1 unexpected entry deleted (ipv4_lpm)" in found["s1"]
    assert lpm_rows(p4info, address) == EXPECTED


def test_luwu_switch_declares_its_routes(tmp_path, p4info):
    """`luwu switch --controller --route ...` registers the routes; the controller installs them;
    a route on a port the switch does not have stops the daemon with one line."""
    token = tmp_path / "token"
    token.write_text(ADMIN)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with controller_process(tmp_path / "c.sqlite", token, p4info) as (_, address):
        base = [str(BIN / "luwu"), "switch", "--mode", "tofino", "--slots", "1024", "--port", "1=127.0.0.1:0",
                "--port", "2=127.0.0.1:0", "--p4runtime", "127.0.0.1:0", "--controller", address,
                "--token-file", str(token), "--name", "sw0", "--port-mac", f"1={MAC1}"]
        bad = subprocess.run(base + ["--route", "10.1.0.5/32=5"], capture_output=True, text=True, env=env,
                             timeout=120)
        assert bad.returncode == 2
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and "port 5 is not one of the switch's ports" in lines[0], bad.stderr
        proc = subprocess.Popen(base + ["--route", "10.1.0.5/32=1", "--route", f"10.2.0.0/16=2,mac={MAC2}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"luwu switch exited: {proc.stderr.read()}")
            ready = json.loads(line)
            with ControllerClient(address, ADMIN) as admin:
                (rec,) = admin.switches()
                assert rec.programmed == "ok"
                assert [(r.prefix, r.port, r.mac) for r in rec.routes] == [("10.1.0.5/32", 1, ""),
                                                                         ("10.2.0.0/16", 2, MAC2)]
            from luwu.dataplane.p4runtime import switch_token

            rows = _read_authenticated(p4info, ready["p4runtime"], switch_token(ADMIN, "sw0"))
            assert rows == EXPECTED
        finally:
            proc.terminate()
            proc.wait(30)


def _read_authenticated(p4info, address: str, tok: str) -> list[tuple]:
    prog = SwitchProgrammer(p4info, lambda t: device_config_marker(64, 1024), 10.0)
    read = __import__("asyncio").run(prog.read_program(SwitchTarget("sw0", address, 0, token=tok)))
    return sorted((e.match["dst_addr"][0], e.match["dst_addr"][1], e.action_name, e.action_params["port"],
                   e.action_params["dst_mac"]) for e in read.entries if e.table.endswith("ipv4_lpm"))


def test_route_flag_needs_a_controller_and_a_form(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for extra, says in ((["--route", "10.1.0.5/32=1"], "add --controller"),
                        (["--route", "10.1.0.5/32", "--controller", "127.0.0.1:1", "--p4runtime", "127.0.0.1:0",
                          "--name", "x", "--token-file", str(tmp_path / "nope")], "expected PREFIX/LEN=PORT")):
        out = subprocess.run([str(BIN / "luwu"), "switch", "--port", "1=127.0.0.1:0", *extra], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert says in out.stderr, out.stderr


def test_planned_entries_may_not_replace_declared_ones():
    """The guard CreateJob and RegisterSwitch run: a planned entry with a declared route's (or drop
    rule's) table and match is named; entries in other tables or with other matches pass."""
    from luwu.controller.core import _collision, declared_entries
    from luwu.dataplane.p4runtime.entries import route_entry, worker_entry

    rec = routed(star_switch("s1", "127.0.0.1:1", 2, []))
    rec.ports[1].ingress_drop_threshold = 1 << 30
    declared = declared_entries(rec)
    assert sorted(e.table for e in declared) == ["ingress_drop_sim", "ipv4_lpm", "ipv4_lpm"]
    other = [route_entry(0x0A010006, 32, port=1, dst_mac=1),
             worker_entry(7, 0, worker_bit=1, port=1)]
    assert _collision("s1", declared, other) == ""
    clash = _collision("s1", declared, other + [route_entry(0x0A010005, 32, port=2, dst_mac=5)])
    assert clash.startswith("switch s1: 1 planned entry would replace what the switch declared") and "ipv4_lpm" in clash
