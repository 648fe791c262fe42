"""The integrity soak: a loopback job's allreduces through the bit-flipping proxy, every result checked.

`proxied_star` wires a loopback job (software switch in a child process, the proxy in another,
one engine per worker in this process) so that every packet of every port crosses the proxy
(bitflip_proxy.py). `soak` runs allreduces on it for a bounded time and returns what happened:
operations, results wrong, results that took the exact fallback, hangs (an operation past its
deadline: the job is then restarted, so a run can go on counting), the proxy's corruptions and
the drops every component counted. test_integrity_soak.py asserts on it; run as a script for
longer soaks or for the figures against another build:

    .venv/bin/python tests/integration/integrity_soak.py --minutes 5 --workers 3 --seed 1

Values are chosen so every correct result is bit-exact: rank r's float32 tensor is m * 2^s
with integers |m| < 2^15 and one random scale s per operation, so the quantiser's fixed point
(exponent e <= s + 15, quantum 2^(e + c - 31) <= 2^s) holds every value exactly and the sum of
<= 4 of them fits float32's 24 bits. The float64 sum is therefore the one right answer, and any
difference is a wrong result (a flip too small to change the float32 result is harmless by
definition). Some operations are int32 sums (exact, wrapping). Chunks of zeros (ZERO packets
for int32) are included.

A result that is NaN where the inputs were finite, on a handle marked `saturated`, is the
engine's exact fallback (docs/protocol.md 5.1: the torch backend recomputes those elements over
TCP): counted as a fallback, not as wrong; its other elements must still be exact.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bitflip_proxy import DOWN, UP, ProxyProcess  # noqa: E402

from luwu.dataplane.engine import Engine  # noqa: E402
from luwu.dataplane.loopback import LoopbackSwitch, StarPlan  # noqa: E402
from luwu.dataplane.protocol import DropReason  # noqa: E402

SIZES = (1, 63, 64, 65, 200, 1000, 4099, 20000)  # elements; with 64 lanes: 1..313 packets per rank
CORRUPT = "CorruptResult"  # the engine's named error for an op with no exact path after R failed checks
HEADER_DROPS = ("MALFORMED", "BAD_VERSION", "BAD_TYPE", "BAD_CHECKSUM")  # the switch's "this is no valid packet"


@dataclasses.dataclass
class ProxiedStar:
    plan: StarPlan  # the endpoints' view: switch_ports are the proxy's front sockets
    switch_plan: StarPlan  # the switch's view: endpoints are the proxy's back sockets
    switch: LoopbackSwitch
    proxy: ProxyProcess
    engines: list[Engine]
    node: Engine | None = None


@contextlib.contextmanager
def proxied_star(workers: int, mode: str | int = "tofino", fraction: float = 0.01, seed: int = 0,
                 max_bits: int = 8, directions=(UP, DOWN), server=None, **plan_kw) -> Iterator[ProxiedStar]:
    """A loopback job over UDP with the bit-flipping proxy on every port, both directions; with
    `server` (an SgdParamStore) also optimizer node 0's engine serving it (`ProxiedStar.node`)."""
    plan = StarPlan(workers=workers, nodes=1 if server is not None else 0, mode=mode, transport="udp", **plan_kw)
    plan.assign_endpoints()  # the endpoints' own addresses
    with ProxyProcess(plan.ports, fraction=fraction, seed=seed, max_bits=max_bits, directions=directions) as proxy:
        switch_plan = dataclasses.replace(plan, endpoints=dict(proxy.back), switch_ports={})
        with LoopbackSwitch(switch_plan, process=True, seed=seed) as sw:
            proxy.connect(endpoints=plan.endpoints, switch=switch_plan.switch_ports)
            ep_plan = dataclasses.replace(plan, switch_ports=dict(proxy.front))
            engines: list[Engine] = []
            node = None
            try:
                if server is not None:
                    node = Engine(ep_plan.node_plan(0), provider=server, on_gradient=server.on_gradient)
                    server.engine = node
                    node.start()
                for r in range(workers):
                    engines.append(Engine(ep_plan.worker_plan(r)).start())
                yield ProxiedStar(ep_plan, switch_plan, sw, proxy, engines, node)
            finally:
                for e in engines:
                    e.close()
                if node is not None:
                    node.close()


def make_inputs(rng: np.random.Generator, workers: int, numel: int, kind: str) -> tuple[list[np.ndarray], np.ndarray]:
    """(per-rank inputs, the exact result) of one operation."""
    if kind == "int32":
        xs = [rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32) for _ in range(workers)]
        if numel >= 128:
            xs[0][:64] = 0  # an all-zero chunk of one rank
            for x in xs:
                x[64:128] = 0  # all ranks zero: ZERO packets only
        exact = np.sum([x.astype(np.int64) for x in xs], axis=0)
        return xs, ((exact + 2**31) % 2**32 - 2**31).astype(np.int32)
    s = int(rng.integers(-20, 21))
    xs = [np.ldexp(rng.integers(-(2**15) + 1, 2**15, numel).astype(np.float64), s).astype(np.float32)
          for _ in range(workers)]
    if numel >= 128:
        xs[-1][:64] = 0
        for x in xs:
            x[64:128] = 0
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert np.array_equal(exact.astype(np.float32).astype(np.float64), exact)  # exact in float32
    return xs, exact.astype(np.float32)


def judge(result: np.ndarray, exact: np.ndarray, saturated: bool) -> tuple[bool, int]:
    """(wrong, fallback elements) of one rank's result."""
    if result.dtype == np.float32:
        nan = np.isnan(result)
        if nan.any() and not saturated:
            return True, 0
        ok = np.array_equal(result[~nan].view(np.uint32), exact[~nan].view(np.uint32))
        return not ok, int(nan.sum())
    return not np.array_equal(result, exact), 0


def _named_events(counters: dict | None) -> dict[str, int]:
    from luwu.dataplane.protocol import Event

    out = {}
    for code, v in (counters or {}).get("events", {}).items():
        try:
            name = Event(int(code)).name
        except ValueError:
            name = str(code)
        if v[0]:
            out[name] = int(v[0])
    return out


def _named_drops(counters: dict | None) -> dict[str, int]:
    if not counters:
        return {}
    out = {}
    for code, v in counters.get("drops", {}).items():
        try:
            name = DropReason(int(code)).name
        except ValueError:
            name = str(code)
        if v[0]:
            out[name] = int(v[0])
    return out


def _flatten(d: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


ENDPOINT_DROP_WORDS = ("bad_header", "bad_check", "bad_trailer", "rx_bad", "corrupt", "fallback")


def endpoint_drops(engines: list[Engine]) -> dict[str, float]:
    """Sum over the engines of every counter whose name says it is a drop or rejection of a bad
    packet (rx_bad, bad_header, bad_check, bad_trailer, ...), keyed by the counter's path."""
    total: dict[str, float] = {}
    for e in engines:
        for k, v in _flatten(e.session_stats()).items():
            if any(w in k.split(".")[-1] for w in ENDPOINT_DROP_WORDS):
                total[k] = total.get(k, 0) + v
    return {k: v for k, v in sorted(total.items()) if v}


def soak(workers: int = 3, seconds: float = 60.0, fraction: float = 0.01, seed: int = 0, mode: str | int = "tofino",
         op_deadline: float = 60.0, in_flight: int = 2, restart_on_hang: bool = True, max_ops: int = 1_000_000,
         directions=(UP, DOWN), log=None) -> dict:
    """Run allreduces through the proxy for `seconds` (in_flight at a time per rank); every result
    checked. Returns the report (see the module docstring); never raises for a wrong result, a
    hang or an engine error, it counts them (either ends the job, which then restarts when
    `restart_on_hang`, else the soak ends)."""
    rng = np.random.default_rng(seed)
    rep: dict = {"workers": workers, "fraction": fraction, "seed": seed, "mode": mode, "ops": 0, "results": 0,
                 "wrong_ops": 0, "wrong_results": 0, "fallback_ops": 0, "fallback_elements": 0, "hangs": 0,
                 "corrupt_errors": {}, "corrupt_messages": [], "errors": [], "jobs": [], "first_wrong": [],
                 "hang_detail": []}
    t_end = time.monotonic() + seconds
    job = 0
    while time.monotonic() < t_end and rep["ops"] < max_ops:
        job += 1
        jrep: dict = {"ops": 0}
        hung = failed = False  # an op past its deadline / an engine error: the job is over
        with proxied_star(workers, mode=mode, fraction=fraction, seed=seed * 1000 + job, directions=directions) as st:
            while time.monotonic() < t_end and rep["ops"] < max_ops and not (hung or failed):
                batch = []
                for _ in range(in_flight):
                    kind = "int32" if rng.random() < 0.2 else "float32"
                    numel = int(SIZES[int(rng.integers(len(SIZES)))])
                    xs, exact = make_inputs(rng, workers, numel, kind)
                    hs = [e.allreduce(x) for e, x in zip(st.engines, xs)]
                    batch.append((hs, exact, kind, numel))
                deadline = time.monotonic() + op_deadline * in_flight  # the batch's ops queue behind each other
                for hs, exact, kind, numel in batch:
                    rep["ops"] += 1
                    jrep["ops"] += 1
                    wrong_op = fb_op = False
                    for r, h in enumerate(hs):
                        try:
                            res = h.wait(max(0.01, deadline - time.monotonic()))
                        except TimeoutError:
                            hung = True
                            rep["hang_detail"].append({"op": rep["ops"], "rank": r, "handle": h.name,
                                                       "stats": st.engines[r].session_stats()})
                            continue
                        except Exception as e:  # noqa: BLE001 - a named error is counted, not a wrong result
                            if type(e).__name__ == CORRUPT:  # named, the op alone failed: the job goes on
                                rep["corrupt_errors"][kind] = rep["corrupt_errors"].get(kind, 0) + 1
                                if len(rep["corrupt_messages"]) < 5:
                                    rep["corrupt_messages"].append(str(e)[:300])
                                continue
                            rep["errors"].append(f"{type(e).__name__}: {e}"[:300])
                            failed = True
                            continue
                        rep["results"] += 1
                        wrong, fb = judge(res, exact, h.saturated)
                        if wrong:
                            rep["wrong_results"] += 1
                            wrong_op = True
                            if len(rep["first_wrong"]) < 10:
                                bad = np.flatnonzero(res != exact)
                                rep["first_wrong"].append({"op": rep["ops"], "rank": r, "kind": kind, "numel": numel,
                                                           "bad_elements": int(bad.size),
                                                           "first_bad": int(bad[0]) if bad.size else -1})
                        if fb:
                            fb_op = True
                            rep["fallback_elements"] += fb
                    rep["wrong_ops"] += wrong_op
                    rep["fallback_ops"] += fb_op
                    if hung:
                        rep["hangs"] += 1
                    if hung or failed:
                        break
            jrep["proxy"] = st.proxy.stats()
            counters = st.switch.counters()
            jrep["switch_drops"] = _named_drops(counters)
            jrep["switch_events"] = _named_events(counters)
            jrep["endpoint_drops"] = endpoint_drops(st.engines)
            jrep["hung"], jrep["failed"] = hung, failed
            rep["jobs"].append(jrep)
            if log is not None:
                log(f"job {job}: {jrep['ops']} ops, hung={hung}, wrong so far {rep['wrong_results']}, "
                    f"corrupted {jrep['proxy']['corrupted']}")
        if (hung or failed) and not restart_on_hang:
            break
    rep["summary"] = summarize(rep)
    return rep


NODE_LAYERS = {7: 1000, 3: 70, 9: 1, 11: 5000}  # layer id -> elements
NODE_LR = 0.5


def _grid(rng: np.random.Generator, numel: int, bound: int) -> np.ndarray:
    """float32 multiples of 2^-8 below bound/256: sums of a few, and SGD steps of lr 0.5 on them,
    stay exact in float32 (and in the fixed point: quantum <= 2^-27)."""
    return (rng.integers(-bound + 1, bound, numel).astype(np.float64) / 256).astype(np.float32)


def skipping_store(params: dict, lr: float):
    """An SgdParamStore that, like the optimizer node (dataplane/optimizer/node.py, torch's
    GradScaler), skips the step of a gradient that is not finite -- what a node does with a sum
    it rejected as corrupt -- while the version still advances; `skipped` lists (layer, version)."""
    from luwu.mininet.paramstore import SgdParamStore

    class SkippingStore(SgdParamStore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.skipped: set[tuple[int, int]] = set()

        def _apply(self, tensor: int, grad: np.ndarray, saturated: bool) -> None:
            if saturated and tensor in self.params and not np.isfinite(grad).all():
                with self.lock:
                    self.version[tensor] += 1
                    self.skipped.add((tensor, self.version[tensor]))
                    self.gradients += 1
                return
            super()._apply(tensor, grad, saturated)

    return SkippingStore(params, lr=lr)


def soak_node(workers: int = 3, seconds: float = 60.0, fraction: float = 0.01, seed: int = 0,
              mode: str | int = "tofino", step_deadline: float = 60.0, restart_on_hang: bool = True,
              max_steps: int = 100_000, log=None) -> dict:
    """Training steps through the optimizer node (GRAD -> switch -> AGG -> node, PULL -> node ->
    PARAM multicast) with the proxy on every port: each step every worker pushes every layer's
    gradient, then pulls the next version; every pulled parameter is compared bit for bit with
    the exact SGD step on the float64 sum. A step past `step_deadline` is a hang (the job then
    restarts from fresh parameters when `restart_on_hang`)."""
    rng = np.random.default_rng(seed)
    rep: dict = {"workers": workers, "fraction": fraction, "seed": seed, "mode": mode, "steps": 0, "results": 0,
                 "wrong_results": 0, "wrong_steps": 0, "skipped_layer_steps": 0, "hangs": 0, "corrupt_errors": {},
                 "corrupt_messages": [], "hang_detail": [], "errors": [], "jobs": [], "first_wrong": []}
    t_end = time.monotonic() + seconds
    job = 0
    while time.monotonic() < t_end and rep["steps"] < max_steps:
        job += 1
        params = {t: _grid(rng, n, 1 << 15) for t, n in NODE_LAYERS.items()}
        expected = {t: p.astype(np.float64) for t, p in params.items()}
        server = skipping_store(params, NODE_LR)
        jrep: dict = {"steps": 0}
        hung = failed = False
        with proxied_star(workers, mode=mode, fraction=fraction, seed=seed * 1000 + job, server=server,
                          node_pool=32, param_window=64) as st:
            sid = st.plan.node_session(0)
            version = 0
            while time.monotonic() < t_end and rep["steps"] < max_steps and not (hung or failed):
                grads = [{t: _grid(rng, n, 1 << 10) for t, n in NODE_LAYERS.items()} for _ in range(workers)]
                deadline = time.monotonic() + step_deadline
                handles = [e.push(sid, t, grads[r][t]) for t in NODE_LAYERS for r, e in enumerate(st.engines)]
                version += 1
                step = {t: NODE_LR * np.sum([g[t].astype(np.float64) for g in grads], axis=0) for t in NODE_LAYERS}
                pulls = [(t, r, e.pull(sid, t, version)) for t in NODE_LAYERS for r, e in enumerate(st.engines)]
                for h in handles:
                    try:
                        h.wait(max(0.01, deadline - time.monotonic()))
                    except TimeoutError:
                        hung = True
                        rep["hang_detail"].append({"step": version, "handle": h.name})
                    except Exception as e:  # noqa: BLE001 - named errors are counted
                        if type(e).__name__ == CORRUPT:
                            rep["corrupt_errors"]["push"] = rep["corrupt_errors"].get("push", 0) + 1
                            rep["corrupt_messages"].append(str(e)[:300])
                            continue
                        rep["errors"].append(f"push: {type(e).__name__}: {e}"[:300])
                        failed = True
                wrong_step = False
                applied: dict[int, bool] = {}
                for t, r, h in pulls:
                    try:
                        got = h.wait(max(0.01, deadline - time.monotonic()))
                    except TimeoutError:
                        hung = True
                        rep["hang_detail"].append({"step": version, "handle": h.name, "rank": r,
                                                   "stats": st.engines[r].session_stats()})
                        continue
                    except Exception as e:  # noqa: BLE001
                        rep["errors"].append(f"pull: {type(e).__name__}: {e}"[:300])
                        failed = True
                        continue
                    rep["results"] += 1
                    if t not in applied:  # the node has stepped layer t to `version` (or skipped it): known now
                        applied[t] = (t, version) not in server.skipped
                        rep["skipped_layer_steps"] += not applied[t]
                        if applied[t]:
                            expected[t] = expected[t] - step[t]
                    want = expected[t].astype(np.float32)
                    got = np.asarray(got, dtype=np.float32).reshape(-1)
                    if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                        rep["wrong_results"] += 1
                        wrong_step = True
                        if len(rep["first_wrong"]) < 10:
                            bad = np.flatnonzero(got != want) if got.shape == want.shape else np.arange(1)
                            rep["first_wrong"].append({"step": version, "layer": t, "rank": r,
                                                       "bad_elements": int(bad.size)})
                rep["steps"] += 1
                jrep["steps"] += 1
                rep["wrong_steps"] += wrong_step
                if wrong_step:  # the node's parameters are now wrong: the next steps would all be
                    for t in NODE_LAYERS:  # follow the node's (the workers agree with it or not)
                        with server.lock:
                            expected[t] = server.params[t].astype(np.float64)
                if hung:
                    rep["hangs"] += 1
            jrep["proxy"] = st.proxy.stats()
            jrep["switch_drops"] = _named_drops(st.switch.counters())
            jrep["endpoint_drops"] = endpoint_drops([*st.engines, *([st.node] if st.node else [])])
            jrep["node"] = {k: v for k, v in _flatten(st.node.session_stats()).items() if v} if st.node else {}
            jrep["hung"], jrep["failed"] = hung, failed
            rep["jobs"].append(jrep)
            if log is not None:
                log(f"node job {job}: {jrep['steps']} steps, hung={hung}, failed={failed}, wrong so far "
                    f"{rep['wrong_results']}, corrupted {jrep['proxy']['corrupted']}")
        if (hung or failed) and not restart_on_hang:
            break
    rep["summary"] = summarize(rep)
    return rep


def summarize(rep: dict) -> dict:
    """Totals over the jobs: corruptions per direction and type, drops per reason."""
    corrupt: dict = {UP: {}, DOWN: {}}
    sw: dict[str, int] = {}
    ep: dict[str, float] = {}
    other: dict[str, int] = {}
    for j in rep["jobs"]:
        for d in (UP, DOWN):
            for t, c in j["proxy"][d].items():
                into = corrupt[d].setdefault(t, {})
                for k, v in c.items():
                    into[k] = into.get(k, 0) + v
        for k, v in j["proxy"]["other"].items():
            other[k] = other.get(k, 0) + v
        for k, v in j["switch_drops"].items():
            sw[k] = sw.get(k, 0) + v
        for k, v in j["endpoint_drops"].items():
            ep[k] = ep.get(k, 0) + v
    total = sum(c.get("corrupted", 0) for d in (UP, DOWN) for c in corrupt[d].values())
    return {"corrupted": total, "per_direction_type": corrupt, "proxy_other": other, "switch_drops": sw,
            "endpoint_drops": ep}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="luwu integrity soak through a bit-flipping proxy")
    p.add_argument("--minutes", type=float, default=float(os.environ.get("LUWU_SOAK_MINUTES", "1")))
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="tofino")
    p.add_argument("--op-deadline", type=float, default=30.0)
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--node", action="store_true", help="training steps through an optimizer node instead")
    a = p.parse_args(argv)
    if not 2 <= a.workers <= 8 or a.minutes <= 0 or not 0 <= a.fraction <= 1:
        print("integrity_soak: --workers 2..8, --minutes > 0, --fraction 0..1", file=sys.stderr)
        return 2
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if a.node:
        rep = soak_node(a.workers, a.minutes * 60, a.fraction, a.seed, a.mode, a.op_deadline, log=say)
        keys = ("steps", "results", "wrong_steps", "wrong_results", "skipped_layer_steps", "hangs")
    else:
        rep = soak(a.workers, a.minutes * 60, a.fraction, a.seed, a.mode, a.op_deadline, log=say)
        keys = ("ops", "results", "wrong_ops", "wrong_results", "fallback_ops", "fallback_elements", "hangs")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    brief = {k: rep[k] for k in keys}
    brief["errors"] = len(rep["errors"])
    brief["corrupt_errors"] = rep["corrupt_errors"]
    brief["jobs"] = len(rep["jobs"])
    print(json.dumps({"brief": brief, "summary": rep["summary"], "first_wrong": rep["first_wrong"],
                      "errors": rep["errors"][:5], "corrupt_messages": rep["corrupt_messages"][:3],
                      "hang_detail": [{k: v for k, v in d.items() if k != "stats"} for d in rep["hang_detail"]]},
                     indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
