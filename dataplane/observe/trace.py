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
        self.tracer.complete(self.name, self.cat, self.start, time.time_ns() // 1000 - self.start, self.args)


_encode = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps(separators=...) builds one a call
PENDING = 512  # complete events held before they are formatted and written (lost, like the file buffer, if killed)


def _complete_line(pid: int, name: str, cat: str, ts: int, dur: int, tid: int, args: dict) -> str:
    """`_encode` of the event's dict, written out: the fixed fields are ints and two strings, and `args`
    holds a span's keyword arguments (identifiers as keys), so only non-int values need the encoder."""
    body = ",".join(f'"{k}":{v}' if type(v) is int else f'"{k}":{_encode(v)}' for k, v in args.items())
    return (f'{{"name":{_encode(name)},"cat":{_encode(cat)},"ph":"X","ts":{ts},"dur":{dur},"pid":{pid},"tid":{tid},'
            f'"args":{{{body}}}}}\n')


class _Tracer:
    def __init__(self, directory: str, process_name: str):
        self.pid = os.getpid()
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"trace-{self.pid}.jsonl"
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - closed at exit by flush()
        # spans end on hot paths (a switch turn, a gradient hook): they are kept as tuples and formatted in batches
        self._pending: list[tuple] = []
        self.emit({"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": process_name}})

    def complete(self, name: str, cat: str, ts: int, dur: int, args: dict) -> None:
        """One complete ("X") event on the calling thread."""
        with self._lock:  # not a bare append: a batch being taken must not lose an event appended meanwhile
            self._pending.append((name, cat, ts, dur, threading.get_native_id(), args))
            full = len(self._pending) >= PENDING
        if full:
            self._write_pending()

    def emit(self, event: dict) -> None:
        line = _encode(event) + "\n"
        with self._lock:
            self._file.write(line)

    def _write_pending(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._file.write("".join(_complete_line(self.pid, *event) for event in batch))

    def flush(self) -> None:
        self._write_pending()
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
