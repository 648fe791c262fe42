"""The audit logs of P4Runtime writes, at both ends: a real `luwu switch --audit-log` subprocess
programmed by the controller's SwitchProgrammer (finsy) with its own audit log. Each accepted
update is one JSON line (who, what, result OK) in both logs; an update the switch rejects logs
its error in both; a write with a wrong token is refused and logged by the switch."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from ctl_helpers import LANES, SLOTS
from finsy.proto import p4r, p4r_grpc

from luwu.controller import topology as T
from luwu.controller.job_spec import JobSpec
from luwu.controller.planner import Planner
from luwu.controller.programmer import ProgramError, SwitchProgrammer, SwitchTarget
from luwu.controller.usage import SwitchUsage
from luwu.dataplane.p4runtime import device_config_marker
from luwu.dataplane.p4runtime.audit import AuditLog

TOKEN = "audit-test-token"
WAIT = 60.0  # s the switch may take to start on a loaded machine


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def switch(tmp_path):
    """A `luwu switch` serving P4Runtime with a token, its audit log in tmp_path; (address, log)."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    log = tmp_path / "switch-audit.jsonl"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "luwu"), "switch", "--lanes", str(LANES), "--slots",
                             str(SLOTS), "--port", "1=127.0.0.1:0", "--p4runtime", "127.0.0.1:0",
                             "--p4runtime-token-file", str(tmp_path / "token"), "--audit-log", str(log),
                             "--name", "s1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"luwu switch exited: {proc.stderr.read()}")
        ready = json.loads(line)
        assert ready["audit_log"] == str(log)
        yield ready["p4runtime"], log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _program():
    topo = T.star(2, 1, lanes=LANES, slots=SLOTS)
    counter = itertools.count(100)
    plan = Planner().plan("j", JobSpec("j", 2, [(0, 1000)], packet_mode="tofino", num_nodes=1), topo,
                          SwitchUsage({"s1": SLOTS}), lambda: next(counter))
    return plan.programs["s1"]


def test_every_write_is_logged_by_the_switch_and_the_controller(switch, tmp_path, p4info):
    address, switch_log = switch
    controller_log = tmp_path / "controller-audit.jsonl"
    audit = AuditLog(controller_log, {"controller": "test"})
    programmer = SwitchProgrammer(p4info, lambda t: device_config_marker(LANES, SLOTS), 20.0, audit=audit)
    target = SwitchTarget("s1", address, 0, token=TOKEN)
    loop = asyncio.new_event_loop()
    try:
        prog = _program()
        counts = loop.run_until_complete(programmer.program(target, prog))
        written = counts["inserted"] + counts["groups"]
        assert written == len(prog.entries) + len(prog.groups) > 0

        # the switch: the pipeline, then one OK line per update, naming the caller and the table
        lines = _lines(switch_log)
        assert lines[0]["what"]["rpc"] == "SetForwardingPipelineConfig" and lines[0]["result"] == "OK"
        writes = [x for x in lines if x["what"]["rpc"] == "Write"]
        assert len(writes) == written and all(x["result"] == "OK" for x in writes), writes
        assert all(x["who"]["peer"].startswith("ipv4:127.0.0.1:") and x["who"]["identity"] == "bearer token"
                   for x in writes)
        assert all(x["source"]["switch"] == "s1" for x in lines)
        sessions = [x["what"] for x in writes if x["what"].get("table") == "sessions"]
        assert sessions and all(w["type"] == "INSERT" and w["action"] and w["match"] for w in sessions), sessions
        assert any(x["what"]["entity"] == "packet_replication_engine_entry" and x["what"]["group"] for x in writes)
        # the controller: the same updates, each with its switch and result
        mine = _lines(controller_log)
        assert len(mine) == written and all(x["result"] == "OK" and x["what"]["switch"] == "s1" for x in mine)
        assert sorted(json.dumps(x["what"].get("match"), sort_keys=True) for x in mine) == \
            sorted(json.dumps(x["what"].get("match"), sort_keys=True) for x in writes)

        # a rejected update: its error in both logs
        bad = next(e for e in prog.entries if e.table == "sessions")
        bad.action_params["pool_size"] = 3
        with pytest.raises(ProgramError, match="power of two"):
            loop.run_until_complete(programmer.program(target, prog))
        refused = [x for x in _lines(switch_log)[len(lines):] if x["result"] != "OK"]
        assert len(refused) == 1 and "power of two" in refused[0]["result"], refused
        assert refused[0]["what"]["type"] == "MODIFY" and refused[0]["what"]["table"] == "sessions"
        assert "power of two" in _lines(controller_log)[-1]["result"]
    finally:
        loop.close()
        audit.close()

    # a stranger's write: refused before any update is applied, one line naming the refusal
    before = len(_lines(switch_log))
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    with grpc.secure_channel(address, local) as channel:
        stub = p4r_grpc.P4RuntimeStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Write(p4r.WriteRequest(device_id=0, updates=[p4r.Update(type=p4r.Update.DELETE)]),
                       metadata=(("authorization", "Bearer wrong"),), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (stranger,) = _lines(switch_log)[before:]
    assert stranger["result"].startswith("UNAUTHENTICATED: wrong P4Runtime token"), stranger
    assert stranger["what"] == {"rpc": "Write", "updates": 1, "type": "DELETE", "entity": "none"}
