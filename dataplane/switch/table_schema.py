"""The match-action tables of docs/protocol.md 6.1 as data: keys, actions, parameters and bit widths.

Read from the P4Info that p4c wrote for the P4 program (p4/build/p4info.txtpb): the software
switch has exactly the tables, keys, widths, actions, allowed default actions and sizes of the
program it twins, and a change to the P4 reaches it with `luwu p4 generate`. Only presentation
is kept here: how values are written (IPv4, MAC), older names of key fields, one line of doc.

`tables.py` validates entries against this schema, the runtime JSON loader and the P4Runtime
server map names through it, and error messages quote it. Names are the P4 aliases; fully
qualified P4 names (`LuwuIngress.classifier.sessions`) resolve by their last dotted component.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


class TableError(ValueError):
    """A table entry, multicast group or runtime file that the switch refuses, with what to fix."""


@dataclass(frozen=True)
class Field:
    """A match key field (or an action parameter: `kind` is then "param")."""

    name: str
    bits: int
    kind: str = "exact"  # "exact", "lpm" or "param"
    fmt: str = "int"  # "int", "ip" or "mac": how strings are read and values shown
    aliases: tuple[str, ...] = ()

    @property
    def max(self) -> int:
        return (1 << self.bits) - 1


@dataclass(frozen=True)
class TableSpec:
    name: str
    keys: tuple[Field, ...]
    actions: dict[str, tuple[Field, ...]]
    default_actions: tuple[str, ...] = ("NoAction", "drop")  # allowed as the table's default action
    stage: str = "ingress"
    size: int = 1024
    doc: str = field(default="", compare=False)

    def key_names(self) -> list[str]:
        return [k.name for k in self.keys]


def _p(name: str, bits: int, fmt: str = "int") -> Field:
    return Field(name, bits, "param", fmt)


PORT_BITS = 9  # v1model's port width; the P4Info's port fields must agree (checked below)

# presentation the P4Info does not carry
_FORMATS = {"dst_mac": "mac", "dst_ip": "ip", "dst_addr": "ip"}
_KEY_ALIASES = {("ingress_drop_sim", "port"): ("ingress_port",), ("egress_drop_sim", "port"): ("egress_port",),
                ("ipv4_lpm", "dst_addr"): ("dstAddr",)}
_DOCS = {
    "ingress_drop_sim": "drop packets arriving on a port when a 32-bit uniform random number < threshold",
    "egress_drop_sim": "drop packets leaving on a port when a 32-bit uniform random number < threshold",
    "sessions": "a session's slot pool, contributors, ownership epoch and where results go",
    "workers": "a contributor's bitmap bit and the port it is wired to",
    "endpoints": "destination rewrite of emitted frames by (session, rank or 0xFFFF)",
    "ipv4_lpm": "plain L3 forwarding of non-luwu IPv4",
}


FACTS_VERSION = 1  # of what _p4info_facts extracts: a change makes older cached facts unused


def _p4info_facts(text: str) -> dict:
    """What the schema needs from the P4Info text, as plain JSON-able data (protobuf parsed here)."""
    from finsy.proto import p4i
    from google.protobuf import text_format

    info = text_format.Parse(text, p4i.P4Info())
    kinds = {p4i.MatchField.EXACT: "exact", p4i.MatchField.LPM: "lpm"}
    scopes = {p4i.ActionRef.TABLE_AND_DEFAULT: "both", p4i.ActionRef.TABLE_ONLY: "table",
              p4i.ActionRef.DEFAULT_ONLY: "default"}
    actions = {a.preamble.id: [a.preamble.alias, [[p.name, p.bitwidth] for p in a.params]] for a in info.actions}
    return {"version": FACTS_VERSION, "tables": [
        {"name": t.preamble.name, "alias": t.preamble.alias, "size": t.size,
         "keys": [[m.name, m.bitwidth, kinds.get(m.match_type, p4i.MatchField.MatchType.Name(m.match_type))]
                  for m in t.match_fields],
         "actions": [[*actions[ref.id], scopes[ref.scope]] for ref in t.action_refs]}
        for t in info.tables]}


def _cached_facts() -> dict:
    """`_p4info_facts` of the committed P4Info, cached in this package's __pycache__ under a hash of
    the P4Info's text (as .pyc files are): importing protobuf and finsy costs ~0.1 s of CPU, on the
    critical path of every loopback switch process's start (docs/backend.md "Start-up"). A missing,
    unreadable or unwritable cache only means parsing the P4Info again."""
    import hashlib
    import json
    import os

    from luwu.dataplane.p4runtime import P4INFO_TXTPB

    text = P4INFO_TXTPB.read_text()
    digest = hashlib.sha256(f"{FACTS_VERSION}\n{text}".encode()).hexdigest()[:32]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__", f"p4info-facts-{digest}.json")
    try:
        with open(path) as f:
            facts = json.load(f)
        if facts.get("version") == FACTS_VERSION:
            return facts
    except (OSError, ValueError, AttributeError):
        pass
    facts = _p4info_facts(text)
    try:  # atomically: several switch processes may start at once
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(facts, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return facts


def _load_schema(facts: dict | None = None) -> dict[str, TableSpec]:
    """The tables of the P4Info's `facts` (default: the committed P4Info's, `_cached_facts`)."""
    facts = facts if facts is not None else _cached_facts()
    schema = {}
    for t in facts["tables"]:
        name = t["alias"]
        keys = []
        for key, bits, kind in t["keys"]:
            if kind not in ("exact", "lpm"):
                raise TableError(f"table {name}: match kind {kind} of {key} is not supported by the "
                                 f"software switch")
            keys.append(Field(key, bits, kind, _FORMATS.get(key, "int"), _KEY_ALIASES.get((name, key), ())))
        entry_actions, default_actions = {}, []
        for alias, params, scope in t["actions"]:
            if scope != "default":
                entry_actions[alias] = tuple(_p(p, bits, _FORMATS.get(p, "int")) for p, bits in params)
            if scope != "table":
                default_actions.append(alias)
        if name != "ipv4_lpm":
            # the twin implements a chosen miss action only for ipv4_lpm (a default route); on the
            # other tables a miss is the drop docs/protocol.md names, whatever the default says
            default_actions = [a for a in default_actions if a == "NoAction"]
        stage = "egress" if t["name"].startswith("LuwuEgress.") else "ingress"
        schema[name] = TableSpec(name, tuple(keys), entry_actions, tuple(default_actions), stage, int(t["size"]),
                                 _DOCS.get(name, ""))
    for spec in schema.values():
        for f in spec.keys + tuple(p for params in spec.actions.values() for p in params):
            if f.name in ("port", "up_port") and f.bits != PORT_BITS:
                raise TableError(f"the P4Info's {spec.name}.{f.name} is {f.bits} bits, the switch's ports {PORT_BITS}")
    return schema


SCHEMA: dict[str, TableSpec] = _load_schema()


def check_p4info_implemented(p4info, counters: tuple[str, ...]) -> None:
    """Raise ValueError naming the first table, match field, action, param or counter of a P4Info
    (a p4.config.v1.P4Info) that the software switch does not implement as the P4Info says;
    `counters`: the counter names it serves."""
    for table in p4info.tables:
        name = short_name(table.preamble.name)
        if name not in SCHEMA:
            raise ValueError(f"table {table.preamble.name!r} is not implemented by the software switch "
                             f"(it has {', '.join(SCHEMA)})")
        spec = SCHEMA[name]
        keys = {k.name: k.bits for k in spec.keys}
        for mf in table.match_fields:
            if keys.get(short_name(mf.name)) != mf.bitwidth:
                raise ValueError(f"table {name}: match field {mf.name}:{mf.bitwidth} differs from the switch's "
                                 f"{', '.join(f'{k}:{b}' for k, b in keys.items())}")
    actions = {a: {f.name: f.bits for f in params} for t in SCHEMA.values() for a, params in t.actions.items()}
    for action in p4info.actions:
        name = short_name(action.preamble.name)
        if name in ("NoAction", "drop"):
            continue
        if name not in actions:
            raise ValueError(f"action {action.preamble.name!r} is not implemented by the software switch")
        for p in action.params:
            if actions[name].get(p.name) != p.bitwidth:
                raise ValueError(f"action {name}: param {p.name}:{p.bitwidth} differs from the switch's "
                                 f"{actions[name]}")
    for counter in p4info.counters:
        if short_name(counter.preamble.name) not in counters:
            raise ValueError(f"counter {counter.preamble.name!r} is not one of {', '.join(counters)}")


MULTICAST_GROUP_BITS = 16  # the sessions table's mcast_grp parameter
INSTANCE_BITS = 16  # replicas are rewritten by endpoints[(session, instance)], a 16-bit key


def short_name(name: str) -> str:
    """`LuwuIngress.classifier.sessions` -> `sessions`."""
    return str(name).rsplit(".", 1)[-1]


def table_spec(table: str) -> TableSpec:
    name = short_name(table)
    if name not in SCHEMA:
        raise TableError(f"unknown table {table!r}: the switch has {', '.join(SCHEMA)}")
    return SCHEMA[name]


def find_key(spec: TableSpec, given: str) -> Field:
    """The key field named `given` (its last dotted component, or a known alias)."""
    name = short_name(given)
    for k in spec.keys:
        if name == k.name or name in k.aliases:
            return k
    raise TableError(f"table {spec.name!r}: unknown match field {given!r}; its key is "
                     f"{', '.join(f'{k.name}:{k.bits} {k.kind}' for k in spec.keys)}")


def parse_value(value, f: Field, where: str) -> int:
    """An int from an int, bytes (big-endian), a decimal/hex string, a dotted IPv4 or a colon MAC."""
    if isinstance(value, bool):
        raise TableError(f"{where}: {f.name} must be a number, got {value!r}")
    if isinstance(value, (bytes, bytearray)):
        v = int.from_bytes(value, "big")
    elif isinstance(value, int):
        v = value
    elif isinstance(value, str):
        s = value.strip()
        try:
            if f.fmt == "ip" and "." in s:
                v = int(ipaddress.IPv4Address(s))
            elif f.fmt == "mac" and ":" in s:
                parts = s.split(":")
                if len(parts) != 6:
                    raise ValueError
                v = int("".join(f"{int(x, 16):02x}" for x in parts), 16)
            else:
                v = int(s, 0)
        except ValueError:
            hint = {"ip": " (a number or a dotted IPv4 address)", "mac": " (a number or aa:bb:cc:dd:ee:ff)"}
            raise TableError(f"{where}: cannot read {f.name} value {value!r}{hint.get(f.fmt, ' (a number)')}") from None
    else:
        raise TableError(f"{where}: {f.name} must be a number, got {type(value).__name__} {value!r}")
    if not 0 <= v <= f.max:
        raise TableError(f"{where}: {f.name} value {value!r} does not fit in {f.bits} bits (allowed 0..{f.max})")
    return v


def show_value(v: int, f: Field) -> str:
    if f.fmt == "ip":
        return str(ipaddress.IPv4Address(v))
    if f.fmt == "mac":
        return ":".join(f"{b:02x}" for b in v.to_bytes(6, "big"))
    return str(v)
