"""The software switch's process for `LoopbackSwitch(process=True)` (launch.py): started as
`python -m luwu.dataplane.loopback.daemon`, it reads its plan as a JSON line on stdin, answers its
switch ports, then serves `counters`, `load-kernels`, `kernels`, `stop` and the requests of the
switches it hosts besides its own, until its stdin closes (its parent is gone).

Like the engine daemon (dataplane/engine/daemon.py), it lives in the data plane because the worker
side starts it (the torch backend with no controller); the application daemons are in luwu/daemons.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import TYPE_CHECKING

from ..process.heap import freeze_collector, retain_freed_memory
from .plan import KERNELS_DEFER, KERNELS_TIMEOUT, build_switch, plan_from_json

if TYPE_CHECKING:
    from ..switch import SoftwareSwitch

def _serve_stdin() -> int:
    """Body of LoopbackSwitch(process=True): a request line, then `counters` / `stop` until EOF."""
    # before the request: a prestarted process imports the switch while its parent works out the plan
    from .. import switch  # noqa: F401

    go = threading.Event()  # the kernels load once set (`load-kernels`, `kernels`) or after KERNELS_DEFER s
    _load_kernels(after=go)  # registered now (the datapath runs the reference until then), loaded after
    first = sys.stdin.readline()
    if not first:
        return 1
    req = json.loads(first)
    plan = plan_from_json(req["plan"])
    from ..observe import trace

    trace.start("switch (loopback)")  # with LUWU_TRACE_DIR, like `luwu switch` (docs/observability.md)
    retain_freed_memory()  # a process of its own: keep the turns' temporaries mapped (heap.py)
    freeze_collector()  # and keep start-up objects out of the collector's traversals (heap.py)
    sw = build_switch(plan, req.get("drop") or {}, int(req.get("seed", 0)), req.get("runtime"))
    sw.start()
    print(json.dumps({"switch_ports": {str(k): list(v) for k, v in plan.switch_ports.items()}}), flush=True)
    hosted: dict[int, SoftwareSwitch] = {}  # id -> switch started by {"op": "add"} (LoopbackSwitch(host=...))
    try:
        for line in sys.stdin:  # EOF: the parent is gone
            cmd = line.strip()
            if cmd == "counters":
                print(json.dumps(sw.counters(), default=str), flush=True)
            elif cmd == "load-kernels":  # the job's start-up is over: load them now
                go.set()
                print(json.dumps({"loading": True}), flush=True)
            elif cmd == "kernels":  # block until the compiled kernels are in (benchmarks' steady state)
                from ..kernels import use_numba, wait_loaded

                go.set()
                wait_loaded(KERNELS_TIMEOUT)
                print(json.dumps({"compiled": use_numba()}), flush=True)
            elif cmd == "stop":
                trace.flush()  # before answering: the parent may SIGTERM this process as soon as it reads it
                print(json.dumps({"stopped": True}), flush=True)
                break
            elif cmd.startswith("{"):
                print(json.dumps(_hosted_request(json.loads(cmd), hosted), default=str), flush=True)
    finally:
        for other in hosted.values():
            other.stop()
        sw.stop()
    return 0


def _load_kernels(after: threading.Event) -> None:
    """Load the switch's compiled lane kernels (numba: ~0.5 s of CPU) in the background
    (dataplane/kernels `load_in_background`) once `after` is set (or `KERNELS_DEFER` s have
    passed); until they are in, the aggregations run the numpy reference (same bits), and
    `use_numba()` says so without importing numba. The loading waits for the job's start-up
    (`LoopbackSwitch.load_kernels`, after the torch backend's start barrier): its thread holds the
    GIL for most of numba's import and, at low priority on a busy host, would stall the switch's
    start-up and first aggregations, which every rank's init_process_group waits for."""
    from ..kernels import load_in_background

    def load() -> None:
        after.wait(KERNELS_DEFER)  # before the imports: switch_lanes imports numba
        from ..kernels.switch_lanes import warm_up
        from ..process.heap import refreeze

        warm_up()
        refreeze()  # the switch process froze its start-up objects: numba's are long-lived too (heap.py)

    load_in_background(load, "luwu-switch-kernels-load")


def _hosted_request(req: dict, hosted: dict[int, SoftwareSwitch]) -> dict:
    """add / counters / stop of a switch this process hosts besides its own."""
    op = req.get("op")
    try:
        if op == "add":
            plan = plan_from_json(req["plan"])
            other = build_switch(plan, req.get("drop") or {}, int(req.get("seed", 0)), req.get("runtime"))
            other.start()
            key = max(hosted, default=0) + 1
            hosted[key] = other
            return {"id": key, "switch_ports": {str(k): list(v) for k, v in plan.switch_ports.items()}}
        found = hosted.get(int(req.get("id", 0)))
        if found is None:
            return {"error": f"no hosted switch {req.get('id')!r}"}
        if op == "counters":
            return found.counters()
        if op == "stop":
            hosted.pop(int(req["id"])).stop()
            return {"stopped": True}
        return {"error": f"unknown request {op!r}: add, counters or stop"}
    except Exception as e:  # noqa: BLE001 - a bad request fails alone; the other switches keep running
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    sys.exit(_serve_stdin())
