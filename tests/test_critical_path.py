"""The critical path of an iteration (dataplane/observe/critical_path.py) on synthetic traces whose path is
known by construction: the straggler's backward and push, the hand-over through the switch, the
node's stages, the wait for its publish; nested spans; a pull that waits on the node."""

from __future__ import annotations

import itertools

import pytest

from luwu.dataplane.observe import critical_path

W0, W1, NODE, SWITCH = 10, 11, 20, 30


def _meta() -> list[dict]:
    return [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
            for pid, name in [(W0, "worker 0 (mnn)"), (W1, "worker 1 (mnn)"), (NODE, "optimizer node (n0)"),
                              (SWITCH, "switch")]]


def _x(pid: int, name: str, cat: str, a: int, b: int, tid: int = 1, **args) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": a, "dur": b - a, "pid": pid, "tid": tid, "args": args}


def _iteration(v: int) -> list[dict]:
    """Iteration v at 1000 v us: worker 1 is the straggler (its backward ends 100 us later), the
    switch turns for 30 us of the 80 us between its push and the node's read."""
    b = 1000 * v
    ev = []
    for pid, late in [(W0, 0), (W1, 100)]:
        end = b + 300 + late
        ev += [_x(pid, "pull wait", "worker", b, b + 50, unit=0, version=v),
               _x(pid, "forward", "worker", b + 60, b + 160, unit=0, version=v),
               _x(pid, "backward", "worker", b + 170, end, unit=0, version=v),
               _x(pid, "push", "worker", end, end + 20, unit=0, version=v, bytes=4)]
    ev.append(_x(W1, "push wait", "worker", b + 200, b + 220, unit=9, version=v))  # nested in the backward
    ev += [_x(W0, "push wait", "worker", b + 340, b + 700, unit=0, version=v),
           _x(W1, "push wait", "worker", b + 440, b + 690, unit=0, version=v),
           _x(SWITCH, "pipeline turn", "switch", b + 330, b + 380, packets=2),
           _x(SWITCH, "pipeline turn", "switch", b + 440, b + 470, packets=2)]
    for tid, (stage, lo, hi) in enumerate([("receive", 495, 500), ("read", 500, 510), ("optimize", 510, 600),
                                           ("write", 600, 610), ("publish", 620, 650)], start=1):
        ev.append(_x(NODE, stage, "optimizer", b + lo, b + hi, tid=tid, layer=0, step=v))
    return ev


def test_the_path_runs_through_the_straggler_the_switch_and_the_node():
    events = _meta() + _iteration(0) + _iteration(1) + _iteration(2)
    cp = critical_path.analyse(events)
    assert cp["iteration"] == 1  # the middle one: neither warm-up nor the cut-short last
    assert (cp["start_us"], cp["end_us"]) == (1000, 1700) and cp["seconds"] == pytest.approx(700e-6)
    want = {"worker pull wait": 50, "worker other": 20, "worker forward": 100, "worker backward": 210,
            "worker push wait": 70, "worker push": 20, "network": 45, "switch": 30, "node receive": 5,
            "node read": 10, "node optimize": 90, "node write": 10, "node queue": 10, "node publish": 30}
    assert {k: round(v * 1e6) for k, v in cp["components"].items()} == want
    assert sum(cp["share"].values()) == pytest.approx(1.0)
    assert cp["critical_worker"] == "worker 1 (mnn)"
    path = [(seg["component"], seg["process"].split(" (")[0]) for seg in cp["path"]]
    assert path[:3] == [("worker pull wait", "worker 1"), ("worker other", ""), ("worker forward", "worker 1")]
    assert path[-3:] == [("node queue", ""), ("node publish", "optimizer node"), ("worker push wait", "worker 0")]
    starts = [seg["start_us"] for seg in cp["path"]]
    assert starts == sorted(starts) and all(
        a["end_us"] == b["start_us"] for a, b in itertools.pairwise(cp["path"]))  # one unbroken chain
    # a trace without `receive` spans (older nodes): the read takes the gradient from the pushes itself
    older = critical_path.analyse([e for e in events if e["name"] != "receive"])
    assert "node receive" not in older["components"] and round(older["components"]["network"] * 1e6) == 50


def test_a_pull_that_waits_for_the_publish_hands_the_path_to_the_node():
    events = _meta() + [
        _x(W0, "forward", "worker", 0, 100, unit=0, version=0),
        _x(NODE, "write", "optimizer", 1050, 1100, tid=3, layer=0, step=0),
        _x(NODE, "publish", "optimizer", 1100, 1150, tid=4, layer=0, step=0),
        _x(W0, "pull wait", "worker", 1000, 1200, unit=0, version=1),
        _x(W0, "forward", "worker", 1200, 1300, unit=0, version=1)]
    cp = critical_path.analyse(events, iteration=1)
    assert {k: round(v * 1e6) for k, v in cp["components"].items()} == {
        "worker forward": 100, "worker pull wait": 50, "node publish": 50, "node write": 50, "node queue": 50}


def test_a_trace_without_worker_iterations_says_so():
    with pytest.raises(ValueError, match="LUWU_TRACE_DIR"):
        critical_path.analyse(_meta() + [_x(SWITCH, "pipeline turn", "switch", 0, 10)])
    with pytest.raises(ValueError, match="no iteration 7"):
        critical_path.analyse(_meta() + _iteration(0), iteration=7)


def test_the_fast_lane_receive_batched_optimize_publish_is_followed():
    """A shard in RAM skips the read and write threads, and one optimizer call steps every queued
    layer (its span names them all in `layers`): the path still runs publish -> the batched
    optimize -> the receive of the layer that arrived last -> the worker's push."""
    def fast(v: int) -> list[dict]:
        b = 1000 * v
        ev = [_x(W0, "pull wait", "worker", b, b + 50, unit=0, version=v),
              _x(W0, "backward", "worker", b + 50, b + 300, unit=0, version=v),
              _x(W0, "push", "worker", b + 300, b + 320, unit=0, version=v, bytes=4),
              _x(W0, "push wait", "worker", b + 320, b + 700, unit=0, version=v),
              _x(NODE, "receive", "optimizer", b + 290, b + 295, tid=1, layer=1, step=v),  # the other unit
              _x(NODE, "receive", "optimizer", b + 420, b + 430, tid=1, layer=0, step=v),
              _x(NODE, "optimize", "optimizer", b + 450, b + 600, tid=2, layer=1, step=v, shards=2,
                 layers=[[1, v], [0, v]]),
              _x(NODE, "publish", "optimizer", b + 610, b + 650, tid=3, layer=0, step=v)]
        return ev
    cp = critical_path.analyse(_meta() + fast(0) + fast(1) + fast(2))
    got = {k: round(v * 1e6) for k, v in cp["components"].items()}
    assert got == {"worker pull wait": 50, "worker backward": 250, "worker push": 20, "network": 100,
                   "node receive": 10, "node queue": 30, "node optimize": 150, "node publish": 40,
                   "worker push wait": 50}, got
