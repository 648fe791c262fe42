"""The demo's plan prediction (luwu/demo/prediction.py) from measured inputs: the nodes' measured
params/s and the workers' compute time of their first steps go into the planner's closed form
(controller/planner.py `predict_iteration`) for a real plan, and the prediction is set beside the
iteration time of the later steps. Given inputs, exact figures; no timing is measured here."""

from __future__ import annotations

import itertools
import json

import pytest

from luwu.controller import topology as T
from luwu.controller.job_spec import JobSpec
from luwu.controller.planner import Planner, predict_iteration
from luwu.controller.usage import SwitchUsage
from luwu.demo import prediction

LAYERS = [(0, 50_000), (1, 30_000)]
SLOTS = 1024


def _captured(rate: float) -> dict:
    topo = T.star(2, 1, lanes=2048, slots=SLOTS)
    counter = itertools.count(100)
    plan = Planner().plan("demo-1", JobSpec("demo-1", 2, LAYERS, packet_mode="jumbo", num_nodes=1), topo,
                          SwitchUsage({"s1": SLOTS}), lambda: next(counter))
    assert plan.nodes == ["n0"]
    return {"job_id": "demo-1", "plan_json": plan.to_json(), "capacities": {"n0": rate},
            "node_rates": {"n0": {"params_per_second": rate, "source": "measured"}}, "served_dtype": "bf16"}


# step 0 is the warm-up; steps 1-5 give the compute time (rank 1 is slower on some: the slowest rank
# counts per step; step 5's spike is outvoted by the median); steps 6-9 are what the prediction is judged on
REPORTS = {
    0: {"step_seconds": [2.0, 0.26, 0.25, 0.27, 0.24, 0.9, 0.25, 0.26, 0.30, 0.24],
        "compute_seconds": [1.5, 0.20, 0.18, 0.22, 0.19, 0.8, 0.2, 0.2, 0.2, 0.2]},
    1: {"step_seconds": [2.1, 0.25, 0.27, 0.26, 0.25, 0.9, 0.27, 0.25, 0.28, 0.29],
        "compute_seconds": [1.6, 0.19, 0.21, 0.20, 0.22, 0.7, 0.2, 0.2, 0.2, 0.2]},
}
COMPUTE_S = 0.22  # median of the per-step maxima 0.20, 0.21, 0.22, 0.22, 0.8 (steps 1-5)
MEASURED_S = 0.28  # median of the per-step maxima 0.27, 0.26, 0.30, 0.29 (steps 6-9)


def test_compute_bound_the_prediction_is_the_first_steps_compute_plus_the_last_step():
    fast = 1e9  # a measured node rate far above what the job needs
    out = prediction.compare(_captured(fast), REPORTS)
    assert out["compute_steps"] == [1, 2, 3, 4, 5] and out["measured_steps"] == [6, 9]
    assert out["compute_s"] == pytest.approx(COMPUTE_S) and out["measured_s"] == pytest.approx(MEASURED_S)
    # every layer's network and node time is below its share of the compute: the iteration is the compute
    # time plus the node's step of layer 0 (stepped last, and the next forward waits for it)
    assert out["predicted_s"] == pytest.approx(COMPUTE_S + 50_000 / fast, rel=1e-9)
    assert out["bottleneck"] == "worker GPU"
    assert out["ratio"] == pytest.approx(out["predicted_s"] / MEASURED_S, rel=1e-12)
    assert out["node_params_per_second"] == {"n0": fast} and out["link_gbps"] == prediction.LINK_GBPS
    assert out["iteration_seconds"][2] == 0.27 and out["compute_seconds"][2] == 0.21  # per step, slowest rank
    json.dumps(out)  # report.json takes it as it is


def test_node_bound_the_measured_node_rate_sets_the_prediction():
    slow = 1e5  # layer 0 takes 0.5 s and layer 1 0.3 s on the node: each above its compute share
    out = prediction.compare(_captured(slow), REPORTS)
    forward = COMPUTE_S / 4  # the pulls at 100 Gbit/s are far shorter than the forward's share
    backward = 50_000 / slow + 30_000 / slow
    assert out["predicted_s"] == pytest.approx(forward + backward + 50_000 / slow, rel=1e-9)
    assert out["bottleneck"] == "optimizer node"
    # the same as luwu-ctl plan JOB --explain --compute-s COMPUTE_S with the node registered at that rate
    captured = _captured(slow)
    from luwu.controller.plan import JobPlan

    again = predict_iteration(JobPlan.from_json(captured["plan_json"]), {"n0": slow}, prediction.LINK_GBPS * 1e9 / 8,
                              compute_s=COMPUTE_S)
    assert out["predicted_s"] == again["iteration_s"]


def test_a_short_run_is_judged_on_its_steps_and_one_step_is_not_enough():
    short = {r: {k: v[:3] for k, v in rep.items()} for r, rep in REPORTS.items()}
    out = prediction.compare(_captured(1e9), short)
    assert out["compute_steps"] == [1, 2] and out["measured_steps"] == [1, 2]
    assert out["compute_s"] == pytest.approx((0.20 + 0.21) / 2) and out["measured_s"] == pytest.approx((0.26 + 0.27) / 2)
    one = {r: {k: v[:1] for k, v in rep.items()} for r, rep in REPORTS.items()}
    assert "warm-up step" in prediction.compare(_captured(1e9), one)["unavailable"]


def test_without_a_controller_the_report_says_why_and_the_summary_too():
    class Embedded:  # LocalFabric has neither an admin client nor a job id
        pass

    captured = prediction.capture(Embedded(), "bf16")
    out = prediction.compare(captured, REPORTS)
    assert "controller" in out["unavailable"]
    assert prediction.summary_line({"prediction": out}).startswith("plan prediction: not made (")
    line = prediction.summary_line({"prediction": prediction.compare(_captured(1e9), REPORTS)})
    assert "predicted/measured 0.79" in line and "measured 280 ms" in line, line
    assert prediction.summary_line({}) is None


def test_a_plan_that_cannot_be_read_is_named_not_raised():
    captured = dict(_captured(1e9), plan_json="{}")
    assert "plan could not be read" in prediction.compare(captured, REPORTS)["unavailable"]
