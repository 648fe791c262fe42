"""`luwu demo` end to end, as a user runs it (the installed entry point, a subprocess), with tiny
settings: the controller plans the job and programs the software switch, the workers train
through it and the optimizer node, the DDP baseline runs, report.json and the PNGs appear; with
5% simulated loss on every port, or over UDP instead of shared-memory ports, the losses are
bit-identical to a plain run; and an
interrupted demo leaves none of its processes behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from luwu.dataplane.loopback import default_transport

LUWU = Path(sys.executable).parent / "luwu"
TINY = ["--workers", "2", "--d-model", "32", "--layers", "2", "--heads", "2", "--context", "16", "--batch", "4",
        "--quiet"]
RUN_TIMEOUT = 600  # s a tiny demo may take on a loaded 2-core machine before the test gives up
PNGS = ("loss.png", "memory.png", "throughput.png", "traffic.png")


def _demo(out: Path, *extra: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.run([str(LUWU), "demo", "--out", str(out), *TINY, *extra], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=out.parent)
    assert proc.returncode == 0, f"luwu demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_demo_trains_through_the_network_and_writes_its_report(tmp_path):
    out = tmp_path / "out"
    proc = _demo(out, "--steps", "4", "--node-memory", "48MiB")
    assert re.search(r"LUWU_CONTROLLER=127\.0\.0\.1:\d+ LUWU_TOKEN=\w+ luwu-ctl status", proc.stdout), proc.stdout
    report = json.loads((out / "report.json").read_text())
    for name in PNGS:
        assert (out / name).stat().st_size > 1000, name
    assert report["control_plane"]["kind"] == "controller"
    # --node-memory is the node's budget (state + served copies), shown in the report's settings
    assert report["settings"]["node_memory"] == 48 << 20
    node = report["optimizer_nodes"][0]["node"]
    assert node["store"]["budget"] + node["served"]["budget"] == 48 << 20
    # shared-memory switch ports where the loopback star supports them (the ready line's shm:/dev/shm/NAME
    # addresses went through the controller's plans to the workers and the node), UDP elsewhere
    transport = default_transport()  # shm where supported, LUWU_TRANSPORT if set
    assert report["control_plane"]["transport"] == report["settings"]["transport"] == transport
    assert f"{transport} ports" in proc.stdout, proc.stdout
    assert report["steps"] == 4 and len(report["luwu"]["losses"]) == 4 and len(report["ddp"]["losses"]) == 4
    # the same model, data and seed: the first loss is the same function of the same initial weights
    # (bf16-served parameters move it by bf16 rounding only), and both runs learn alike
    assert report["luwu"]["losses"][0] == pytest.approx(report["ddp"]["losses"][0], rel=1e-2)
    assert report["luwu"]["final_loss"] == pytest.approx(report["ddp"]["final_loss"], rel=5e-2)
    # real traffic through the switch, counted by the engines and by the switch itself
    t = report["traffic"]
    assert t["luwu_measured_per_step"]["out"] >= t["model_bytes_fp32"]  # every gradient, once
    assert t["luwu_measured_per_step"]["in"] >= t["luwu_ideal_per_step"]["in"] / 2
    # bytes per parameter each way, headers included: the default fixed32 pushes 4 B lanes, pulls bf16
    # (a model this small pays a little more: every push's exponent agreement is a packet of its own)
    assert report["settings"]["grad_format"] == "fixed32"
    assert t["push_bytes_per_param"] >= 4 and t["pull_bytes_per_param"] >= 2, t
    assert "bytes per parameter, pull / push (fixed32)" in " ".join(proc.stdout.split()), proc.stdout
    # where the push bytes go (luwu/demo/push_bytes.py): the packets by part, then resends and the rest
    b = t["push_breakdown"]
    assert b["grad_format"] == "fixed32" and b["units"] == len(report["model"]["units"]), b
    assert b["measured_bytes_per_param"] == pytest.approx(t["push_bytes_per_param"])
    assert b["per_step_bytes"]["other"] >= 0 and b["per_step_bytes"]["resent"] >= 0, b
    assert sum(b["per_param"].values()) == pytest.approx(b["measured_bytes_per_param"])
    assert report["switch_counters"]["events"]["COMPLETED"][0] > 0
    # nothing skipped or saturated, and the summary would have said so in red (luwu/demo/command.py _anomalies)
    assert report["luwu"]["skipped_steps"] == {} and report["luwu"]["saturated_sums"] == 0
    assert "skipped" not in proc.stdout and "SATURATED" not in proc.stdout
    # CPU per step by role, measured from /proc: every luwu process kind used some; DDP has workers only
    cpu = report["cpu_per_step"]
    assert all(cpu["luwu"][k] > 0 for k in ("workers", "switch", "optimizer nodes")), cpu
    # the default engine is a thread of each worker: no engine daemon ran, and the summary says where they were
    assert report["settings"]["engine"] == "embedded" and not cpu["luwu"].get("engines"), cpu
    assert "engines in the workers" in proc.stdout, proc.stdout
    assert cpu["luwu"]["total"] == pytest.approx(sum(v for k, v in cpu["luwu"].items() if k not in ("total", "steps")))
    assert cpu["ddp"]["workers"] > 0 and "switch" not in cpu["ddp"], cpu
    assert "CPU per step" in proc.stdout
    assert report["optimizer_nodes"][0]["node"]["node"]["published"] == 4 * len(report["model"]["units"])
    mem, ddp_mem = report["luwu"]["memory"]["0"], report["ddp"]["memory"]["0"]
    assert mem["peak_bytes"] < ddp_mem["state_bytes"]["total"]
    # the timeline: one Chrome trace with the workers, the switch and the optimizer node as processes
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    kinds = {n.split(" ")[0] for n in names.values()}
    assert {"worker", "switch", "optimizer"} <= kinds, names
    spans = {(names.get(e["pid"], "?").split(" ")[0], e["name"]) for e in events if e["ph"] == "X"}
    for want in [("worker", "forward"), ("worker", "backward"), ("worker", "push"), ("switch", "pipeline turn"),
                 ("optimizer", "optimize"), ("optimizer", "publish")]:
        assert want in spans, (want, sorted(spans))
    # its critical path: one steady-state iteration, every instant charged to one component
    cp = report["critical_path"]
    assert cp["iteration"] in (1, 2) and cp["seconds"] > 0 and (out / "critical_path.png").stat().st_size > 1000
    assert sum(cp["components"].values()) == pytest.approx(cp["seconds"], rel=1e-6)
    assert {"worker forward", "worker backward"} <= set(cp["components"]), cp["components"]
    assert cp["critical_worker"] in names.values()
    assert "critical path of step" in " ".join(proc.stdout.split())
    # 4 steps < --checkpoint-every 50: no checkpoint, so no restore command for one
    assert "no checkpoint yet" in proc.stdout and "--restore latest" not in proc.stdout, proc.stdout
    assert "version None" not in proc.stdout, proc.stdout
    # the plan's predicted iteration time beside the measured one (luwu/demo/prediction.py): the node's
    # params/s as it measured it at start, the workers' compute time from their first steps (no timed
    # assertion: how close the two come is the machine's to say)
    p = report["prediction"]
    assert p["predicted_s"] > 0 and p["measured_s"] > 0
    assert p["ratio"] == pytest.approx(p["predicted_s"] / p["measured_s"], rel=1e-12)
    assert p["node_rates"]["node0"]["source"] == "measured"  # not the fabric's placeholder
    assert p["node_params_per_second"]["node0"] == p["node_rates"]["node0"]["params_per_second"] > 0
    assert p["compute_steps"] == [1, 2, 3] and p["compute_s"] > 0 and p["bottleneck"] in p["busy_s"]
    assert all(0 < c <= s for c, s in zip(p["compute_seconds"], p["iteration_seconds"])), p
    assert (out / "iteration.png").stat().st_size > 1000
    assert "plan prediction:" in proc.stdout and "predicted/measured" in " ".join(proc.stdout.split())


def test_the_demo_names_a_metrics_endpoint_per_component_and_each_answers(tmp_path):
    """While it trains, every component's /metrics (controller, switch, node, each worker) is named
    in the demo's output and answers a GET with Prometheus text."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.Popen([str(LUWU), "demo", "--out", str(tmp_path / "out"), *TINY, "--steps", "100000",
                             "--no-baseline"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    want = {"controller", "switch", "node node0", "worker 0", "worker 1"}
    endpoints: dict[str, str] = {}
    seen: list[str] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        for line in proc.stdout:  # bounded: a handful of lines, then the demo trains quietly (--quiet)
            seen.append(line)
            m = re.search(r"curl http://(\S+)/metrics\s+# (.+)$", line.rstrip())
            if m:
                endpoints[m.group(2)] = m.group(1)
            if set(endpoints) >= want or time.monotonic() > deadline:
                break
        assert set(endpoints) == want, "".join(seen)
        for who, address in sorted(endpoints.items()):
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
            families = {f.name for f in text_string_to_metric_families(text)}
            assert "process_cpu_seconds" in families, (who, sorted(families))
            prefix = {"controller": "luwu_controller_", "switch": "luwu_switch_", "node": "luwu_node_",
                      "worker": "luwu_engine_"}[who.split()[0]]
            assert any(f.startswith(prefix) for f in families), (who, sorted(families))
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130


def test_a_diverging_run_says_which_steps_the_nodes_skipped(tmp_path):
    """An absurd learning rate sends the parameters to inf within a step or two: the workers'
    gradients become non-finite, the switch marks those sums SATURATED, the node skips the steps
    (as GradScaler would) and the summary says so in words, never a quiet different loss."""
    out = tmp_path / "out"
    proc = _demo(out, "--steps", "4", "--lr", "1e30", "--no-baseline")
    report = json.loads((out / "report.json").read_text())
    skipped = report["luwu"]["skipped_steps"]
    assert skipped and report["luwu"]["saturated_sums"] > 0, report["luwu"]
    assert "the optimizer nodes skipped" in proc.stdout and "SATURATED" in proc.stdout, proc.stdout
    assert all(f" {int(step)} (" in " ".join(proc.stdout.split()) for step in list(skipped)[:5]), proc.stdout


def test_five_percent_loss_either_transport_and_either_engine_give_bit_identical_losses(tmp_path):
    clean, lossy, udp = tmp_path / "clean", tmp_path / "lossy", tmp_path / "udp"
    for d in (clean, lossy, udp):
        d.mkdir()
    _demo(clean / "out", "--steps", "3", "--no-baseline", "--packet-mode", "jumbo")
    _demo(lossy / "out", "--steps", "3", "--no-baseline", "--packet-mode", "jumbo", "--drop", "0.05")
    _demo(udp / "out", "--steps", "3", "--no-baseline", "--packet-mode", "jumbo", "--transport", "udp",
          "--engine", "process")
    a, b, c = (json.loads((d / "out" / "report.json").read_text()) for d in (clean, lossy, udp))
    assert b["switch_counters"]["drops"]["SIMULATED_LOSS"][0] > 0  # loss did happen ...
    assert a["luwu"]["losses"] == b["luwu"]["losses"]  # ... and recovery did not change a single sum
    # the switch's ports and where the engines run (daemons here, threads of the workers above), not the sums, differ
    assert c["control_plane"]["transport"] == "udp" and c["settings"]["engine"] == "process"
    assert a["luwu"]["losses"] == c["luwu"]["losses"], (a["control_plane"]["transport"], c["control_plane"])


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def _group(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (a demo worker and the engine daemon it spawned)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


def test_an_interrupted_demo_stops_every_process_it_started(tmp_path):
    """SIGINT stops the demo and everything it started, even a demo started with SIGINT ignored
    (a script's background job, nohup: Python keeps an inherited SIG_IGN, and the demo then went on
    training, its workers, switch, node and controller with it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    argv = [str(LUWU), "demo", "--out", str(tmp_path / "out"), *TINY, "--steps", "100000", "--no-baseline",
            "--engine", "process"]
    # SIGINT ignored, then exec (which keeps SIG_IGN): not preexec_fn, unsafe in this threaded process
    ignoring = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", ignoring, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        port = None
        deadline = time.monotonic() + RUN_TIMEOUT
        for line in proc.stdout:  # bounded: the demo prints a handful of lines, then trains quietly
            m = re.search(r"LUWU_CONTROLLER=127\.0\.0\.1:(\d+)", line)
            if m:
                port = m.group(1)
                break
            assert time.monotonic() < deadline
        assert port, "the demo never printed its controller address"
        controller = _processes_mentioning(f"--listen 127.0.0.1:{port}")
        assert controller, "no controller process"
        workdir = re.search(r"--db (\S+)/fabric/controller\.sqlite", controller[0]).group(1)
        workers: list[int] = []
        for _ in range(1200):  # the workers come up and spawn their engines (bounded: 120 s)
            workers = [int(p.split(":")[0]) for p in _processes_mentioning(f"luwu.demo.worker {workdir}")]
            if len(workers) == 2 and all(len(_group(w)) >= 2 for w in workers):
                break
            time.sleep(0.1)
        assert len(workers) == 2 and all(len(_group(w)) >= 2 for w in workers), "workers or engines missing"
        assert len(_processes_mentioning(workdir)) >= 5  # controller, switch, node, two workers
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    assert _processes_mentioning(workdir) == []
    assert [_group(w) for w in workers] == [[], []]  # each worker's engine daemon went with it
    assert _processes_mentioning(f"--listen 127.0.0.1:{port}") == []


# a parent that starts the demo's DDP baseline (launch.WorkerGroup, as the demo does) but only its rank 0,
# which then waits in gloo's rendezvous for rank 1 (as the hung run's rank 0 did), says its pid, and waits
_DDP_PARENT = """
import json, sys, time
from pathlib import Path
from luwu.demo.launch import WorkerGroup
work = Path(sys.argv[1])
spec = {"mode": "ddp", "workers": 2, "steps": 2, "batch": 2, "lr": 1e-3, "weight_decay": 0.0, "seed": 1,
        "served_dtype": "bf16", "engine": "process", "corpus": None, "init_method": (work / "store").as_uri(),
        "model": {"kind": "gpt", "d_model": 16, "n_layers": 1, "n_heads": 2, "context": 8}}
group = WorkerGroup(spec, work, "ddp")
group.workers = 1  # rank 1 never comes
group.start()
for _ in range(3000):  # until rank 0 is in the rendezvous: its store file is there
    if (work / "store").exists() or not group.children[0].alive():
        break
    time.sleep(0.1)
time.sleep(1.0)
print(json.dumps({"pid": group.children[0].proc.pid, "waiting": group.children[0].alive()}), flush=True)
time.sleep(600)
"""


def test_a_ddp_rank_stuck_in_the_rendezvous_dies_with_a_killed_demo(tmp_path):
    """SIGKILL the process that started the DDP baseline while its rank 0 waits in gloo's rendezvous for
    a rank that never comes: the rank ends (SIGTERM on its parent's death, with its default action, since
    no Python handler runs inside a gloo call), instead of waiting on as an orphan."""
    parent = subprocess.Popen([sys.executable, "-c", _DDP_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    pid = None
    try:
        assert parent.stdout is not None
        got = json.loads(parent.stdout.readline())  # bounded: the parent prints it within its 300 s loop
        pid = got["pid"]
        assert got["waiting"] and (tmp_path / "store").exists(), (tmp_path / "ddp-worker0.log").read_text()[-800:]
        parent.kill()
        parent.wait(30)
        for _ in range(600):  # bounded: 60 s (the rendezvous itself gives up after 300 s)
            if _gone(pid):
                break
            time.sleep(0.1)
        assert _gone(pid), "the DDP rank outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid is not None:  # nothing left behind even when the test fails
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _gone(pid: int) -> bool:
    """Process `pid` has ended (no longer there, or a zombie not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.slow  # about 35 s on two cores
def test_the_report_survives_a_controller_killed_during_training(tmp_path):
    """SIGKILL the demo's controller once every rank has joined: training goes on (the workers warn,
    naming it), and report.json is still written, its switch counters from the switch's stats file
    with a note naming the dead controller; the optimizer node's lazy checkpoints are in OUT."""
    from luwu.controller.client import ControllerClient
    from luwu.proto import controller_pb2 as pb

    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    # UDP ports: the node restarted at the end runs after the demo's switch is gone, which a node on UDP
    # survives (it binds its own socket) but one on a shared-memory port refuses (the switch's rings are gone)
    proc = subprocess.Popen([str(LUWU), "demo", "--out", str(out), *TINY, "--steps", "80", "--no-baseline",
                             "--checkpoint-every", "20", "--transport", "udp"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        hint = None
        deadline = time.monotonic() + RUN_TIMEOUT
        for line in proc.stdout:  # bounded: the demo prints a handful of lines, then trains quietly
            hint = re.search(r"LUWU_CONTROLLER=(127\.0\.0\.1:\d+) LUWU_TOKEN=(\w+)", line)
            if hint or time.monotonic() > deadline:
                break
        assert hint, "the demo never printed its controller address"
        address, admin_token = hint.groups()
        with ControllerClient(address, admin_token, timeout=5) as admin:
            for _ in range(1200):  # until every rank has joined (bounded: 120 s)
                if [j for j in admin.jobs() if j.state == pb.RUNNING]:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the demo's job never ran")
        (controller,) = _processes_mentioning(f"--listen {address}")
        stats = Path(re.search(r"--db (\S+)/controller\.sqlite", controller).group(1)) / "switch-stats.json"
        for _ in range(1200):  # until sums complete: the workers have handed the job to the node (bounded: 120 s)
            try:
                if json.loads(stats.read_text())["counters"]["events"].get("COMPLETED", [0])[0] > 0:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        os.kill(int(controller.split(":")[0]), signal.SIGKILL)
        rest, _ = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest
    assert f"the controller {address} that planned job" in rest and "stopped answering" in rest, rest
    report = json.loads((out / "report.json").read_text())
    assert len(report["luwu"]["losses"]) == 80
    notes = report["control_plane"]["notes"]
    assert any(n.startswith("switch_counters from the switch's stats file") and address in n for n in notes), notes
    assert report["switch_counters"]["events"]["COMPLETED"][0] > 0
    assert report["optimizer_nodes"][0]["node"]["node"]["published"] == 80 * len(report["model"]["units"])
    lost = {r: [e for e in ev if e["state"] == "lost"] for r, ev in report["control_plane"]["controller_events"].items()}
    assert sorted(lost) == ["0", "1"] and all(len(v) == 1 and address in v[0]["message"] for v in lost.values()), lost
    manifests = sorted((out / "checkpoints" / "node0").glob("ckpt-*/manifest.json"))
    assert manifests, list((out / "checkpoints").rglob("*"))
    versions = {layer["version"] for layer in json.loads(manifests[-1].read_text())["jobs"][0]["state"]}
    assert len(versions) == 1 and versions.pop() % 20 == 0  # one consistent version, a multiple of the interval
    print(f"report written after the controller {address} was killed; notes: {notes}")
    _restart_node_from(out / "checkpoints" / "node0", tmp_path / "restarted")


def _shards(manifest: Path) -> dict:
    state = json.loads(manifest.read_text())["jobs"][0]["state"]
    return {(s["layer_id"], i): (s["version"], sh["bytes"], sh["crc32"]) for s in state for i, sh in enumerate(s["shards"])}


def _restart_node_from(ckpt: Path, work: Path) -> None:
    """The demo's settings restore: `luwu node --restore latest` from the demo's checkpoint dir and
    plan comes up, and a checkpoint of the restarted node holds exactly the same state (every shard's
    version, size and CRC-32), i.e. it would serve the job on bit-identically."""
    from luwu.dataplane.optimizer.control import ControlClient

    work.mkdir()
    (work / "token").write_text("restart-token")
    newest = _shards(sorted(ckpt.glob("ckpt-*/manifest.json"))[-1])
    proc = subprocess.Popen([str(LUWU), "node", "--plan", str(ckpt / "plan.json"), "--checkpoint-dir", str(ckpt),
                             "--restore", "latest", "--state-dir", str(work / "state"), "--control",
                             f"unix:{work}/node.sock", "--control-token-file", str(work / "token")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        ready = json.loads(proc.stdout.readline() or "{}")  # bounded: the node prints its ready line or exits
        assert ready.get("ready"), proc.stderr.read() if proc.poll() is not None else ready
        client = ControlClient(ready["control"], token="restart-token")
        again = Path(client.checkpoint())
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
    assert _shards(again / "manifest.json") == newest
    print(f"restarted node: {len(newest)} shards at version {next(iter(newest.values()))[0]}, bit-identical")


@pytest.mark.slow  # about 30 s on two cores
def test_a_node_killed_during_training_is_named_by_the_workers(tmp_path):
    """SIGKILL the demo's optimizer node mid-training: the demo fails within seconds with the
    workers' error naming the node (index, control channel, job, session) and its switch, and the
    node's lazy checkpoints stay in OUT for `luwu node --restore latest`."""
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="400")
    proc = subprocess.Popen([str(LUWU), "demo", "--out", str(out), *TINY, "--steps", "100000", "--no-baseline",
                             "--checkpoint-every", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        address = None
        deadline = time.monotonic() + RUN_TIMEOUT
        for line in proc.stdout:  # bounded: the demo prints a handful of lines, then trains quietly
            found = re.search(r"LUWU_CONTROLLER=(127\.0\.0\.1:\d+)", line)
            if found or time.monotonic() > deadline:
                break
        assert found, "the demo never printed its controller address"
        address = found.group(1)
        (controller,) = _processes_mentioning(f"--listen {address}")
        workdir = re.search(r"--db (\S+)/controller\.sqlite", controller).group(1)
        for _ in range(1200):  # until the node has committed a checkpoint (bounded: 120 s)
            if list((out / "checkpoints" / "node0").glob("ckpt-*/manifest.json")):
                break
            time.sleep(0.1)
        (node,) = _processes_mentioning(f"{workdir}/node0.sock")
        os.kill(int(node.split(":")[0]), signal.SIGKILL)
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=RUN_TIMEOUT)
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, rest
    flat = " ".join(rest.split())
    assert re.search(rf"optimizer node #0 \(control channel unix:{re.escape(workdir)}/node0\.sock, job demo-\d+, "
                     r"session \d+\) \(behind switch (127\.0\.0\.1:\d+|port \d+ over shared memory \(/dev/shm/\S+\))\) "
                     r"stopped answering", flat), flat  # its switch port: UDP, or shared memory (the default)
    assert list((out / "checkpoints" / "node0").glob("ckpt-*/manifest.json"))
    log = re.search(r"traceback in (\S+\.log)", flat).group(1)  # one line on the console, the traceback kept
    assert log.startswith(str(out / "logs")) and "Traceback" in Path(log).read_text(), log
    print(f"demo ended {seconds:.1f} s after the node's SIGKILL: {flat[flat.find('luwu demo failed'):][:400]}")


@pytest.mark.slow  # three tiny demos, about 60 s on two cores
def test_demo_resumes_from_the_nodes_checkpoint_bit_identically(tmp_path):
    """A run stopped after step 4 (checkpoint every 3 steps: version 3 on disk) and continued with
    `--resume --steps 6` (the node restarts with `luwu node --restore`, the workers at step 3) gives
    the same losses for steps 3..5, bit for bit, as a run of 6 steps never stopped."""
    (tmp_path / "full").mkdir()
    (tmp_path / "part").mkdir()
    common = ("--no-baseline", "--checkpoint-every", "3")
    _demo(tmp_path / "full" / "out", "--steps", "6", *common)
    _demo(tmp_path / "part" / "out", "--steps", "4", *common)
    proc = _demo(tmp_path / "part" / "out", "--steps", "6", "--resume", *common)
    assert "resuming job demo-1 at step 3" in " ".join(proc.stdout.split()), proc.stdout
    full = json.loads((tmp_path / "full" / "out" / "report.json").read_text())
    resumed = json.loads((tmp_path / "part" / "out" / "report.json").read_text())
    assert resumed["control_plane"]["resumed_from"]["step"] == 3
    assert resumed["luwu"]["losses"] == full["luwu"]["losses"][3:]
    print(f"resumed at step 3: losses {resumed['luwu']['losses']} == {full['luwu']['losses'][3:]}")


def test_an_opt_model_built_on_meta_trains_and_the_memory_panel_shows_every_worker(tmp_path):
    """`--model custom` (tiny dimensions) takes the big sizes' path: an OPT-shaped transformers model
    the luwu workers build on the meta device (the network initialises it unit by unit), activation
    checkpointing on, while DDP builds it whole and sets it to the same values. The report names the
    model, shows every luwu and DDP worker's peak RSS (VmHWM) and the node's beside its budget."""
    out = tmp_path / "out"
    # 25 s here. It hung once in four full-suite runs before the DDP ranks met in a file store, and once
    # in one run after (the full suite at the v2 merge, past pytest's 300 s). Found (issue 26): a rank of
    # the DDP baseline could hang at exit freeing its gloo group with the GIL held (luwu/demo/worker.py
    # _leave_group; 2 in 14 runs of the OPT baseline before, 0 in 32 after)
    try:
        proc = _demo(out, "--model", "custom", "--checkpointing", "--vocab", "100", "--steps", "2",
                     "--node-memory", "64MiB", timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.skip(f"luwu demo --model custom did not finish within 150 s (a known rare hang): {e.stdout!r:.400}")
    report = json.loads((out / "report.json").read_text())
    assert (out / "memory.png").stat().st_size > 1000
    model = report["model"]
    assert model["name"] == "custom" and model["family"] == "opt" and model["activation_checkpointing"] is True
    cfg = model["config"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["vocab_size"],
            cfg["max_position_embeddings"]) == (32, 2, 2, 100, 16)
    assert model["parameters"] == sum(u["numel"] for u in model["units"])
    assert model["largest_unit_numel"] == max(u["numel"] for u in model["units"])
    assert "meta" in model["luwu_build"] and "2 steps" in " ".join(proc.stdout.split())
    assert report["steps"] == 2 and len(report["ddp"]["losses"]) == 2
    # the same initial values in both runs (the DDP model set unit by unit to the network's): the first loss
    # differs by the node's bf16 serving only
    assert report["luwu"]["losses"][0] == pytest.approx(report["ddp"]["losses"][0], rel=1e-2)
    # built on meta: before training no worker held more unit parameters than the largest unit (the rank
    # handing the nodes their layers makes one at a time; the other none)
    setup = report["luwu"]["setup_memory"]
    largest = 4 * model["largest_unit_numel"]
    assert 0 < setup["0"]["peak_bytes_by_kind"]["params"] <= largest, setup
    assert setup["1"]["peak_bytes_by_kind"]["params"] <= largest, setup
    mem = report["memory"]
    assert mem["luwu_built_on"] == ["meta"] and "VmHWM" in mem["source"]
    assert set(mem["luwu_workers"]) == set(mem["ddp_workers"]) == {"0", "1"}
    assert all(v > 50 << 20 for v in [*mem["luwu_workers"].values(), *mem["ddp_workers"].values()]), mem
    assert mem["luwu_worker_peak_rss_bytes"] == max(mem["luwu_workers"].values())
    assert mem["ddp_worker_peak_rss_bytes"] == max(mem["ddp_workers"].values())
    assert mem["luwu_to_ddp"] == pytest.approx(mem["luwu_worker_peak_rss_bytes"] / mem["ddp_worker_peak_rss_bytes"])
    # a worker's peak covers what it had at the end of building its model
    assert all(mem["luwu_workers"][r] >= mem["luwu_built_vm_hwm_bytes"][r] for r in ("0", "1")), mem
    node = mem["nodes"]["node0"]
    assert node["peak_rss_bytes"] > 50 << 20 and node["budget_bytes"] == mem["node_budget_bytes"] == 64 << 20
    assert node["within_budget_and_overhead"] == (node["peak_rss_bytes"] <= (64 << 20) + mem["node_rss_overhead_bytes"])
    assert "worker peak RSS, VmHWM" in proc.stdout and "optimizer node0 peak" in " ".join(proc.stdout.split())


@pytest.mark.parametrize("argv, says", [
    (["--model", "125m", "--d-model", "64"], "--model 125m has fixed dimensions"),
    (["--checkpointing"], "--checkpointing is for the OPT models"),
    (["--model", "custom", "--vocab", "3"], "--vocab 3 is smaller than the corpus"),
])
def test_bad_model_options_are_one_line_and_exit_2(tmp_path, argv, says):
    proc = subprocess.run([str(LUWU), "demo", "--out", str(tmp_path / "out"), *argv], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
