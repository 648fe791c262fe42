"""The demo's plan prediction against its measured iteration time (report.json `prediction`).

The prediction is `luwu-ctl plan JOB --explain`'s (controller/planner.py `predict_iteration`) on
the job's plan, with the measured inputs the planner cannot know by itself
(docs/simulator.md "Calibration by measurement"):

* each optimizer node's params/s as the controller has it registered: the rate the node measured
  when it started (luwu/bench/node_rate.py), unless `luwu node --params-per-second` set one;
* the workers' compute per iteration (`compute_s`): from the first steps after the warm-up step
  (`FIRST_STEPS`), each step's slowest rank's step time less the time it waited on the network
  (luwu/demo/worker.py `compute_seconds`), the median over those steps;
* links at `LINK_GBPS` (luwu-ctl's default): the demo's ports are loopback rings or sockets with no
  line rate, so the network terms are what a 100 Gbit/s link would take.

It is then set beside the measured iteration time of the steps after those (the median of each
step's slowest rank), so that no step the prediction used is one it is judged on. `capture` reads
the plan and the capacities while the controller runs; `compare` needs only the workers' reports.
"""

from __future__ import annotations

import statistics
from typing import Any

FIRST_STEPS = 5  # steps after the first (warm-up) one whose compute time the prediction takes
LINK_GBPS = 100.0  # the prediction's link (luwu-ctl plan --link-gbps default); loopback has no line rate


def capture(fabric: Any, served_dtype: str) -> dict:
    """What the prediction needs from the control plane, read while it runs: the job's plan JSON and
    every node's registered params/s; {"unavailable": why} without a controller."""
    admin = getattr(fabric, "admin", None)
    if admin is None or not getattr(fabric, "job_id", ""):
        return {"unavailable": "the prediction needs the controller's plan (this run had no controller)"}
    from luwu.controller.client import ControllerRefused, ControllerUnreachable

    try:
        plan_json = admin.plan(fabric.job_id).plan_json
        capacities = {n.name: float(n.capacity.params_per_second) for n in admin.nodes()}
    except (ControllerUnreachable, ControllerRefused) as exc:
        return {"unavailable": f"the controller did not answer GetPlan/ListNodes ({str(exc)[:200]})"}
    return {"job_id": fabric.job_id, "plan_json": plan_json, "capacities": capacities,
            "node_rates": dict(getattr(fabric, "node_rates", {})), "served_dtype": served_dtype}


def _slowest(reports: dict[int, dict], key: str) -> list[float]:
    """Per step, the largest value of `key` over the ranks (the slowest rank sets the pace)."""
    rows = [reports[r].get(key) or [] for r in sorted(reports)]
    n = min(len(row) for row in rows) if rows else 0
    return [max(float(row[i]) for row in rows) for i in range(n)]


def compare(captured: dict, reports: dict[int, dict], first_steps: int = FIRST_STEPS) -> dict:
    """The prediction from `captured` and the workers' first steps, beside the measured iteration time.

    Args:
        captured: `capture`'s result.
        reports: rank -> the worker's report (`step_seconds`, `compute_seconds` per step).
        first_steps: steps after the warm-up step whose compute time the prediction uses.

    Returns:
        A dict: `predicted_s`, `measured_s`, `ratio` (predicted / measured), `bottleneck`, `busy_s`,
        `compute_s`, `node_params_per_second`, `link_gbps`, which steps gave each figure, and per step
        the slowest rank's `iteration_seconds` and `compute_seconds`; or {"unavailable": why} (no
        controller, too few steps, a plan that cannot be read).

    Examples::

        >>> captured = capture(fabric, "bf16")  # while the controller runs
        >>> out = compare(captured, {0: {"step_seconds": [0.5, 0.3, 0.3, 0.3],
        ...                              "compute_seconds": [0.4, 0.25, 0.25, 0.25]}}, first_steps=2)
        >>> out["compute_steps"], out["measured_steps"]
        ([1, 2], [3, 3])
    """
    if "unavailable" in captured:
        return dict(captured)
    from luwu.controller.plan import JobPlan
    from luwu.controller.planner import predict_iteration

    steps, compute = _slowest(reports, "step_seconds"), _slowest(reports, "compute_seconds")
    if len(compute) < 2:
        return {"unavailable": f"{len(compute)} step(s): the prediction needs the warm-up step and at least one more"}
    used = list(range(1, min(1 + first_steps, len(compute))))
    judged = list(range(used[-1] + 1, len(steps))) or used  # a short run: judged on the same steps
    compute_s = statistics.median(compute[i] for i in used)
    measured_s = statistics.median(steps[i] for i in judged)
    dtype = captured.get("served_dtype") or "bf16"
    try:
        plan = JobPlan.from_json(captured["plan_json"])
        predicted = predict_iteration(plan, captured["capacities"], LINK_GBPS * 1e9 / 8,
                                      param_bytes=4 if dtype == "fp32" else 2, compute_s=compute_s)
    except (ValueError, KeyError, TypeError) as exc:  # the training run's report outlives a plan it cannot read
        return {"unavailable": f"the job's plan could not be read for a prediction ({type(exc).__name__}: {exc})"}
    return {"predicted_s": predicted["iteration_s"], "measured_s": measured_s,
            "ratio": predicted["iteration_s"] / measured_s if measured_s > 0 else None,
            "bottleneck": predicted["bottleneck"], "busy_s": predicted["busy_s"], "compute_s": compute_s,
            "compute_steps": used, "measured_steps": [judged[0], judged[-1]],
            "node_params_per_second": {n: captured["capacities"].get(n, 0.0) for n in plan.nodes},
            "node_rates": captured["node_rates"],
            "unknown_nodes": predicted["unknown_nodes"], "link_gbps": LINK_GBPS, "param_dtype": dtype,
            "job_id": captured["job_id"], "iteration_seconds": steps, "compute_seconds": compute,
            "how": "luwu-ctl plan JOB --explain --compute-s COMPUTE_S with the nodes' measured params/s "
                   "(docs/simulator.md \"Calibration by measurement\")"}


def summary_line(report: dict) -> str | None:
    """One line for the demo's summary: predicted against measured iteration time, or why not."""
    p = report.get("prediction")
    if not p:
        return None
    if "unavailable" in p:
        return f"plan prediction: not made ({p['unavailable']})"
    rates = ", ".join(f"{n} {r:.3g}" for n, r in p["node_params_per_second"].items() if r)
    return (f"plan prediction: {p['predicted_s'] * 1000:.0f} ms per iteration (bottleneck {p['bottleneck']}; "
            f"worker compute {p['compute_s'] * 1000:.0f} ms from steps {p['compute_steps'][0]}-"
            f"{p['compute_steps'][-1]}, node params/s {rates}); measured {p['measured_s'] * 1000:.0f} ms (median of "
            f"steps {p['measured_steps'][0]}-{p['measured_steps'][1]}): predicted/measured {p['ratio']:.2f} "
            "(iteration.png)")
