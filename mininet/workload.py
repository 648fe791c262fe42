"""What runs inside an emulated host: `python -m luwu.mininet.workload CONFIG.json` (the venv's python).

A worker builds its engine from its `EndpointPlan` (Ethernet wiring: it binds its own address),
allreduces an int32 tensor through the switches and checks the sum bit for bit; on rail-only
the allreduce is hierarchical over the server's NVLink (nvlink.py). With push/pull it then pulls
its group's layer slices from the optimizer nodes, pushes float32 gradients and pulls the
updated slices, checked against the fixed-point error bound. An optimizer node runs one engine
per attachment serving those slices (mininet/paramstore.py).

Everyone's data is a function of (seed, rank), so each worker computes the exact expected sum
itself. With --workload ddp a worker trains with torch DDP over the luwu backend instead
(ddp_workload.py). Protocol with the runner, one JSON object per stdout line: `{"event": "ready"}` once the
engine is bound (with `metrics`, its /metrics URL, when the config asks for one), then the process waits for `go` on stdin; a worker prints `{"event": "result",
...}`, stays on the network until `stop` (or EOF) and exits (0 when everything verified, 1
otherwise); a node serves until `stop` and prints its result. Errors print
`{"event": "error", "error": ...}`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from luwu.dataplane import trace
from luwu.dataplane.integrity import data_lanes
from luwu.dataplane.protocol import Dtype

LR = 0.5  # the node's SGD step in the push/pull check
GRAD_SCALE = 0.01  # gradients are N(0, 1) * this


def tensor_for(seed: int, rank: int, numel: int) -> np.ndarray:
    """Rank `rank`'s allreduce input: int32 over the whole range (sums wrap)."""
    rng = np.random.default_rng([seed, rank])
    return rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32)


def expected_sum(seed: int, ranks: list[int], numel: int) -> np.ndarray:
    total = np.zeros(numel, dtype=np.int64)
    for r in ranks:
        total += tensor_for(seed, r, numel)
    return total.astype(np.int32)  # modular, exactly what int32 adds give


def initial_params(seed: int, layer: int, numel: int) -> np.ndarray:
    return np.random.default_rng([seed, 1, layer]).standard_normal(numel).astype(np.float32)


def gradient(seed: int, rank: int, layer: int, numel: int) -> np.ndarray:
    g = np.random.default_rng([seed, 2, layer, rank]).standard_normal(numel) * GRAD_SCALE
    return g.astype(np.float32)


def say(event: str, **fields) -> None:
    if event == "result":  # the timeline so far is on disk before the runner may stop this process
        trace.flush()
    print(json.dumps({"event": event, **fields}), flush=True)


_stdin_buffer = bytearray()


def wait_line(expect: tuple[str, ...], timeout: float) -> str:
    """The next stdin line among `expect` ('' on EOF), within `timeout`. Reads the descriptor itself
    (no buffered file object) so a line that arrived together with an earlier one is not missed."""
    import os
    import select

    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in _stdin_buffer:
            line, _, rest = bytes(_stdin_buffer).partition(b"\n")
            _stdin_buffer[:] = rest
            if line.decode().strip() in expect:
                return line.decode().strip()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {'/'.join(expect)} from the runner within {timeout} s")
        ready, _, _ = select.select([0], [], [], left)
        if ready:
            chunk = os.read(0, 4096)
            if not chunk:
                return ""
            _stdin_buffer.extend(chunk)


# -- worker ----------------------------------------------------------------------------------------

def run_worker(cfg: dict) -> int:
    from luwu.dataplane.engine import Engine
    from luwu.dataplane.session import EndpointPlan

    w, seed, timeout = cfg["worker"], cfg["seed"], cfg["timeout"]
    if w.get("ddp"):  # torch DDP over the luwu backend instead of the engine checks below
        from . import ddp_workload

        return ddp_workload.run(cfg, say, wait_line)
    if w.get("train"):  # model-in-network training (ModelInNetwork, AdamW on the optimizer nodes)
        from . import train_workload

        if w.get("controller"):  # its JobNetwork from the controller's JoinJob instead of the runner
            w["train"] = dict(w["train"], network=join_for_training(w))

        return train_workload.run(cfg, say, wait_line)
    rank, numel = w["rank"], w["elements"]
    if w.get("controller"):  # join the controller's job from this host, over the management network
        plan, w = join_controller(w)
    else:
        plan = EndpointPlan.from_json(json.dumps(w["plan"]))
    peers = None
    if w.get("nvlink"):
        from .nvlink import NvlinkPeers

        nv = w["nvlink"]
        peers = NvlinkPeers(nv["index"], nv["addresses"], nv["port"], timeout)
    engine = Engine(plan).start()
    try:
        say("ready", rank=rank, udp=list(engine.address), metrics=serve_metrics(cfg, [engine]))
        if wait_line(("go",), timeout) != "go":
            return 1
        x = tensor_for(seed, rank, numel)
        t0 = time.monotonic()
        if peers is not None:
            peers.connect()
            from .nvlink import hierarchical_allreduce

            with trace.span("allreduce", "worker", elements=numel, hierarchical=True):
                got, phases = hierarchical_allreduce(peers, x, lambda part: engine.allreduce(part).wait(timeout))
            ranks = w["all_ranks"]
        else:
            with trace.span("allreduce", "worker", elements=numel):
                got, phases = engine.allreduce(x).wait(timeout), {}
            ranks = w["group"]
        seconds = time.monotonic() - t0
        want = expected_sum(seed, ranks, numel)
        bad = int(np.count_nonzero(got != want))
        result = {"rank": rank, "host": cfg["host"], "elements": numel, "seconds": seconds, "contributors": len(ranks),
                  "verified": bad == 0, "mismatches": bad, **phases}
        if w.get("pushpull"):
            result["pushpull"] = push_pull(engine, w["pushpull"], seed, rank, timeout)
        result["engine"] = engine.session_stats()["engine"]
        say("result", **result)
        # stay on the network until every worker is done: a node session's parameter stream is
        # paced by the heartbeats of *all* its workers, min-aggregated by the switch
        wait_line(("stop",), timeout)
        return 0 if result["verified"] and result.get("pushpull", {}).get("verified", True) else 1
    finally:
        engine.close()
        if peers is not None:
            peers.close()


def join_controller(w: dict):
    """JoinJob as `w["rank"]` from `w["controller"]["endpoint"]`: this rank's plan, and `w` with its
    group and (push/pull) its group's shards as the controller's job says."""
    from luwu.controller.client import ControllerClient

    ctl = w["controller"]
    with ControllerClient(ctl["address"], ctl["token"]) as client:
        plan, info = client.join_job(ctl["job"], w["rank"], ctl["endpoint"])
    w = dict(w, group=info["group_ranks"])
    if w.get("pushpull"):
        numel = dict((layer["layer_id"], layer["numel"]) if isinstance(layer, dict) else tuple(layer)
                     for layer in info["layers"])
        shards = [{"layer": s["layer_id"], "offset": s["offset"], "numel": s["numel"], "session": s["session"],
                   "layer_numel": numel[s["layer_id"]]} for s in info["shards"]]
        w["pushpull"] = dict(w["pushpull"], lanes=info["lanes"], group=info["group_ranks"], shards=shards)
    return plan, w


def join_for_training(w: dict) -> str:
    """JoinJob as `w["rank"]`; the JobNetwork (JSON) ModelInNetwork trains over: the controller's
    endpoint plan and shard map, the nodes' control sockets, the job token (which the node daemons
    check with the controller)."""
    from luwu.controller.client import ControllerClient
    from luwu.worker.model_in_network.network import JobNetwork

    ctl = w["controller"]
    with ControllerClient(ctl["address"], ctl["token"]) as client:
        plan, info = client.join_job(ctl["job"], w["rank"], ctl["endpoint"])
    return JobNetwork.from_controller(plan, info, ctl["controls"], job_token=ctl["token"]).to_json()


def push_pull(engine, pp: dict, seed: int, rank: int, timeout: float) -> dict:
    """Pull version 0 of every slice, push this rank's gradient, pull version 1; check both."""
    from luwu.dataplane.quantize import chunk_exponents, error_bound

    shards = sorted(pp["shards"], key=lambda s: (s["layer"], s["offset"]))
    lanes, group = data_lanes(pp["lanes"], Dtype.FIXED32), pp["group"]  # elements per packet (less check words)
    layers = {s["layer"]: s["layer_numel"] for s in shards}
    t0 = time.monotonic()
    with trace.span("pull wait", "worker", version=0, slices=len(shards)):
        first = [engine.pull(s["session"], s["layer"], 0) for s in shards]
        first = [h.wait(timeout) for h in first]
    with trace.span("push wait", "worker", version=0, slices=len(shards)):
        pushes = [engine.push(s["session"], s["layer"], _slice(gradient(seed, rank, s["layer"], layers[s["layer"]]),
                                                               s)) for s in shards]
        for h in pushes:
            h.wait(timeout)
    with trace.span("pull wait", "worker", version=1, slices=len(shards)):
        second = [h.wait(timeout) for h in [engine.pull(s["session"], s["layer"], 1) for s in shards]]
    seconds = time.monotonic() - t0
    bad_v0 = bad_v1 = 0
    for s, p0, p1 in zip(shards, first, second):
        init = _slice(initial_params(seed, s["layer"], layers[s["layer"]]), s)
        bad_v0 += int(np.count_nonzero(p0 != init))
        grads = [_slice(gradient(seed, r, s["layer"], layers[s["layer"]]), s) for r in group]
        gsum = np.sum([g.astype(np.float64) for g in grads], axis=0)
        exact = init.astype(np.float64) - LR * gsum
        exps = np.max([chunk_exponents(g, lanes) for g in grads], axis=0)
        bound = LR * error_bound(gsum.astype(np.float32), exps, lanes, len(group)) + \
            np.spacing(np.abs(exact).astype(np.float32))
        bad_v1 += int(np.count_nonzero(np.abs(p1.astype(np.float64) - exact) > bound))
    return {"slices": len(shards), "elements": int(sum(s["numel"] for s in shards)), "seconds": seconds,
            "verified": bad_v0 == 0 and bad_v1 == 0, "mismatches_v0": bad_v0, "outside_bound_v1": bad_v1}


def _slice(full: np.ndarray, shard: dict) -> np.ndarray:
    return full[shard["offset"]:shard["offset"] + shard["numel"]]


def serve_metrics(cfg: dict, engines: list) -> str | None:
    """With cfg["metrics"] (HOST:0, the host's management address): serve the engines' statistics at
    /metrics there (`luwu_engine_stat`, as a worker's LUWU_METRICS does) for the rest of the process;
    the URL, or None when not asked."""
    if not cfg.get("metrics"):
        return None
    from luwu.dataplane.metrics import EngineCollector, serve

    name = cfg["host"]
    host, port = serve(cfg["metrics"], EngineCollector(
        lambda: {f"{name}-engine{i}": e.session_stats() for i, e in enumerate(engines)}))
    return f"http://{host}:{port}/metrics"


# -- optimizer node ----------------------------------------------------------------------------------

def run_node(cfg: dict) -> int:
    from luwu.dataplane.engine import Engine
    from luwu.dataplane.session import EndpointPlan

    from .paramstore import SgdParamStore as SliceStore

    n, seed, timeout = cfg["node"], cfg["seed"], cfg["timeout"]
    engines, stores = [], []
    try:
        for raw in n["plans"]:
            plan = EndpointPlan.from_json(json.dumps(raw))
            mine = {s.session for s in plan.sessions}
            slices = {s["layer"]: (s["offset"], s["numel"], s["layer_numel"]) for s in n["shards"]
                      if s["session"] in mine}
            store = SliceStore({layer: _slice(initial_params(seed, layer, full), {"offset": off, "numel": k})
                                for layer, (off, k, full) in slices.items()}, LR)
            engine = Engine(plan, provider=store, on_gradient=store.on_gradient)
            store.engine = engine
            engines.append(engine.start())
            stores.append(store)
        say("ready", host=cfg["host"], udp=[list(e.address) for e in engines], metrics=serve_metrics(cfg, engines))
        if wait_line(("go",), timeout) != "go":
            return 1
        wait_line(("stop",), timeout)
        say("result", host=cfg["host"], gradients=sum(s.gradients for s in stores),
            unknown=sum(s.unknown for s in stores),
            saturated=any(s.saturated for s in stores), served_layers=sum(len(s.params) for s in stores))
        return 0
    finally:
        for e in engines:
            e.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m luwu.mininet.workload CONFIG.json", file=sys.stderr)
        return 2
    try:
        cfg = json.loads(Path(argv[0]).read_text())
        worker = cfg["role"] == "worker"
        # with LUWU_TRACE_DIR (the runner sets it) this host's spans join the run's trace.json
        trace.start(f"worker {cfg['worker']['rank']} ({cfg['host']})" if worker else f"optimizer node ({cfg['host']})")
        return run_worker(cfg) if worker else run_node(cfg)
    except Exception as e:  # the runner reads this line; the traceback goes to the host's log
        traceback.print_exc(file=sys.stderr)
        say("error", error=f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
