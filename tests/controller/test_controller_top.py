"""Observability through the controller, all real processes but the engines: a `luwu controller
--metrics` and a `luwu switch --metrics --controller` subprocess, two engines allreducing through the
switch with rank 1 sleeping before each operation, and `luwu-ctl top --once --json` naming rank 1
the straggler. The switch's /metrics count rank 1's last arrivals; the controller's /metrics count
the job, the switch, the RPCs and an auth refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from ctl_helpers import ADMIN, LANES, controller_process, free_port
from prometheus_client.parser import text_string_to_metric_families

from luwu.controller.client import ControllerClient, ControllerRefused
from luwu.controller.top_view import MIN_SLOTS, name_straggler
from luwu.proto import controller_pb2 as pb

DELAY = 0.05  # seconds rank 1 sleeps before each allreduce
WAIT = 60.0  # seconds one allreduce may take on a loaded machine
BIN = Path(sys.executable).parent


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def deployment(tmp_path, p4info):
    token = tmp_path / "token"
    token.write_text(ADMIN)
    metrics = f"127.0.0.1:{free_port()}"
    with controller_process(tmp_path / "c.sqlite", token, p4info, extra=("--metrics", metrics)) as (_, address):
        sw = subprocess.Popen([str(BIN / "luwu"), "switch", "--mode", "tofino", "--slots", "1024",
                               "--port", "1=127.0.0.1:0", "--port", "2=127.0.0.1:0", "--p4runtime", "127.0.0.1:0",
                               "--controller", address, "--token-file", str(token), "--name", "sw0",
                               "--metrics", "127.0.0.1:0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            line = sw.stdout.readline()
            if not line:
                pytest.fail(f"luwu switch exited: {sw.stderr.read()}")
            ready = json.loads(line)
            with ControllerClient(address, ADMIN) as admin:
                yield address, metrics, ready["metrics"], admin
        finally:
            sw.terminate()
            sw.wait(30)


def test_top_names_the_delayed_worker(deployment):
    from luwu.dataplane.engine import Engine, EngineConfig

    address, controller_metrics, switch_metrics, admin = deployment
    created, job_token = admin.create_job(pb.Job(name="top", num_workers=2, packet_mode=str(LANES), num_nodes=0))
    engines = [Engine(admin.join_job(created.job_id, r, f"127.0.0.1:{free_port()}", token=job_token)[0],
                      EngineConfig()).start() for r in range(2)]
    stop = threading.Event()
    errors: list[tuple[int, BaseException]] = []  # (rank, what it raised)
    x = np.arange(40 * LANES, dtype=np.int32)  # 40 slots per allreduce

    rounds = threading.Barrier(2, timeout=WAIT)
    go = [True]  # rank 0's decision for the current round

    def worker(rank: int) -> None:
        # both ranks run the same number of allreduces: each round, rank 0 decides whether there is
        # one more and rank 1 reads that decision (a rank that read `stop` on its own could start an
        # allreduce its peer, seeing `stop` set a moment later, never joins: a 60 s wait for nothing)
        try:
            while True:
                if rank == 0:
                    go[0] = not stop.is_set()
                rounds.wait()
                more = go[0]
                rounds.wait()  # rank 0 writes the next decision only after both read this one
                if not more:
                    return
                if rank == 1:
                    stop.wait(DELAY)
                np.testing.assert_array_equal(engines[rank].allreduce(x).wait(WAIT), 2 * x)
        except threading.BrokenBarrierError:
            return  # the peer failed and said why
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append((rank, exc))
            stop.set()
            rounds.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    try:
        out = subprocess.run([str(BIN / "luwu-ctl"), "--controller", address, f"--token={job_token}", "--json", "top",
                              created.job_id, "--once", "--interval", "3"],
                             capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT)
        for e in engines:
            e.close()
    assert not errors, errors
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    job = view["jobs"][created.job_id]
    assert job["straggler"] == "1", job
    rows = job["workers"]
    assert rows["1"]["last"] > rows["0"]["last"] and rows["1"]["completed"] >= MIN_SLOTS
    assert rows["0"]["contributions_per_second"] > 0 and rows["0"]["switch"] == "sw0"

    # the switch's own metrics: rank 1 completed more slots than rank 0, with its lags in the histogram
    s = scrape(switch_metrics)
    last = {w: sum(v for (name, labels), v in s.items() if name == "luwu_switch_last_arrivals_total"
                   and dict(labels)["worker"] == w) for w in ("0", "1")}
    assert last["1"] > last["0"]
    lag_count = sum(v for (name, labels), v in s.items()
                    if name == "luwu_switch_last_arrival_lag_seconds_count" and dict(labels)["worker"] == "1")
    assert lag_count == last["1"]

    # the controller's metrics: the job, the switch, the RPCs, a refusal
    with ControllerClient(address, "not-a-token") as stranger, pytest.raises(ControllerRefused):
        stranger.status()
    c = scrape(controller_metrics)
    assert c[("luwu_controller_jobs", (("state", "RUNNING"),))] == 1
    assert c[("luwu_controller_switch_up", (("switch", "sw0"), ("target", "software")))] == 1
    assert c[("luwu_controller_switch_programmed", (("switch", "sw0"),))] == 1
    assert c[("luwu_controller_rpcs_total", (("code", "OK"), ("method", "CreateJob")))] == 1
    assert c[("luwu_controller_rpcs_total", (("code", "OK"), ("method", "JoinJob")))] == 2
    assert c[("luwu_controller_rpcs_total", (("code", "OK"), ("method", "GetTop")))] == 2
    assert c[("luwu_controller_auth_refusals_total", (("code", "UNAUTHENTICATED"), ("method", "Status")))] == 1


def test_top_without_a_switch_metrics_endpoint_says_so(tmp_path, controller, software_switch):
    """A switch registered without metrics: top lists the ranks with the reason, names nobody."""
    from luwu.controller.client import software_switch_record

    _, admin = controller
    sw, p4rt = software_switch()
    for port in (1, 2):
        sw.attach_udp(port, ("127.0.0.1", 0))
    admin.register_switch(software_switch_record(sw, "plain", p4rt))
    created, _ = admin.create_job(pb.Job(name="quiet", num_workers=2, packet_mode=str(LANES), num_nodes=0))
    top = json.loads(admin.call("GetTop", pb.GetTopRequest(job_id=created.job_id)).top_json)
    job = top["jobs"][created.job_id]
    assert "no metrics endpoint registered" in job["switches"]["plain"]
    assert sorted(job["workers"]) == ["0", "1"] and "last" not in job["workers"]["0"]
    every = json.loads(admin.call("GetTop", pb.GetTopRequest()).top_json)  # no job: every live job (admin)
    assert list(every["jobs"]) == [created.job_id]

    # luwu-ctl top into a pipe: plain text, every header whole; --json after the command's name
    bc, _ = controller
    ctl = [str(BIN / "luwu-ctl"), "--controller", bc.address, "--token", ADMIN, "top", created.job_id,
           "--once", "--interval", "0.1"]
    plain = subprocess.run(ctl, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[1].split() == ["rank", "switch:port", "contrib/s", "dups", "last", "of", "slots", "share", "lag",
                                "ms", "rx", "dropped", "tx", "lost"], plain.stdout
    assert "no metrics endpoint registered" in lines[2] and "no straggler" in plain.stdout
    assert not any(ch in plain.stdout for ch in "┃│━\x1b"), plain.stdout  # no box, no colour
    as_json = subprocess.run([*ctl, "--json"], capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 0, as_json.stderr
    assert list(json.loads(as_json.stdout)["jobs"]) == [created.job_id]


def row(switch: str, last: int, completed: int, lag: float) -> dict:
    return {"switch": switch, "last": last, "completed": completed,
            "last_share": last / completed if completed else 0.0, "_lag": lag}


def test_straggler_rule():
    # equal workers share the last arrivals: nobody
    assert name_straggler({"0": row("s", 50, 100, 0.05), "1": row("s", 50, 100, 0.05)})[0] is None
    # one worker last in 90% with 40 ms against 1 ms: named
    assert name_straggler({"0": row("s", 10, 100, 0.01), "1": row("s", 90, 100, 3.6)})[0] == "1"
    # last often but not later than the others: nobody
    assert name_straggler({"0": row("s", 20, 100, 0.2), "1": row("s", 80, 100, 0.8)})[0] is None
    # too few slots to say
    rank, why = name_straggler({"0": row("s", 0, 5, 0.0), "1": row("s", 5, 5, 0.5)})
    assert rank is None and str(MIN_SLOTS) in why
    # three ranks: 50% last is enough (fair share 33%)
    assert name_straggler({"0": row("s", 25, 100, 0.025), "1": row("s", 25, 100, 0.025),
                           "2": row("s", 50, 100, 1.0)})[0] == "2"
