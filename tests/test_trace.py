"""The timeline: processes that find LUWU_TRACE_DIR write complete events on one clock, and
`merge` makes one Chrome trace with a named track per process; without it nothing is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from luwu.dataplane.observe import trace

CHILD = """
import sys, time
from luwu.dataplane.observe import trace
trace.start(sys.argv[1])
for i in range(3):
    with trace.span("step", "test", i=i):
        time.sleep(0.01)
"""


def _run(name: str, env: dict) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, name], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_two_processes_merge_into_one_chrome_trace(tmp_path):
    env = dict(os.environ, **{trace.ENV: str(tmp_path)})
    _run("switch", env)
    _run("node", env)
    data = json.loads(trace.merge(tmp_path).read_text())
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(names.values()) == ["node", "switch"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 and {e["pid"] for e in spans} == set(names)
    assert all(e["dur"] >= 10_000 for e in spans)  # 10 ms sleeps, in microseconds
    first, second = sorted(names, key=lambda p: min(e["ts"] for e in spans if e["pid"] == p))
    assert max(e["ts"] + e["dur"] for e in spans if e["pid"] == first) <= min(
        e["ts"] for e in spans if e["pid"] == second)  # one clock: the first process's spans end first


def test_off_without_the_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != trace.ENV}
    env["HOME"] = str(tmp_path)
    _run("quiet", env)
    assert not list(tmp_path.rglob("trace-*.jsonl"))


def test_merge_labels_the_processes_a_caller_names(tmp_path):
    env = dict(os.environ, **{trace.ENV: str(tmp_path)})
    _run("switch", env)
    _run("worker 0 (w0)", env)
    pids = {json.loads(f.read_text().splitlines()[0])["args"]["name"]: int(f.stem.split("-")[1])
            for f in tmp_path.glob("trace-*.jsonl")}
    out = trace.merge(tmp_path, tmp_path / "labelled.json", labels={pids["switch"]: "switch-s1"})
    names = {e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "M"}
    assert names == {"switch (switch-s1)", "worker 0 (w0)"}


ARGS_CHILD = """
import threading
from luwu.dataplane.observe import trace
trace.start("args")
ARGS = [{"i": 0}, {"layer": 'a"b\\\\c', "x": 1.5, "ok": True, "none": None, "l": [1, "\\u00e9"], "big": 2 ** 70},
        {"neg": -3, "label": "unit 7"}, {}]
def spans(tag):
    for i in range(trace.PENDING + 7):  # more than one batch of pending events per thread
        with trace.span(f"s{tag}", "test", **ARGS[i % len(ARGS)], n=i):
            pass
threads = [threading.Thread(target=spans, args=(t,)) for t in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_every_span_and_its_arguments_reach_the_trace(tmp_path):
    env = dict(os.environ, **{trace.ENV: str(tmp_path)})
    out = subprocess.run([sys.executable, "-c", ARGS_CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    spans = [e for e in json.loads(trace.merge(tmp_path).read_text())["traceEvents"] if e["ph"] == "X"]
    args = [{"i": 0}, {"layer": 'a"b\\c', "x": 1.5, "ok": True, "none": None, "l": [1, "\u00e9"], "big": 2 ** 70},
            {"neg": -3, "label": "unit 7"}, {}]
    for tag in (0, 1):
        mine = sorted((e for e in spans if e["name"] == f"s{tag}"), key=lambda e: e["args"]["n"])
        assert [e["args"]["n"] for e in mine] == list(range(trace.PENDING + 7))
        assert all(e["args"] == dict(args[e["args"]["n"] % len(args)], n=e["args"]["n"]) for e in mine)
        assert len({e["tid"] for e in mine}) == 1 and all(e["cat"] == "test" and e["dur"] >= 0 for e in mine)
