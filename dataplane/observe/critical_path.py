"""The critical path of one training iteration, from a merged timeline (dataplane/observe/trace.py).

A pure function over Chrome trace events: no I/O, no clock. An iteration `v` is every worker span
with `version == v` and every optimizer-node span with `step == v`; its window runs from the first
worker span's start to the last of those spans' end. The critical path is the chain of spans that
determines the window's end, found by walking back from the span that ends last: each span's
predecessor is whichever of its dependencies ended last --

* the previous span on the same thread (a worker's hooks run in order; each node stage is a thread
  that takes one layer after another);
* a node stage's earlier stage for the same (layer, step): receive -> read -> optimize -> write ->
  publish;
* a node `receive` of (layer L, step v): the last worker `push` of unit L at version v (the
  gradient is complete only when every worker's share has crossed the switch);
* a worker's `pull wait` for unit u at version v: the node's `publish` of layer u at step v - 1,
  and its `push wait` at version v: the `publish` of step v (the acknowledgement follows it).

Every instant of the window is charged to exactly one component, so the components sum to the
window: the span's own name (`worker forward`, `node optimize`, ...) for the part of a span on the
path, `worker other` / `node queue` for gaps between spans of one thread (untraced Python, autograd,
the loss; a stage idle before its input arrived), and for a gap between processes (a push reaching
the node, a parameter stream reaching the worker) `switch` where the switch's pipeline turns
overlap it and `network` for the rest (sockets, engines, queues).

    path = critical_path.analyse(json.load(open("trace.json"))["traceEvents"])
    path["components"]   # {"worker backward": 0.041, "node optimize": 0.002, ...} seconds
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

# which node span a worker's wait depends on: (its name) -> (node stage, step offset from version)
_WAIT_EDGE = {"pull wait": ("publish", -1), "push wait": ("publish", 0)}
# the node's stage a stage waited for, then the one before it where the fast lane skips a stage (a
# shard in RAM goes receive -> optimize -> publish: dataplane/optimizer/pipeline.py)
_STAGE_BEFORE = {"read": ("receive",), "optimize": ("read", "receive"), "write": ("optimize",),
                 "publish": ("write", "optimize")}


@dataclass
class Span:
    """One complete event ("ph": "X") of the trace, times in microseconds."""

    name: str
    role: str  # "worker", "node" or "switch" (from the event's category)
    process: str  # the process's track name ("worker 0 (mnn)", "switch", "optimizer node (...)")
    pid: int
    tid: int
    start: int
    end: int
    args: dict = field(default_factory=dict)
    prev: Span | None = None  # the previous span on the same thread

    @property
    def component(self) -> str:
        return f"{self.role} {self.name}"


def spans(events: list[dict]) -> list[Span]:
    """The trace's complete events as Spans (sorted by start), their processes named."""
    names = {e["pid"]: e.get("args", {}).get("name", str(e["pid"])) for e in events if e.get("ph") == "M"}
    roles = {"worker": "worker", "optimizer": "node", "switch": "switch"}
    out = [Span(e["name"], roles.get(e.get("cat", ""), e.get("cat", "")), names.get(e["pid"], str(e["pid"])),
                e["pid"], e.get("tid", 0), int(e["ts"]), int(e["ts"]) + int(e.get("dur", 0)), dict(e.get("args", {})))
           for e in events if e.get("ph") == "X"]
    threads: dict[tuple[int, int], list[Span]] = {}
    for s in out:
        threads.setdefault((s.pid, s.tid), []).append(s)
    flat = [piece for thread in threads.values() for piece in _innermost(thread)]
    flat.sort(key=lambda s: (s.start, s.end))
    return flat


def _innermost(thread: list[Span]) -> list[Span]:
    """One thread's spans as a sequence that does not overlap: where spans nest (a worker's
    `push wait` inside its `backward`), the innermost one holds the time, and the outer span
    is cut into the pieces before and after; each piece's `prev` is the piece before it."""
    bounds = sorted({t for s in thread for t in (s.start, s.end)})
    thread = sorted(thread, key=lambda s: (s.start, -s.end))
    active: list[Span] = []
    pieces: list[Span] = []
    i = 0
    for a, b in itertools.pairwise(bounds):
        while i < len(thread) and thread[i].start <= a:
            active.append(thread[i])
            i += 1
        active = [s for s in active if s.end > a]
        if not active:
            continue
        top = max(active, key=lambda s: (s.start, -s.end))
        last = pieces[-1] if pieces else None
        if last is not None and last.end == a and last.args is top.args and last.name == top.name:
            last.end = b  # the same span goes on
        else:
            pieces.append(Span(top.name, top.role, top.process, top.pid, top.tid, a, b, top.args, last))
    for s in thread:  # zero-length spans (a push handed over at once) keep their place in the order
        if s.start == s.end:
            pieces.append(s)
    pieces.sort(key=lambda s: (s.start, s.end))
    for before, s in itertools.pairwise(pieces):
        s.prev = before
    if pieces:
        pieces[0].prev = None
    return pieces


def iteration_of(s: Span) -> int | None:
    """The iteration a span belongs to: a worker span's version, a node span's step."""
    key = "version" if s.role == "worker" else "step" if s.role == "node" else None
    value = s.args.get(key) if key else None
    return int(value) if isinstance(value, int) else None


def iterations(all_spans: list[Span]) -> dict[int, tuple[int, int]]:
    """{iteration: (start, end)} in microseconds, for the iterations the workers traced."""
    windows: dict[int, list[int]] = {}
    for s in all_spans:
        v = iteration_of(s)
        if v is None:
            continue
        w = windows.setdefault(v, [0, 0, 0])
        if s.role == "worker":
            w[0] = s.start if not w[2] else min(w[0], s.start)
            w[2] = 1
        w[1] = max(w[1], s.end)
    return {v: (w[0], w[1]) for v, w in windows.items() if w[2]}


def steady_iteration(windows: dict[int, tuple[int, int]]) -> int:
    """The iteration to show: of those after the first (warm-up) and before the last (cut short by
    the end of the run), the one of median length; with fewer than three, the last."""
    if not windows:
        raise ValueError("the trace has no worker spans with a version: was LUWU_TRACE_DIR set for the workers?")
    order = sorted(windows)
    middle = order[1:-1] or order[-1:]
    by_length = sorted(middle, key=lambda v: windows[v][1] - windows[v][0])
    return by_length[len(by_length) // 2]


class _Index:
    """Lookups the walk needs: node spans by (stage, layer, step), worker pushes, switch turns."""

    def __init__(self, all_spans: list[Span]):
        # keys from the events' args: (stage, layer, step) and (unit, version), as recorded
        self.node: dict[tuple[object, ...], list[Span]] = {}
        self.pushes: dict[tuple[object, ...], list[Span]] = {}
        turns = []
        for s in all_spans:
            if s.role == "node" and "layer" in s.args:
                # a batched optimizer call names every (layer, step) it stepped in `layers`
                for layer, step in s.args.get("layers") or [(s.args["layer"], s.args.get("step"))]:
                    self.node.setdefault((s.name, layer, step), []).append(s)
            elif s.role == "worker" and s.name == "push":
                self.pushes.setdefault((s.args.get("unit"), s.args.get("version")), []).append(s)
            elif s.role == "switch":
                turns.append((s.start, s.end))
        turns.sort()
        self.turn_starts = [t[0] for t in turns]
        self.turns = turns

    def switch_time(self, lo: int, hi: int) -> int:
        """Microseconds of [lo, hi] during which the switch was in a pipeline turn (turns of one
        switch process do not overlap; overlapping turns of several switches count once)."""
        total, cursor = 0, lo
        i = max(0, bisect.bisect_right(self.turn_starts, lo) - 1)
        while i < len(self.turns) and self.turns[i][0] < hi:
            a, b = max(self.turns[i][0], cursor), min(self.turns[i][1], hi)
            if b > a:
                total += b - a
                cursor = b
            i += 1
        return total

    def dependencies(self, s: Span) -> list[Span]:
        deps = [s.prev] if s.prev is not None else []
        if s.role == "node":
            for layer, step in s.args.get("layers") or [(s.args.get("layer"), s.args.get("step"))]:
                before: list[Span] = []
                for stage in _STAGE_BEFORE.get(s.name, ()):
                    before = self.node.get((stage, layer, step), [])
                    if before:
                        break
                deps += before
                if s.name == "receive" or (s.name == "read" and not before):  # (traces without `receive` spans)
                    deps += self.pushes.get((layer, step), [])
        elif s.role == "worker" and s.name in _WAIT_EDGE:
            stage, offset = _WAIT_EDGE[s.name]
            version = s.args.get("version")
            if isinstance(version, int):  # only a publish that ended during the wait explains it
                deps += [d for d in self.node.get((stage, s.args.get("unit"), version + offset), [])
                         if d.end > s.start]
        return [d for d in deps if d.end <= s.end and d is not s]


def analyse(events: list[dict], iteration: int | None = None) -> dict:
    """The critical path of one iteration of a merged trace.

    Args:
        events: the trace's `traceEvents` (dataplane/observe/trace.py's merge; the demo's trace.json).
        iteration: which iteration (worker version); default `steady_iteration`'s choice.

    Returns:
        {"iteration": v, "start_us", "end_us", "seconds": the window's length,
         "components": {component: seconds on the path} (they sum to "seconds"),
         "share": {component: fraction of the window}, "critical_worker": the process whose spans
         are on the path longest, "path": [{"component", "process", "name", "args", "start_us",
         "end_us"}] in time order}.

    Raises:
        ValueError: the trace has no worker spans, or not the iteration asked for.

    Example::

        >>> cp = analyse(json.loads(Path("luwu-demo/trace.json").read_text())["traceEvents"])
        >>> max(cp["share"], key=cp["share"].get)
        'worker backward'
    """
    all_spans = spans(events)
    windows = iterations(all_spans)
    v = steady_iteration(windows) if iteration is None else iteration
    if v not in windows:
        raise ValueError(f"the trace has no iteration {v} (it has {sorted(windows)})")
    lo, hi = windows[v]
    index = _Index(all_spans)
    mine = [s for s in all_spans if iteration_of(s) == v]
    cur: Span | None = max(mine, key=lambda s: s.end)
    t = hi
    path: list[dict] = []
    components: dict[str, float] = {}

    def charge(component: str, a: int, b: int, s: Span | None) -> None:
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            return
        components[component] = components.get(component, 0.0) + (b - a) / 1e6
        path.append({"component": component, "process": s.process if s else "", "name": s.name if s else "",
                     "args": s.args if s else {}, "start_us": a, "end_us": b})

    for _ in range(len(all_spans) + 1):  # each step moves to an earlier-ending span: bounded
        if cur is None or t <= lo:
            break
        deps = index.dependencies(cur)
        pred = max(deps, key=lambda d: d.end) if deps else None
        own_from = max(cur.start, pred.end) if pred is not None else cur.start
        charge(cur.component, own_from, t, cur)
        if pred is None:
            charge("worker other" if cur.role == "worker" else "node queue", lo, cur.start, None)
            break
        if pred.end < cur.start:  # a gap: inside one thread, or a hand-over between processes
            if pred.pid == cur.pid:
                charge("worker other" if cur.role == "worker" else "node queue", pred.end, cur.start, None)
            else:
                a, b = max(pred.end, lo), min(cur.start, hi)
                on_switch = index.switch_time(a, b) if b > a else 0
                charge("network", a + on_switch, b, None)  # (charged last to first: the path is built backwards)
                charge("switch", a, a + on_switch, None)
        t, cur = min(own_from, pred.end), pred
    path.reverse()
    seconds = (hi - lo) / 1e6
    by_process: dict[str, float] = {}
    for seg in path:
        if seg["process"].startswith("worker"):
            by_process[seg["process"]] = by_process.get(seg["process"], 0.0) + seg["end_us"] - seg["start_us"]
    return {"iteration": v, "start_us": lo, "end_us": hi, "seconds": seconds,
            "components": dict(sorted(components.items(), key=lambda kv: -kv[1])),
            "share": {k: c / seconds for k, c in components.items()} if seconds > 0 else {},
            "critical_worker": max(by_process, key=by_process.get) if by_process else None,  # type: ignore[arg-type]
            "path": path}
