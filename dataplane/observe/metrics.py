"""Prometheus metrics of a luwu process (prometheus_client), read at scrape time from the counters
the component keeps anyway: between scrapes they cost nothing.

    luwu switch ... --metrics 127.0.0.1:9464     # then: curl 127.0.0.1:9464/metrics
    luwu node ... --metrics 127.0.0.1:9465

Switch: `luwu_switch_drops_total{reason}` and `luwu_switch_drop_bytes_total{reason}` (names
from protocol.DropReason), `luwu_switch_events_total{event}`, `luwu_switch_rx_packets_total{type}`,
`luwu_switch_session_packets_total{session}`, `luwu_switch_port_packets_total{port,counter}`, and
per (session, worker) from the straggler bookkeeping: `luwu_switch_contributions_total`,
`luwu_switch_duplicates_total`, `luwu_switch_last_arrivals_total` (slots the worker completed) and
the histogram `luwu_switch_last_arrival_lag_seconds` (first contribution to that last one).
Optimizer node: `luwu_node_submitted_total`, `luwu_node_published_total`,
`luwu_node_saturated_gradients_total`, `luwu_node_skipped_steps_total`,
`luwu_node_rejected_total{reason}`, `luwu_node_stage_busy_seconds_total{stage}`,
`luwu_node_queued{stage}`, `luwu_node_bytes{part,kind}` (store / served RAM), `luwu_node_io_total{kind}`,
`luwu_node_up` (0 once the node failed). Worker processes (LUWU_METRICS, luwu.worker.metrics):
`luwu_engine_stat{engine,section,name}`. docs/observability.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..process.usage import check_host_port
from ..protocol import DropReason, Event, MsgType

# upper bounds (seconds) of the switch's last-arrival lag histogram (switch/stragglers.py keeps it
# over these; `luwu_switch_last_arrival_lag_seconds` exports it); the last bucket is +Inf
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

_REASONS = {int(r): r.name for r in DropReason}
_EVENTS = {int(e): e.name for e in Event}
_TYPES = {int(t): t.name for t in MsgType}


def _name(table: dict[int, str], key: object) -> str:
    try:
        return table.get(int(key), str(key))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return str(key)


class SwitchCollector:
    """The software switch's counters (`SoftwareSwitch.counters()`) as Prometheus metrics."""

    def __init__(self, counters: Callable[[], dict]):
        self.counters = counters

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        c = self.counters()
        drops = CounterMetricFamily("luwu_switch_drops", "packets dropped, by reason", labels=["reason"])
        drop_bytes = CounterMetricFamily("luwu_switch_drop_bytes", "bytes dropped, by reason", labels=["reason"])
        for code, (packets, nbytes) in sorted(c.get("drops", {}).items(), key=lambda kv: int(kv[0])):
            drops.add_metric([_name(_REASONS, code)], packets)
            drop_bytes.add_metric([_name(_REASONS, code)], nbytes)
        events = CounterMetricFamily("luwu_switch_events", "pipeline events (COMPLETED, RESENT, ...)",
                                     labels=["event"])
        for code, (packets, _) in sorted(c.get("events", {}).items(), key=lambda kv: int(kv[0])):
            events.add_metric([_name(_EVENTS, code)], packets)
        rx = CounterMetricFamily("luwu_switch_rx_packets", "luwu packets received, by message type", labels=["type"])
        for code, (packets, _) in sorted(c.get("rx_types", {}).items(), key=lambda kv: int(kv[0])):
            if packets:
                rx.add_metric([_name(_TYPES, code)], packets)
        sessions = CounterMetricFamily("luwu_switch_session_packets", "packets of each session", labels=["session"])
        for sid, (packets, _) in sorted(c.get("session_packets", {}).items(), key=lambda kv: int(kv[0])):
            sessions.add_metric([str(sid)], packets)
        ports = CounterMetricFamily("luwu_switch_port_packets", "per-port counters (rx, tx, ring full, simulated loss)",
                                    labels=["port", "counter"])
        for port, values in sorted(c.get("ports", {}).items(), key=lambda kv: int(kv[0])):
            for key, value in sorted(values.items()):
                if isinstance(value, (int, float)):
                    ports.add_metric([str(port), key], value)
        yield from (drops, drop_bytes, events, rx, sessions, ports)
        yield from _straggler_metrics(c.get("stragglers") or {})


def _straggler_metrics(stragglers: dict) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily


    labels = ["session", "worker"]
    fams = {f: CounterMetricFamily(f"luwu_switch_{name}", text, labels=labels) for f, name, text in (
        ("contributions", "contributions", "aggregation packets accepted, by session and worker"),
        ("duplicates", "duplicates", "retransmitted contributions the slot already held"),
        ("last", "last_arrivals", "slots whose last contribution (the one completing the sum) came from the worker"))}
    lag = HistogramMetricFamily("luwu_switch_last_arrival_lag_seconds", "when the worker completed a slot: seconds "
                                "since the slot's first contribution", labels=labels)
    bounds = [str(b) for b in LAG_BUCKETS] + ["+Inf"]
    for session, workers in sorted(stragglers.items(), key=lambda kv: int(kv[0])):
        for worker, st in sorted(workers.items(), key=lambda kv: int(kv[0])):
            key = [str(session), str(worker)]
            for f, fam in fams.items():
                fam.add_metric(key, st[f])
            running, buckets = 0, []
            for bound, n in zip(bounds, st["lag_buckets"]):
                running += n
                buckets.append((bound, running))
            lag.add_metric(key, buckets, sum_value=st["lag_seconds"])
    yield from fams.values()
    yield lag


class NodeCollector:
    """An optimizer node's `stats()` as Prometheus metrics."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        node = s.get("node", {})
        for key in ("submitted", "published", "saturated_gradients", "skipped_steps"):
            yield CounterMetricFamily(f"luwu_node_{key}", f"layer gradients {key.replace('_', ' ')}",
                                      value=node.get(key, 0))
        rejected = CounterMetricFamily("luwu_node_rejected", "gradients refused, by reason", labels=["reason"])
        for reason, n in sorted((node.get("rejected") or {}).items()):
            rejected.add_metric([str(reason)], n)
        yield rejected
        yield GaugeMetricFamily("luwu_node_up", "1 while the node works, 0 once it failed",
                                value=0 if node.get("error") else 1)
        pipe = s.get("pipeline", {})
        busy = CounterMetricFamily("luwu_node_stage_busy_seconds", "seconds each pipeline stage worked",
                                   labels=["stage"])
        for stage, seconds in sorted((pipe.get("busy_seconds") or {}).items()):
            busy.add_metric([stage], seconds)
        queued = GaugeMetricFamily("luwu_node_queued", "work items waiting, by pipeline stage", labels=["stage"])
        for stage, n in sorted((pipe.get("queued") or {}).items()):
            queued.add_metric([stage], n)
        nbytes = GaugeMetricFamily("luwu_node_bytes", "RAM held by the state store and the served copies",
                                   labels=["part", "kind"])
        for part in ("store", "served"):
            for kind in ("resident_bytes", "pooled_bytes", "budget"):
                value = (s.get(part) or {}).get(kind)
                if isinstance(value, (int, float)):
                    nbytes.add_metric([part, kind], value)
        io = CounterMetricFamily("luwu_node_io", "state file I/O (reads, writes, bytes)", labels=["kind"])
        for kind, value in sorted((s.get("io") or {}).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                io.add_metric([kind], value)
        yield from (busy, queued, nbytes, io)


class EngineCollector:
    """The SmartNIC engines of a worker process (`Engine.session_stats()` of each) as Prometheus
    gauges `luwu_engine_stat{engine, section, name}`: section "engine" (operations, packets,
    retransmissions, ...), "socket" (datagrams and bytes each way) or "session N" (its windows,
    streams and round-trip estimate, nested names joined with a dot)."""

    def __init__(self, stats: Callable[[], dict[str, dict]]):
        self.stats = stats  # engine name -> its session_stats() (None: not readable now)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("luwu_engine_stat", "a SmartNIC engine's counters and estimates",
                              labels=["engine", "section", "name"])
        for engine, stats in sorted(self.stats().items()):
            for section, values in sorted((stats or {}).items()):
                for name, value in _flat(values):
                    g.add_metric([engine, section, name], value)
        yield g


def _flat(values: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(values, dict):
        for k, v in sorted(values.items(), key=lambda kv: str(kv[0])):
            yield from _flat(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    elif isinstance(values, (int, float)) and not isinstance(values, bool) and prefix:
        yield prefix, float(values)


def serve(address: str, *collectors: Any) -> tuple[str, int]:
    """Serve /metrics for `collectors` (and the process's CPU/memory) on `address` (HOST:PORT;
    port 0 picks one) for the rest of the process. Returns the (host, port) it listens on."""
    return serve_stoppable(address, *collectors)[0]


def serve_stoppable(address: str, *collectors: Any) -> tuple[tuple[str, int], Callable[[], None]]:
    """`serve`, also returning a function that stops the endpoint and closes its socket (for
    servers that live inside a longer process, e.g. an in-process controller)."""
    from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

    host, port = check_host_port(address, "--metrics")
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    for c in collectors:
        registry.register(c)
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return (host, server.server_address[1]), stop
