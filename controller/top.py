"""What `luwu-ctl top` shows, gathered by the controller: each job's switches' straggler, throughput
and drop counters, scraped from the Prometheus endpoints the switches registered
(`Switch.metrics_address`, `luwu switch --metrics` with `--controller`) and mapped from
(session, worker) and ports to the job's ranks through its plan.

The controller, not the operator's machine, scrapes: it already knows every switch and every
plan, the operator needs only the controller's address and token, and a deployment's switch
management addresses need not be reachable from where `luwu-ctl` runs. A snapshot holds
cumulative counters; `luwu-ctl top` takes two and shows their difference (rates, the window's
straggler). A switch without a metrics endpoint (a BMv2 or Tofino: the per-worker last-arrival
bookkeeping is the software switch's) is listed with an error saying so.
"""

from __future__ import annotations

import time
import urllib.request

from .plan import JobPlan

SCRAPE_TIMEOUT = 5.0  # seconds one switch's /metrics may take
PER_WORKER = ("contributions", "duplicates", "last", "lag_seconds")
_FAMILIES = {"luwu_switch_contributions": "contributions", "luwu_switch_duplicates": "duplicates",
             "luwu_switch_last_arrivals": "last"}


def scrape(address: str, timeout: float = SCRAPE_TIMEOUT) -> dict:
    """One switch's /metrics as {"stragglers": {(session, worker): {field: value}}, "ports": {port: {counter: value}}}.

    Raises OSError (unreachable, HTTP error) or ValueError (not a Prometheus exposition)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    stragglers: dict[tuple[int, int], dict[str, float]] = {}
    ports: dict[int, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.name in _FAMILIES and s.name.endswith("_total"):
                key = (int(s.labels["session"]), int(s.labels["worker"]))
                stragglers.setdefault(key, {})[_FAMILIES[fam.name]] = s.value
            elif s.name == "luwu_switch_last_arrival_lag_seconds_sum":
                key = (int(s.labels["session"]), int(s.labels["worker"]))
                stragglers.setdefault(key, {})["lag_seconds"] = s.value
            elif s.name == "luwu_switch_port_packets_total":
                ports.setdefault(int(s.labels["port"]), {})[s.labels["counter"]] = s.value
    return {"stragglers": stragglers, "ports": ports}


def job_top(plan: JobPlan, scraped: dict[str, dict | str]) -> dict:
    """One job's snapshot from its switches' scrapes (`scraped`: switch -> scrape() or an error text).

    Returns {"switches": {name: error or ""}, "workers": {rank: {"switch", "port", "contributions",
    "duplicates", "last", "lag_seconds", "completed", "rx_packets", "rx_dropped", "tx_sim_lost"}}}: a
    rank's counters summed over its group's sessions on the switch it is plugged into; `completed`
    counts the slots of those sessions completed by anyone (the denominator of a rank's share of last
    arrivals)."""
    switches = {name: (res if isinstance(res, str) else "") for name, res in scraped.items()}
    workers: dict[str, dict] = {}
    for p in sorted(plan.placements, key=lambda p: p.rank):
        res = scraped.get(p.switch)
        entry: dict = {"switch": p.switch, "port": p.port}
        if isinstance(res, dict):
            sessions = {s.spec.session for s in plan.sessions if s.group == p.group and p.switch in s.switches}
            st = res["stragglers"]
            for f in PER_WORKER:
                entry[f] = sum(v.get(f, 0.0) for (sid, w), v in st.items() if sid in sessions and w == p.rank)
            entry["completed"] = sum(v.get("last", 0.0) for (sid, _), v in st.items() if sid in sessions)
            port = res["ports"].get(p.port, {})
            for f in ("rx_packets", "rx_dropped", "tx_sim_lost"):
                entry[f] = port.get(f, 0.0)
        workers[str(p.rank)] = entry
    return {"switches": switches, "workers": workers}


def snapshot(plans: dict[str, JobPlan], metrics_addresses: dict[str, str]) -> dict:
    """Scrape every switch the jobs use (each once) and build {"time", "jobs": {job: job_top()}}.
    Blocking: the controller runs it in a worker thread."""
    needed = sorted({sw for plan in plans.values() for sw in plan.programs})
    scraped: dict[str, dict | str] = {}
    for name in needed:
        address = metrics_addresses.get(name, "")
        if not address:
            scraped[name] = ("no metrics endpoint registered (start `luwu switch` with --metrics HOST:PORT; "
                             "BMv2/Tofino have no per-worker last-arrival counters)")
            continue
        try:
            scraped[name] = scrape(address)
        except (OSError, ValueError, KeyError) as exc:
            scraped[name] = f"cannot scrape http://{address}/metrics: {exc}"
    now = time.time()
    return {"time": now, "jobs": {job: job_top(plan, {n: scraped[n] for n in plan.programs})
                                  for job, plan in sorted(plans.items())}}
