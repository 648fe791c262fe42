"""Prometheus metrics of a worker process: the engines of its luwu process groups and of its
ModelInNetwork, served at http://HOST:PORT+RANK/metrics when LUWU_METRICS=HOST:PORT is set (each
rank of a host on its own port: PORT plus LOCAL_RANK, or the rank when LOCAL_RANK is unset).

Read at scrape time from the engines' own counters (dataplane/observe/metrics.py: EngineCollector):
nothing is computed between scrapes. The server starts with the first engine tracked and serves
every engine the process holds until it exits.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_links: dict[str, Any] = {}  # name -> engine link (worker/engine_link.py), while it is open
_address: tuple[str, int] | None = None


def track(name: str, link: Any, rank: int) -> tuple[str, int] | None:
    """Serve `link`'s engine statistics under `name` when LUWU_METRICS is set; returns where the
    process serves its metrics (None: not asked for). A bad LUWU_METRICS raises ValueError."""
    global _address
    spec = os.environ.get("LUWU_METRICS", "").strip()
    if not spec:
        return None
    with _lock:
        _links[name] = weakref.proxy(link) if _weakrefable(link) else link
        if _address is None:
            from luwu.dataplane.observe.metrics import EngineCollector, serve
            from luwu.dataplane.process.usage import check_host_port

            host, port = check_host_port(spec, "LUWU_METRICS")
            offset = int(os.environ.get("LOCAL_RANK", rank))
            _address = serve(f"{host}:{port + offset if port else 0}", EngineCollector(_stats))
        return _address


def address() -> tuple[str, int] | None:
    """Where this process serves its metrics: (host, port) once an engine is tracked with
    LUWU_METRICS set (port 0 in LUWU_METRICS: the port the system picked), else None."""
    with _lock:
        return _address


def untrack(name: str) -> None:
    with _lock:
        _links.pop(name, None)


def _stats() -> dict[str, dict]:
    with _lock:
        links = dict(_links)
    out = {}
    for name, link in links.items():
        try:
            out[name] = link.stats() or {}
        except Exception:  # noqa: BLE001 - a closed or dying engine: skip it this scrape
            continue
    return out


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True
