"""Load a p4lang/tutorials-style runtime JSON into the switch's tables.

{"target": ..., "p4info": ..., "table_entries": [{"table": "LuwuIngress.classifier.sessions",
 "match": {"hdr.luwu.session": 5}, "action_name": "...set_session", "action_params": {...},
 "default_action": false}], "multicast_group_entries": [{"multicast_group_id": 1,
 "replicas": [{"egress_port": 1, "instance": 0}]}]}

Names resolve by their last dotted component; lpm matches are ["10.0.0.0", 8]. Entries are
added to what the tables hold (`replace=True` clears them first). The whole file is applied as
one transaction: on any error nothing changes and the TableError names the entry's index.
"""

from __future__ import annotations

import json
from pathlib import Path

from .table_schema import TableError
from .tables import Tables

TOP_LEVEL = ("target", "p4info", "bmv2_json", "table_entries", "multicast_group_entries", "clone_session_entries")


def read(source) -> tuple[dict, str]:
    if isinstance(source, dict):
        return source, "runtime"
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise TableError(f"cannot read runtime file {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TableError(f"runtime file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TableError(f"runtime file {path}: the top level must be an object with table_entries / "
                         f"multicast_group_entries")
    return data, str(path)


def load(tables: Tables, source, replace: bool = False) -> dict:
    """Apply a runtime JSON; returns {"table_entries": n, "multicast_groups": m}."""
    data, where = read(source)
    unknown = set(data) - set(TOP_LEVEL)
    if unknown:
        raise TableError(f"{where}: unknown top-level keys {', '.join(sorted(unknown))}; expected "
                         f"{', '.join(TOP_LEVEL)}")
    entries = data.get("table_entries") or []
    groups = data.get("multicast_group_entries") or []
    if data.get("clone_session_entries"):
        raise TableError(f"{where}: clone_session_entries are not used by the luwu pipeline; remove them")
    if not isinstance(entries, list) or not isinstance(groups, list):
        raise TableError(f"{where}: table_entries and multicast_group_entries must be lists")
    with tables.transaction():
        if replace:
            tables.clear_entries()
        for i, e in enumerate(entries):
            _entry(tables, e, f"{where}: table_entries[{i}]")
        for i, g in enumerate(groups):
            _group(tables, g, f"{where}: multicast_group_entries[{i}]")
    return {"table_entries": len(entries), "multicast_groups": len(groups)}


def _entry(tables: Tables, e, where: str) -> None:
    if not isinstance(e, dict):
        raise TableError(f"{where}: must be an object, got {e!r}")
    for key in ("table", "action_name"):
        if key not in e:
            raise TableError(f"{where}: missing {key!r}")
    extra = set(e) - {"table", "match", "action_name", "action_params", "default_action", "priority"}
    if extra:
        raise TableError(f"{where}: unknown keys {', '.join(sorted(extra))}")
    try:
        if e.get("default_action"):
            tables.set_default(e["table"], e["action_name"], e.get("action_params") or {})
        else:
            if "match" not in e:
                raise TableError("missing 'match' (only a default_action entry may omit it)")
            tables.insert(e["table"], e["match"], e["action_name"], e.get("action_params") or {})
    except TableError as err:
        raise TableError(f"{where} ({e.get('table')}): {err}") from None


def _group(tables: Tables, g, where: str) -> None:
    if not isinstance(g, dict) or "multicast_group_id" not in g:
        raise TableError(f"{where}: needs multicast_group_id and replicas")
    replicas = g.get("replicas") or []
    pairs = []
    for j, r in enumerate(replicas):
        if not isinstance(r, dict) or "egress_port" not in r:
            raise TableError(f"{where}: replicas[{j}] needs egress_port (and instance)")
        pairs.append((r["egress_port"], r.get("instance", 0)))
    try:
        tables.set_multicast_group(g["multicast_group_id"], pairs)
    except TableError as err:
        raise TableError(f"{where}: {err}") from None
