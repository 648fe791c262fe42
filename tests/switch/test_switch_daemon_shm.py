"""`luwu switch --port N=shm` end to end: a real switch process whose ports are shared-memory ring
pairs, its ready line giving each port's address (shm:/dev/shm/NAME, the syntax of
`luwu.dataplane.session.parse_port_address`), real engines opening the ports from that address
and running allreduces through it (exact sums), a killed switch named by the engines as on the
loopback shm path, the rings removed on a clean stop, and bad port specs refused in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from luwu.dataplane.engine import Engine
from luwu.dataplane.engine.liveness import LuwuPeerDead
from luwu.dataplane.loopback import StarPlan
from luwu.dataplane.net.shm_ring import supported
from luwu.dataplane.session import parse_port_address

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")

WAIT = 60.0  # s, an upper bound for any exchange (never an assertion on speed)
RING_SUFFIXES = (".up", ".up.bell", ".down", ".down.bell")


def _start(tmp_path, plan: StarPlan, extra: list[str] | None = None) -> tuple[subprocess.Popen, dict]:
    """A `luwu switch` process with a shm port per plan port, programmed with the plan's runtime JSON."""
    rt = tmp_path / "rt.json"
    rt.write_text(json.dumps(plan.runtime()))
    cmd = [sys.executable, "-m", "luwu.cli", "switch", "--lanes", str(plan.lanes), "--slots", str(plan.slots),
           "--runtime", str(rt), *[a for p in plan.ports for a in ("--port", f"{p}=shm")], *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    line = proc.stdout.readline()
    if not line.startswith('{"ready": true'):
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    ready = json.loads(line)
    for p, text in ready["ports"].items():
        transport, switch = parse_port_address(text, f"port {p}")
        assert transport == "shm", text
        plan.switch_ports[int(p)] = switch
    return proc, ready


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=WAIT)


def test_shm_ports_of_a_switch_process_carry_exact_allreduces(tmp_path):
    plan = StarPlan(workers=2, mode="tofino", transport="shm")
    proc, ready = _start(tmp_path, plan)
    prefixes = [prefix for prefix, _ in plan.switch_ports.values()]
    try:
        assert sorted(ready["ports"]) == ["1", "2"]
        for prefix in prefixes:  # the ring is the identity: only the owner (root or the user) may open it
            assert os.stat(prefix + ".up").st_mode & 0o077 == 0
        engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
        try:
            rng = np.random.default_rng(7)
            ints = [rng.integers(-2**20, 2**20, 50_000).astype(np.int32) for _ in range(2)]
            floats = [rng.integers(-1000, 1000, 30_000).astype(np.float32) / 8 for _ in range(2)]  # sums exact
            for xs in (ints, floats):
                got = [h.wait(WAIT) for h in [e.allreduce(x) for e, x in zip(engines, xs)]]
                for g in got:
                    np.testing.assert_array_equal(g, xs[0] + xs[1])
        finally:
            for e in engines:
                e.close()
        out, err = _stop(proc)
        assert proc.returncode == 0, err
        assert "luwu switch stopped" in out
        left = [p + s for p in prefixes for s in RING_SUFFIXES if os.path.exists(p + s)]
        assert not left, f"the switch left its rings behind: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_switch_process_is_named_by_its_shm_endpoints(tmp_path):
    plan = StarPlan(workers=2, mode="tofino", transport="shm")
    proc, _ = _start(tmp_path, plan)
    engines = [Engine(plan.worker_plan(r)).start() for r in range(2)]
    try:
        first = [e.allreduce(np.ones(1000, np.float32)) for e in engines]
        assert all(np.array_equal(h.wait(WAIT), np.full(1000, 2.0, np.float32)) for h in first)
        proc.kill()
        proc.wait()
        pending = engines[0].allreduce(np.ones(100_000, np.float32))
        with pytest.raises(LuwuPeerDead) as err:
            pending.wait(WAIT)
        assert err.value.component == "switch", err.value
        assert "over shared memory" in str(err.value) and f"pid {proc.pid}" in str(err.value), err.value
    finally:
        for e in engines:
            e.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.communicate()
        for prefix, _ in plan.switch_ports.values():  # a killed switch cannot remove its rings: the test does
            for s in RING_SUFFIXES:
                if os.path.exists(prefix + s):
                    os.unlink(prefix + s)


def test_a_shm_port_in_the_yaml_config():
    from luwu.dataplane.switch.config import ConfigError, daemon_config_from_dict

    cfg = daemon_config_from_dict({"ports": {1: "shm", 2: "127.0.0.1:0"}})
    assert cfg.shm_ports == {1} and list(cfg.ports) == [2]
    with pytest.raises(ConfigError, match="is both"):
        daemon_config_from_dict({"ports": {1: "shm"}, "ifaces": {1: "lo"}})


def test_a_bad_shm_port_spec_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "luwu.cli", "switch", "--port", "1=shm:/dev/shm/x"],
                          capture_output=True, text=True, timeout=WAIT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    assert "HOST:PORT" in proc.stderr and "N=shm" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_node_on_a_shm_port_whose_switch_is_gone_is_one_line(tmp_path):
    plan = StarPlan(workers=1, nodes=1, mode="tofino", transport="shm")
    plan.switch_ports = {p: (f"/dev/shm/luwu-sw-0-test-gone-p{p}", 0) for p in plan.ports}  # no such rings
    (tmp_path / "plan.json").write_text(plan.node_plan(0).to_json())
    proc = subprocess.run([sys.executable, "-m", "luwu.cli", "node", "--plan", str(tmp_path / "plan.json"),
                           "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=WAIT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    assert "luwu-sw-0-test-gone-p2" in proc.stderr and "while the plan's switch runs" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
