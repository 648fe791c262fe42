"""Runtime configuration of a luwu switch: table entries and multicast groups, as JSON.

The format is p4lang/tutorials' runtime JSON, the one the BMv2 loader (`luwu p4 load`), the
software switch (`SoftwareSwitch.load_runtime`) and the controller share:

    {"target": "bmv2", "p4info": "../build/p4info.txtpb", "bmv2_json": "../build/luwu_v1model.json",
     "table_entries": [{"table": "LuwuIngress.classifier.sessions", "match": {"session": 5},
                        "action_name": "LuwuIngress.classifier.set_session",
                        "action_params": {"pool_base": 0, ...}}],
     "multicast_group_entries": [{"multicast_group_id": 1,
                                  "replicas": [{"egress_port": 1, "instance": 0}]}]}

Names may be full control-plane names or P4Info aliases; exact match values are numbers (or
dotted IPv4 / colon MAC strings for 32- and 48-bit fields), lpm values are `[value, prefix]`.
`RuntimeConfig.validate(p4info)` checks every name, field, parameter and width against the
P4Info and says what to fix. Builders (`session_entry`, `worker_entry`, ...) spell the tables
of docs/protocol.md 6.1 with keyword arguments so callers cannot misorder parameters.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from luwu.dataplane.protocol import MAX_SESSIONS, NODE, NextStep

from . import P4INFO_TXTPB

MULTICAST_GROUP_BITS = 16
INSTANCE_BITS = 16
PORT_BITS = 9


class RuntimeConfigError(ValueError):
    """A runtime configuration that does not fit the P4 program, with what to fix."""


@dataclass
class TableEntry:
    table: str
    match: dict = field(default_factory=dict)
    action_name: str = ""
    action_params: dict = field(default_factory=dict)
    default_action: bool = False
    priority: int | None = None

    def key(self) -> tuple:
        """What identifies the entry in its table (the match), for diffs and lookups."""
        return (self.table, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in self.match.items())))

    def to_dict(self) -> dict:
        out: dict = {"table": self.table}
        if self.default_action:
            out["default_action"] = True
        else:
            out["match"] = self.match
        out["action_name"] = self.action_name
        out["action_params"] = self.action_params
        if self.priority is not None:
            out["priority"] = self.priority
        return out


@dataclass
class Replica:
    egress_port: int
    instance: int = 0


@dataclass
class MulticastGroupEntry:
    multicast_group_id: int
    replicas: list[Replica] = field(default_factory=list)

    def pairs(self) -> list[tuple[int, int]]:
        """The replicas as (egress_port, instance) pairs."""
        return [(r.egress_port, r.instance) for r in self.replicas]

    def to_dict(self) -> dict:
        return {"multicast_group_id": self.multicast_group_id,
                "replicas": [{"egress_port": r.egress_port, "instance": r.instance} for r in self.replicas]}


@dataclass
class RuntimeConfig:
    target: str = "bmv2"
    p4info: str = "../build/p4info.txtpb"
    bmv2_json: str = "../build/luwu_v1model.json"
    table_entries: list[TableEntry] = field(default_factory=list)
    multicast_group_entries: list[MulticastGroupEntry] = field(default_factory=list)

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"target": self.target, "p4info": self.p4info, "bmv2_json": self.bmv2_json,
                "table_entries": [e.to_dict() for e in self.table_entries],
                "multicast_group_entries": [g.to_dict() for g in self.multicast_group_entries]}

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def dump(self, path: Path | str) -> None:
        Path(path).write_text(self.dumps())

    @classmethod
    def from_dict(cls, raw: dict) -> RuntimeConfig:
        if not isinstance(raw, dict):
            raise RuntimeConfigError("a runtime config is a JSON object with table_entries and multicast_group_entries")
        unknown = set(raw) - {"target", "p4info", "bmv2_json", "table_entries", "multicast_group_entries",
                              "clone_session_entries"}
        if unknown:
            raise RuntimeConfigError(f"unknown runtime config keys {sorted(unknown)}")
        entries = []
        for n, e in enumerate(raw.get("table_entries", [])):
            where = f"table_entries[{n}]"
            if not isinstance(e, dict) or "table" not in e:
                raise RuntimeConfigError(f"{where}: needs at least a 'table' and an 'action_name'")
            extra = set(e) - {"table", "match", "action_name", "action_params", "default_action", "priority"}
            if extra:
                raise RuntimeConfigError(f"{where}: unknown keys {sorted(extra)}")
            entries.append(TableEntry(e["table"], dict(e.get("match", {})), e.get("action_name", ""),
                                      dict(e.get("action_params", {})), bool(e.get("default_action", False)),
                                      e.get("priority")))
        groups = []
        for n, g in enumerate(raw.get("multicast_group_entries", [])):
            where = f"multicast_group_entries[{n}]"
            if not isinstance(g, dict) or "multicast_group_id" not in g:
                raise RuntimeConfigError(f"{where}: needs multicast_group_id and replicas")
            try:
                reps = [Replica(r["egress_port"], r.get("instance", 0)) for r in g.get("replicas", [])]
            except (TypeError, KeyError) as exc:
                raise RuntimeConfigError(f"{where}: every replica needs an egress_port (and an instance)") from exc
            groups.append(MulticastGroupEntry(g["multicast_group_id"], reps))
        return cls(raw.get("target", "bmv2"), raw.get("p4info", ""), raw.get("bmv2_json", ""), entries, groups)

    @classmethod
    def load(cls, path: Path | str) -> RuntimeConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise RuntimeConfigError(f"{path}: not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    # -- validation --------------------------------------------------------------------------
    def validate(self, p4info=None) -> None:
        """Raise RuntimeConfigError on the first entry that does not fit the P4Info."""
        index = P4InfoIndex.load(p4info)
        keys_seen: set = set()
        for n, entry in enumerate(self.table_entries):
            where = f"table_entries[{n}] ({entry.table})"
            table = index.table(entry.table, where)
            action = index.action(entry.action_name, where)
            refs = {r.id: r.scope for r in table.action_refs}
            if action.preamble.id not in refs:
                names = [index.actions_by_id[i].preamble.alias for i in refs]
                raise RuntimeConfigError(f"{where}: action {entry.action_name!r} is not an action of this table "
                                         f"(choose one of {names})")
            scope = refs[action.preamble.id]
            if entry.default_action:
                if scope == 1:  # TABLE_ONLY
                    raise RuntimeConfigError(f"{where}: {entry.action_name} cannot be the default action")
                if entry.match:
                    raise RuntimeConfigError(f"{where}: a default_action entry has no match")
            else:
                if scope == 2:  # DEFAULT_ONLY
                    raise RuntimeConfigError(f"{where}: {entry.action_name} may only be the table's default action")
                key = _check_match(table, entry.match, where)
                if (table.preamble.id, key) in keys_seen:
                    raise RuntimeConfigError(f"{where}: duplicate match {entry.match} in {table.preamble.name}")
                keys_seen.add((table.preamble.id, key))
            _check_params(action, entry.action_params, where)
        group_ids: set[int] = set()
        for n, group in enumerate(self.multicast_group_entries):
            where = f"multicast_group_entries[{n}]"
            gid = group.multicast_group_id
            if not isinstance(gid, int) or isinstance(gid, bool) or not 1 <= gid < 1 << MULTICAST_GROUP_BITS:
                raise RuntimeConfigError(f"{where}: multicast_group_id must be 1..{(1 << MULTICAST_GROUP_BITS) - 1}"
                                         f" (0 means no multicast), got {gid!r}")
            if gid in group_ids:
                raise RuntimeConfigError(f"{where}: multicast group {gid} is defined twice")
            group_ids.add(gid)
            pairs = set()
            for r in group.replicas:
                _check_int(r.egress_port, PORT_BITS, f"{where}: egress_port")
                _check_int(r.instance, INSTANCE_BITS, f"{where}: instance")
                if (r.egress_port, r.instance) in pairs:
                    raise RuntimeConfigError(f"{where}: replica (port {r.egress_port}, instance {r.instance}) twice")
                pairs.add((r.egress_port, r.instance))
        for n, entry in enumerate(self.table_entries):
            if index.table(entry.table, "").preamble.alias == "sessions" and not entry.default_action:
                grp = entry.action_params.get("mcast_grp", 0)
                if grp and grp not in group_ids:
                    raise RuntimeConfigError(f"table_entries[{n}]: session {entry.match} multicasts on group {grp}, "
                                             "which no multicast_group_entries defines")


class P4InfoIndex:
    """Tables and actions of a P4Info by full name and alias."""

    def __init__(self, info):
        self.info = info
        self.tables = {}
        self.actions = {}
        self.actions_by_id = {a.preamble.id: a for a in info.actions}
        for t in info.tables:
            self.tables[t.preamble.name] = self.tables[t.preamble.alias] = t
        for a in info.actions:
            self.actions[a.preamble.name] = self.actions[a.preamble.alias] = a

    @classmethod
    def load(cls, p4info=None) -> P4InfoIndex:
        """From a P4Info message, a path to a text P4Info, or None (the committed one)."""
        from finsy.proto import p4i
        from google.protobuf import text_format

        if isinstance(p4info, cls):
            return p4info
        if p4info is None or isinstance(p4info, (str, Path)):
            path = Path(p4info) if p4info else P4INFO_TXTPB
            info = text_format.Parse(path.read_text(), p4i.P4Info())
        else:
            info = p4info
        return cls(info)

    def table(self, name: str, where: str):
        if name not in self.tables:
            raise RuntimeConfigError(f"{where}: unknown table {name!r}; tables: "
                                     f"{sorted(t.preamble.name for t in self.info.tables)}")
        return self.tables[name]

    def action(self, name: str, where: str):
        if name not in self.actions:
            raise RuntimeConfigError(f"{where}: unknown action {name!r}")
        return self.actions[name]


def parse_value(value, bits: int, where: str) -> int:
    """An int from a number, a decimal/hex string, a dotted IPv4 (32 bits) or a colon MAC (48 bits)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RuntimeConfigError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            if bits == 32 and text.count(".") == 3:
                value = int(ipaddress.IPv4Address(text))
            elif bits == 48 and text.count(":") == 5:
                value = int(text.replace(":", ""), 16)
            else:
                value = int(text, 0)
        except ValueError as exc:
            raise RuntimeConfigError(f"{where}: cannot read {text!r} as a {bits}-bit value") from exc
    _check_int(value, bits, where)
    return value


def _check_int(value, bits: int, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << bits:
        raise RuntimeConfigError(f"{where}: {value!r} does not fit in {bits} bits (0..{(1 << bits) - 1})")


def _check_match(table, match: dict, where: str) -> tuple:
    if not isinstance(match, dict):
        raise RuntimeConfigError(f"{where}: match must be an object of field: value")
    fields = {f.name: f for f in table.match_fields}
    unknown = set(match) - set(fields)
    if unknown:
        raise RuntimeConfigError(f"{where}: unknown match field(s) {sorted(unknown)}; the key is "
                                 f"{[f'{f.name}:{f.bitwidth}' for f in table.match_fields]}")
    key: list[int | tuple[int, int]] = []
    for f in table.match_fields:
        if f.name not in match:
            raise RuntimeConfigError(f"{where}: match needs field {f.name!r} ({f.bitwidth} bits)")
        value = match[f.name]
        fw = f"{where}: match field {f.name}"
        if f.match_type == f.LPM:
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise RuntimeConfigError(f"{fw} is lpm: write [value, prefix_length], e.g. [\"10.0.0.0\", 8]")
            addr = parse_value(value[0], f.bitwidth, fw)
            plen = value[1]
            if isinstance(plen, bool) or not isinstance(plen, int) or not 0 <= plen <= f.bitwidth:
                raise RuntimeConfigError(f"{fw}: prefix length {plen!r} must be 0..{f.bitwidth}")
            if addr & ((1 << (f.bitwidth - plen)) - 1):
                raise RuntimeConfigError(f"{fw}: {value[0]}/{plen} has bits set beyond the prefix")
            key.append((addr, plen))
        elif f.match_type == f.EXACT:
            key.append(parse_value(value, f.bitwidth, fw))
        else:
            raise RuntimeConfigError(f"{fw}: match type {f.match_type} is not supported by this loader")
    return tuple(key)


def _check_params(action, params: dict, where: str) -> None:
    if not isinstance(params, dict):
        raise RuntimeConfigError(f"{where}: action_params must be an object of name: value")
    declared = {p.name: p for p in action.params}
    unknown = set(params) - set(declared)
    if unknown:
        raise RuntimeConfigError(f"{where}: {action.preamble.alias} has no parameter(s) {sorted(unknown)}; "
                                 f"it takes {[f'{p.name}:{p.bitwidth}' for p in action.params]}")
    for p in action.params:
        if p.name not in params:
            raise RuntimeConfigError(f"{where}: {action.preamble.alias} needs parameter {p.name!r} ({p.bitwidth} bits)")
        parse_value(params[p.name], p.bitwidth, f"{where}: parameter {p.name}")


# -- builders for the tables of docs/protocol.md 6.1 ------------------------------------------
# The one place that spells the tables: the controller's planner, the loopback plan, the
# benchmarks, the example runtime and the conformance suite all build entries here. Names are
# P4Info aliases (as in docs/protocol.md 6.1); values may be numbers or dotted/colon strings.


def session_entry(session: int, *, pool_base: int, pool_size: int, num_workers: int, worker_mask: int, epoch: int,
                  mcast_grp: int, next_step: int, up_port: int, up_worker: int) -> TableEntry:
    """A `sessions` entry. pool_size 0 sends every contribution up unaggregated (the fallback of a
    session the switch has no slots for)."""
    if not 1 <= session < MAX_SESSIONS:
        raise RuntimeConfigError(f"session id {session} out of range 1..{MAX_SESSIONS - 1}")
    if pool_size < 0 or pool_size & (pool_size - 1):
        raise RuntimeConfigError(f"session {session}: pool_size {pool_size} must be a power of two (or 0)")
    return TableEntry("sessions", {"session": session}, "set_session",
                      {"pool_base": pool_base, "pool_size": pool_size, "num_workers": num_workers,
                       "worker_mask": worker_mask, "epoch": epoch, "mcast_grp": mcast_grp, "next_step": next_step,
                       "up_port": up_port, "up_worker": up_worker})


def worker_entry(session: int, worker: int, *, worker_bit: int, port: int) -> TableEntry:
    return TableEntry("workers", {"session": session, "worker": worker}, "set_worker",
                      {"worker_bit": worker_bit, "port": port})


def child_port_entry(session: int, port: int) -> TableEntry:
    """A port of one of `session`'s child switches: GRADs passing through toward the node (ranks
    this switch does not know) are accepted from it (docs/protocol.md 6.8)."""
    return TableEntry("child_ports", {"session": session, "port": port}, "child_port", {})


def endpoint_entry(session: int, dst: int, *, dst_mac: int | str, dst_ip: int | str, dst_udp: int) -> TableEntry:
    return TableEntry("endpoints", {"session": session, "dst": dst}, "set_endpoint",
                      {"dst_mac": dst_mac, "dst_ip": dst_ip, "dst_udp": dst_udp})


def route_entry(prefix: int | str, prefix_len: int, *, port: int, dst_mac: int | str) -> TableEntry:
    return TableEntry("ipv4_lpm", {"dst_addr": [prefix, prefix_len]}, "ipv4_forward", {"port": port, "dst_mac": dst_mac})


def drop_rate_entry(direction: str, port: int, *, threshold: int) -> TableEntry:
    if direction not in ("ingress", "egress"):
        raise RuntimeConfigError(f"drop simulator direction must be 'ingress' or 'egress', got {direction!r}")
    return TableEntry(f"{direction}_drop_sim", {"port": port}, f"set_{direction}_drop_rate", {"threshold": threshold})


def multicast_group(group: int, replicas: list[tuple[int, int]]) -> MulticastGroupEntry:
    """A group from (egress_port, instance) pairs; instance = the worker's rank (or up_worker)."""
    return MulticastGroupEntry(group, [Replica(port, instance) for port, instance in replicas])


# -- one-switch stars -------------------------------------------------------------------------


@dataclass
class StarSession:
    """A session of a one-switch star: every worker contributes; `up_port` is the optimizer
    node's port for a node session (0 for a collective, whose result the switch multicasts)."""

    session: int
    pool_base: int
    pool_size: int
    epoch: int
    up_port: int = 0


def star_program(workers: int, sessions: list[StarSession], *, worker_port: Callable[[int], int],
                 endpoint: Callable[[int, int], tuple[int | str, int | str, int]] | None = None,
                 group: int | None = None) -> RuntimeConfig:
    """The table entries and multicast groups of a one-switch star, the switch as the root.

    Used by the loopback plan (the embedded default), `luwu bench switch` and the example runtime;
    the controller's planner builds trees with the same entry builders.

    Args:
        workers: ranks 0..workers-1, worker bit r for rank r.
        sessions: the sessions to install.
        worker_port: the switch port of rank r.
        endpoint: (dst, port) -> (dst_mac, dst_ip, dst_udp) for the `endpoints` entries of every
            rank (and NODE in node sessions); None installs no endpoints.
        group: one multicast group id for every session; None gives each session its own group
            numbered as the session.

    Returns:
        The RuntimeConfig (``to_dict()`` is the runtime JSON).
    """
    cfg = RuntimeConfig()
    mask = (1 << workers) - 1
    for s in sessions:
        grp = s.session if group is None else group
        cfg.table_entries.append(session_entry(
            s.session, pool_base=s.pool_base, pool_size=s.pool_size, num_workers=workers, worker_mask=mask,
            epoch=s.epoch, mcast_grp=grp, next_step=int(NextStep.ROOT), up_port=s.up_port, up_worker=0))
        for rank in range(workers):
            cfg.table_entries.append(worker_entry(s.session, rank, worker_bit=1 << rank, port=worker_port(rank)))
            if endpoint is not None:
                mac, ip, udp = endpoint(rank, worker_port(rank))
                cfg.table_entries.append(endpoint_entry(s.session, rank, dst_mac=mac, dst_ip=ip, dst_udp=udp))
        if endpoint is not None and s.up_port:
            mac, ip, udp = endpoint(NODE, s.up_port)
            cfg.table_entries.append(endpoint_entry(s.session, NODE, dst_mac=mac, dst_ip=ip, dst_udp=udp))
        if group is None or not any(g.multicast_group_id == grp for g in cfg.multicast_group_entries):
            cfg.multicast_group_entries.append(multicast_group(grp, [(worker_port(r), r) for r in range(workers)]))
    return cfg
