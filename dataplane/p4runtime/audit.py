"""The audit log of P4Runtime writes: who wrote what to a switch, and whether it took.

Both ends keep one: the switch's P4Runtime server (`luwu switch --audit-log`, dataplane/switch/p4runtime_server.py)
logs every Write update and SetForwardingPipelineConfig it is sent, accepted or refused, and the
controller (`luwu controller --audit-log`, controller/programmer.py) logs every update it sends.
One JSON object per line, appended and flushed as it happens:

    {"time": 1764300000.123, "source": {"switch": "s1", "pid": 4242},
     "who": {"peer": "ipv4:127.0.0.1:41234", "identity": "certificate CN=ops", "role": "controller"},
     "what": {"rpc": "Write", "type": "INSERT", "entity": "table_entry", "table": "sessions",
              "action": "session_params", "match": {"session": "0x0001"}},
     "result": "OK"}

`who.identity` is how the switch admitted the caller: "certificate CN=NAME" (a client certificate
of `luwu certs`, its `role` beside it), "bearer token", or both.
`result` is "OK" or the error as the writer saw it (`CODE: message`). A refused Write (not
primary, wrong token) is one line for the whole request, its `what` naming the first update
and the count. Lines are self-contained, so `jq` or `grep` read them; a log is never rewritten.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from finsy.proto import p4r

DEFAULT_DIR_ENV = "XDG_STATE_HOME"  # the daemons' default audit directory: $XDG_STATE_HOME/luwu
MAX_MATCH_FIELDS = 8  # match fields named per update (a table key has at most a handful)


def default_audit_path(daemon: str) -> Path:
    """Where a daemon's audit log goes when no --audit-log is given: the user's state directory
    ($XDG_STATE_HOME/luwu, else ~/.local/state/luwu), `DAEMON-p4runtime-audit.jsonl`, shared by
    the daemons of that kind (each line names its `source`)."""
    base = os.environ.get(DEFAULT_DIR_ENV) or str(Path.home() / ".local" / "state")
    return Path(base) / "luwu" / f"{daemon}-p4runtime-audit.jsonl"


class AuditLog:
    """An append-only JSON-lines file of P4Runtime writes; safe to share between threads.

    Args:
        path: the file (its folder is made); lines are appended to what is there.
        source: who keeps the log, put in every line as `source` (e.g. {"switch": "s1"}).

    Examples::

        >>> log = AuditLog("run/switch-audit.jsonl", {"switch": "s1"})
        >>> log.record({"peer": "ipv4:127.0.0.1:5000"}, {"rpc": "Write", "type": "INSERT"}, "OK")
    """

    def __init__(self, path: str | Path, source: dict[str, Any] | None = None):
        self.path = Path(path)
        self.source = dict(source or {})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # line-buffered: each record is on disk as written
        except OSError as exc:
            raise OSError(f"audit log {self.path}: cannot open it for appending ({exc.strerror})") from None
        self._lock = threading.Lock()

    def record(self, who: dict[str, Any], what: dict[str, Any], result: str) -> None:
        line = json.dumps({"time": round(time.time(), 6), "source": self.source, "who": who, "what": what,
                           "result": result}, separators=(",", ":"), default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


class WatchedContext:
    """A gRPC call's context that remembers the refusal it aborted with, so that the server can log
    a refused write (every other attribute is the context's own)."""

    def __init__(self, context):
        self.context = context
        self.refused: tuple[Any, str] | None = None  # (grpc.StatusCode, details)
        self.logged = False  # the call's updates are in the audit log already

    def abort(self, code, details):
        self.refused = (code, details)
        self.context.abort(code, details)

    def __getattr__(self, name):
        return getattr(self.context, name)


def _name(entities, ident: int) -> str:
    """The P4Info alias of `ident` in a finsy entity map, or the number when it is not there."""
    try:
        return str(entities[ident].alias)
    except (KeyError, IndexError, TypeError, AttributeError):
        return str(ident)


def describe_update(update: p4r.Update, schema=None) -> dict[str, Any]:
    """What one P4Runtime Update does, as names: {"type", "entity", and per entity "table",
    "action", "default", "match" (field -> hex value) or "group", "replicas"}. `schema`: a finsy
    P4Schema to turn ids into names (None: ids)."""
    kind = p4r.Update.Type.Name(update.type)
    which = update.entity.WhichOneof("entity") or "none"
    out: dict[str, Any] = {"type": kind, "entity": which}
    if which == "table_entry":
        te = update.entity.table_entry
        tables = getattr(schema, "tables", None)
        out["table"] = _name(tables, te.table_id) if tables is not None else te.table_id
        if te.is_default_action:
            out["default"] = True
        if te.action.HasField("action"):
            actions = getattr(schema, "actions", None)
            aid = te.action.action.action_id
            out["action"] = _name(actions, aid) if actions is not None else aid
        match = {}
        table = None
        if tables is not None:
            try:
                table = tables[te.table_id]
            except (KeyError, IndexError):
                table = None
        for m in list(te.match)[:MAX_MATCH_FIELDS]:
            field = _name(table.match_fields, m.field_id) if table is not None else str(m.field_id)
            kind_ = m.WhichOneof("field_match_type")
            if kind_ == "lpm":
                text = f"0x{m.lpm.value.hex()}/{m.lpm.prefix_len}"
            elif kind_ == "ternary":
                text = f"0x{m.ternary.value.hex()}&&&0x{m.ternary.mask.hex()}"
            elif kind_ == "range":
                text = f"0x{m.range.low.hex()}..0x{m.range.high.hex()}"
            else:  # exact, optional: a value
                text = "0x" + getattr(getattr(m, kind_ or "exact"), "value", b"").hex()
            match[field] = text
        if match:
            out["match"] = match
    elif which == "packet_replication_engine_entry":
        pre = update.entity.packet_replication_engine_entry
        if pre.HasField("multicast_group_entry"):
            g = pre.multicast_group_entry
            out["group"] = g.multicast_group_id
            out["replicas"] = [[r.port.hex() if r.port else r.egress_port, r.instance] for r in g.replicas]
        else:
            out["clone_session"] = pre.clone_session_entry.session_id
    return out


def peer_identity(context, authenticated: str) -> dict[str, str]:
    """Who made a gRPC call: its peer address, and the identity it proved: the subject of its TLS
    client certificate where it presented one, else `authenticated` (how the server let it in,
    e.g. "bearer token" or "none")."""
    who = {"peer": str(context.peer() or "")}
    auth = context.auth_context() or {}
    names = [v.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
             for v in auth.get(key, [])]
    who["identity"] = f"certificate {names[0]}" if names else authenticated
    return who
