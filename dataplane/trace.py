"""A timeline of where an iteration's time goes, in the Chrome trace event format (Perfetto and
chrome://tracing open it).

Every process of a run (workers, engines, the switch, the optimizer node) that finds
LUWU_TRACE_DIR in its environment appends complete events ("ph": "X") to its own file
`DIR/trace-<pid>.jsonl`, on one clock (the wall clock in microseconds, shared by the processes
of a host); `merge(DIR)` writes `DIR/trace.json` ({"traceEvents": [...]}) with one named track
per process. Disabled (no LUWU_TRACE_DIR), `span` returns a shared no-op context and costs one
attribute read.

    with trace.span("step", "optimizer", layer=3):
        ...
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

ENV = "LUWU_TRACE_DIR"


class _Nothing:
    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()


class _Span:
    __slots__ = ("args", "cat", "name", "start", "tracer")

    def __init__(self, tracer: _Tracer, name: str, cat: str, args: dict):
        self.tracer, self.name, self.cat, self.args = tracer, name, cat, args

    def __enter__(self) -> _Span:
        self.start = time.time_ns() // 1000
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.time_ns() // 1000
        self.tracer.emit({"name": self.name, "cat": self.cat, "ph": "X", "ts": self.start, "dur": end - self.start,
                          "pid": self.tracer.pid, "tid": threading.get_native_id(), "args": self.args})


class _Tracer:
    def __init__(self, directory: str, process_name: str):
        self.pid = os.getpid()
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"trace-{self.pid}.jsonl"
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - closed at exit by flush()
        self.emit({"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": process_name}})

    def emit(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)

    def flush(self) -> None:
        with self._lock:
            self._file.flush()


_tracer: _Tracer | None = None


def start(process_name: str) -> bool:
    """Trace this process if LUWU_TRACE_DIR is set (call once, early); returns whether it is."""
    global _tracer
    directory = os.environ.get(ENV)
    if not directory or _tracer is not None:
        return _tracer is not None
    import atexit

    _tracer = _Tracer(directory, process_name)
    atexit.register(_tracer.flush)
    return True


OpenSpan = _Nothing | _Span  # what `begin` returns and `end` takes: an event still open


def span(name: str, cat: str = "luwu", **args: object) -> _Nothing | _Span:
    """A context manager timing its block as one event (a no-op when tracing is off)."""
    t = _tracer
    return _NOTHING if t is None else _Span(t, name, cat, args)


def begin(name: str, cat: str = "luwu", **args: object) -> _Nothing | _Span:
    """Start an event that `end` closes later (for spans across callbacks, e.g. autograd hooks)."""
    return span(name, cat, **args).__enter__()


def end(started: _Nothing | _Span | None) -> None:
    if started is not None:
        started.__exit__(None, None, None)


def flush() -> None:
    if _tracer is not None:
        _tracer.flush()


def merge(directory: str | os.PathLike, out: str | os.PathLike | None = None,
          labels: dict[int, str] | None = None) -> Path:
    """Every process's events in `directory` as one Chrome trace, `out` (default `directory/trace.json`).

    Args:
        labels: {pid: label} the caller knows its children by (e.g. the emulation's `switch-s1`),
            added to those processes' track names: "switch (switch-s1)".

    Returns:
        The path written (lines that are not JSON, e.g. a file cut by a killed process, are skipped).
    """
    directory = Path(directory)
    events: list[dict] = []
    for f in sorted(directory.glob("trace-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    for e in events:
        label = (labels or {}).get(e.get("pid", -1))
        if label and e.get("ph") == "M" and label not in e["args"].get("name", ""):
            e["args"]["name"] = f"{e['args'].get('name', '')} ({label})"
    target = Path(out) if out is not None else directory / "trace.json"
    target.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return target
