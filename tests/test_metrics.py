"""Prometheus metrics (docs/observability.md): a real `luwu switch --metrics` scraped over HTTP
counts the packets it dropped by reason, and an optimizer node's collector reports its steps."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from luwu.dataplane.observe.metrics import NodeCollector, serve
from luwu.dataplane.optimizer import JobSpec, NodeConfig, OptimizerNode, OptimizerSpec
from luwu.dataplane.optimizer.spec import LayerSpec


def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_switch_metrics_count_drops_by_reason():
    proc = subprocess.Popen([sys.executable, "-m", "luwu.cli", "switch", "--port", "1=127.0.0.1:0,peer=learn",
                             "--metrics", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        host, port = ready["ports"]["1"].rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(5):
                s.sendto(b"\x10\x01too short", (host, int(port)))  # version 1, GRAD, but 11 bytes: MALFORMED
        deadline = time.monotonic() + 30
        got = 0.0
        while time.monotonic() < deadline:
            got = _scrape(ready["metrics"]).get(("luwu_switch_drops_total", (("reason", "MALFORMED"),)), 0.0)
            if got >= 5:
                break
            time.sleep(0.2)
        assert got == 5
        samples = _scrape(ready["metrics"])
        assert samples[("luwu_switch_drops_total", (("reason", "SPOOFED"),))] == 0
        assert ("process_cpu_seconds_total", ()) in samples
    finally:
        proc.terminate()
        proc.wait(30)


def test_node_metrics_report_steps(tmp_path):
    node = OptimizerNode(NodeConfig(tmp_path / "state"))
    try:
        node.add_job(JobSpec("j", OptimizerSpec(), [LayerSpec(0, {"w": (4,)})]))
        for step in range(3):
            node.submit_gradient("j", 0, step, np.ones(4, np.float32))
        node.params("j", 0, 3, timeout=60)
        host, port = serve("127.0.0.1:0", NodeCollector(node.stats))
        samples = _scrape(f"{host}:{port}")
        assert samples[("luwu_node_published_total", ())] == 3
        assert samples[("luwu_node_submitted_total", ())] == 3
        assert samples[("luwu_node_up", ())] == 1
        assert samples[("luwu_node_stage_busy_seconds_total", (("stage", "optimize"),))] > 0
    finally:
        node.close(timeout=60)
