"""The match-action tables of docs/protocol.md 6.1 as data: keys, actions, parameters and bit widths.

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


PORT_BITS = 9
SCHEMA: dict[str, TableSpec] = {t.name: t for t in (
    TableSpec("ingress_drop_sim", (Field("port", PORT_BITS, aliases=("ingress_port",)),),
              {"set_ingress_drop_rate": (_p("threshold", 32),)}, size=512,
              doc="drop packets arriving on a port when a 32-bit uniform random number < threshold"),
    TableSpec("egress_drop_sim", (Field("port", PORT_BITS, aliases=("egress_port",)),),
              {"set_egress_drop_rate": (_p("threshold", 32),)}, stage="egress", size=512,
              doc="drop packets leaving on a port when a 32-bit uniform random number < threshold"),
    TableSpec("sessions", (Field("session", 16),),
              {"set_session": (_p("pool_base", 32), _p("pool_size", 32), _p("num_workers", 8),
                               _p("worker_mask", 32), _p("epoch", 32), _p("mcast_grp", 16), _p("next_step", 8),
                               _p("up_port", PORT_BITS), _p("up_worker", 16))},
              doc="a session's slot pool, contributors, ownership epoch and where results go"),
    TableSpec("workers", (Field("session", 16), Field("worker", 16)),
              {"set_worker": (_p("worker_bit", 32), _p("port", PORT_BITS))}, size=32 * 1024,
              doc="a contributor's bitmap bit and the port it is wired to"),
    TableSpec("endpoints", (Field("session", 16), Field("dst", 16)),
              {"set_endpoint": (_p("dst_mac", 48, "mac"), _p("dst_ip", 32, "ip"), _p("dst_udp", 16))},
              stage="egress", size=32 * 1024,
              doc="destination rewrite of emitted frames by (session, rank or 0xFFFF)"),
    TableSpec("ipv4_lpm", (Field("dst_addr", 32, "lpm", "ip", aliases=("dstAddr",)),),
              {"ipv4_forward": (_p("port", PORT_BITS), _p("dst_mac", 48, "mac")), "drop": ()},
              default_actions=("NoAction", "drop", "ipv4_forward"), size=1024,
              doc="plain L3 forwarding of non-luwu IPv4"),
)}

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
