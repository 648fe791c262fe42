"""The controller's Prometheus metrics (`luwu controller --metrics HOST:PORT`), read at scrape time.

`ControllerCollector(snapshot)` turns `snapshot()` (taken on the controller's event loop by
`ControllerServer.metrics_snapshot`, so nothing is read mid-update) into:

    luwu_controller_up                                   1 while serving
    luwu_controller_jobs{state}                          jobs by state (PLANNED, RUNNING, DEGRADED, ENDED)
    luwu_controller_switch_up{switch,target}             1 up, 0 down (heartbeats)
    luwu_controller_switch_programmed{switch}            1 when the last programming or read-back succeeded
    luwu_controller_switch_jobs{switch}                  live jobs the switch carries
    luwu_controller_drift_repairs_total{switch}          read-back rounds that found and repaired drift
    luwu_controller_node_up{node}                        1 up, 0 down
    luwu_controller_node_drained{node}                   1 while drained
    luwu_controller_rpcs_total{method,code}              calls answered, by status code (grpc_surface.RpcCounts)
    luwu_controller_auth_refusals_total{method,code}     calls refused for their token (auth.Authenticator)
    luwu_controller_uptime_seconds

plus the process's `process_*` metrics (luwu.dataplane.observe.metrics.serve).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class ControllerCollector:
    """`snapshot()` -> {"jobs": {state: n}, "switches": {name: {...}}, "nodes": {name: {...}},
    "rpcs": {(method, code): n}, "refusals": {(method, code): n}, "uptime": seconds}."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.snapshot()
        yield GaugeMetricFamily("luwu_controller_up", "1 while the controller serves", value=1)
        yield GaugeMetricFamily("luwu_controller_uptime_seconds", "seconds since the controller started",
                                value=s["uptime"])
        jobs = GaugeMetricFamily("luwu_controller_jobs", "jobs by state", labels=["state"])
        for state, n in sorted(s["jobs"].items()):
            jobs.add_metric([state], n)
        yield jobs
        up = GaugeMetricFamily("luwu_controller_switch_up", "1 while the switch heartbeats, else 0",
                               labels=["switch", "target"])
        programmed = GaugeMetricFamily("luwu_controller_switch_programmed", "1 when the switch's last programming "
                                       "or read-back succeeded", labels=["switch"])
        carried = GaugeMetricFamily("luwu_controller_switch_jobs", "live jobs on the switch", labels=["switch"])
        repairs = CounterMetricFamily("luwu_controller_drift_repairs", "read-back rounds that found drift on the "
                                      "switch and repaired it", labels=["switch"])
        for name, sw in sorted(s["switches"].items()):
            up.add_metric([name, sw["target"]], 1 if sw["health"] == "up" else 0)
            programmed.add_metric([name], 1 if sw["programmed"] == "ok" else 0)
            carried.add_metric([name], sw["jobs"])
            repairs.add_metric([name], sw["drift_repairs"])
        yield from (up, programmed, carried, repairs)
        node_up = GaugeMetricFamily("luwu_controller_node_up", "1 while the optimizer node heartbeats, else 0",
                                    labels=["node"])
        drained = GaugeMetricFamily("luwu_controller_node_drained", "1 while the node is drained", labels=["node"])
        for name, node in sorted(s["nodes"].items()):
            node_up.add_metric([name], 1 if node["health"] == "up" else 0)
            drained.add_metric([name], 1 if node["drained"] else 0)
        yield from (node_up, drained)
        for key, metric, text in (("rpcs", "luwu_controller_rpcs", "RPCs answered, by method and status code"),
                                  ("refusals", "luwu_controller_auth_refusals",
                                   "RPCs refused for their token (missing, unknown, another job's, not admin)")):
            fam = CounterMetricFamily(metric, text, labels=["method", "code"])
            for (method, code), n in sorted(s[key].items()):
                fam.add_metric([method, code], n)
            yield fam
