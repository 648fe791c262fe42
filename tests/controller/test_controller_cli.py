"""`luwu-ctl` against a running controller with a software switch: tables, --json, env vars, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from ctl_helpers import ADMIN, LANES, free_port, job, node, star_switch

from luwu.dataplane.protocol import Dtype, MsgType, Packet

CTL = str(Path(sys.executable).parent / "luwu-ctl")


def ctl(*args, address=None, token=ADMIN, env_only=False):
    env = dict(os.environ, COLUMNS="200")
    env.pop("LUWU_CONTROLLER", None)
    env.pop("LUWU_TOKEN", None)
    argv = [CTL]
    if env_only:
        env.update(LUWU_CONTROLLER=address or "", LUWU_TOKEN=token)
    else:
        argv += ["--controller", address, f"--token={token}"]
    return subprocess.run(argv + list(args), capture_output=True, text=True, env=env, timeout=60)


def test_ctl_reads_and_steers(controller, software_switch, tmp_path):
    bc, admin = controller
    sw, p4rt = software_switch()
    admin.register_node(node("n0", 3e6))
    admin.register_node(node("n1", 1e6))
    admin.register_switch(star_switch("s1", p4rt, 4, ["n0", "n1"]))
    created, _ = admin.create_job(job("train", 3, [5000, 7000, 100], nodes=2))
    sw.process_datagrams([(1, Packet(MsgType.ALLREDUCE, 999, 0, count=LANES, dtype=Dtype.INT32,
                                     payload=np.zeros(LANES, ">i4").tobytes()).pack())])  # UNKNOWN_SESSION
    addr = bc.address

    out = ctl("status", address=addr)
    assert out.returncode == 0, out.stderr
    assert "switches up" in out.stdout and "1/1" in out.stdout
    status = json.loads(ctl("--json", "status", address=addr, env_only=False).stdout)
    assert status["jobs_active"] == 1 and status["nodes"] == 2
    via_env = json.loads(ctl("--json", "status", address=addr, env_only=True).stdout)  # LUWU_CONTROLLER/LUWU_TOKEN
    assert {k: v for k, v in via_env.items() if k != "uptime"} == {k: v for k, v in status.items() if k != "uptime"}

    switches = json.loads(ctl("--json", "switches", address=addr).stdout)
    assert [s["name"] for s in switches] == ["s1"] and switches[0]["jobs"] == [created.job_id]
    assert "s1" in ctl("switches", address=addr).stdout
    nodes = ctl("nodes", address=addr).stdout
    assert "n0" in nodes and "n1" in nodes
    jobs = json.loads(ctl("--json", "jobs", address=addr).stdout)
    assert [j["job_id"] for j in jobs] == [created.job_id]

    plan = ctl("plan", created.job_id, "--explain", address=addr)
    assert plan.returncode == 0 and "why" in plan.stdout and "layout star" in plan.stdout
    assert "collective" in plan.stdout and "node n0" in plan.stdout
    plan_json = json.loads(ctl("--json", "plan", created.job_id, address=addr).stdout)
    assert {s["spec"]["kind"] for s in plan_json["plan"]["sessions"]} == {"collective", "node"}
    assert ctl("plan", created.job_id, "--runtime-dir", str(tmp_path), address=addr).returncode == 0
    runtime = json.loads((tmp_path / "s1-runtime.json").read_text())
    loaded, _ = software_switch()
    loaded.load_runtime(runtime)  # the file programs a switch to what P4Runtime wrote
    assert sorted(map(str, loaded.tables.entries("sessions"))) == sorted(map(str, sw.tables.entries("sessions")))

    counters = json.loads(ctl("--json", "counters", address=addr).stdout)
    drops = {v["label"]: int(v["packets"]) for v in counters[0]["values"] if v["counter"] == "drops"}
    assert drops == {"UNKNOWN_SESSION": 1}
    assert "UNKNOWN_SESSION" in ctl("counters", "s1", address=addr).stdout

    drained = ctl("drain", "n1", address=addr)
    assert drained.returncode == 0 and created.job_id in drained.stdout
    listed = json.loads(ctl("--json", "nodes", address=addr).stdout)
    assert [n["drained"] for n in listed] == [False, True]

    refused = ctl("drain", "nobody", address=addr)
    assert refused.returncode == 4 and "NOT_FOUND" in refused.stderr
    wrong = ctl("status", address=addr, token="bogus")
    assert wrong.returncode == 4 and "UNAUTHENTICATED" in wrong.stderr


def test_ctl_without_a_controller_says_what_to_check():
    out = ctl("status", address=f"127.0.0.1:{free_port()}")
    assert out.returncode == 3
    assert "cannot reach the luwu controller" in out.stderr and "LUWU_CONTROLLER" in out.stderr
