"""P4Info of a luwu P4 program, built from its sources the way p4c's control-plane pass does.

p4c is not installed where luwu is developed, so `luwu p4 generate` derives the committed
`p4/build/p4info.txtpb` from the program read by `luwu.p4.p4source`, with the P4Info protobuf
classes (finsy's bindings), so the result is valid P4Info by construction. The rules are
p4c's (control-plane/p4RuntimeSymbolTable.cpp, p4RuntimeSerializer.cpp):

* names are control-plane names: the top-level control's type name, then instance names
  (`LuwuIngress.classifier.sessions`); the alias is the shortest dotted suffix that is unique
  among all symbols of the program;
* `@id(n)` without an 8-bit prefix gets the resource type's prefix ORed in; a symbol without
  `@id` (NoAction from core.p4) gets `prefix | jenkins_one_at_a_time(name) & 0xffffff`;
* every action declared in a control is listed (p4c's analyzeControl), plus top-level actions
  that tables reference; match fields and action parameters are numbered from 1 in order;
* a key element's name is its `@name` annotation, else the expression text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from finsy.proto import p4i

from .p4source import Control, P4SourceError, Program, eval_int, read_program

# P4Runtime resource type prefixes (p4runtime.proto / p4c P4RuntimeSymbolType).
PREFIX = {"action": 0x01, "table": 0x02, "counter": 0x12, "direct_counter": 0x13, "register": 0x16}
MATCH_TYPES = {"exact": p4i.MatchField.EXACT, "lpm": p4i.MatchField.LPM, "ternary": p4i.MatchField.TERNARY,
               "range": p4i.MatchField.RANGE, "optional": p4i.MatchField.OPTIONAL}
COUNTER_UNITS = {"packets": p4i.CounterSpec.PACKETS, "bytes": p4i.CounterSpec.BYTES,
                 "packets_and_bytes": p4i.CounterSpec.BOTH}
# Actions declared at top level by the architecture (core.p4), with their annotations.
TOP_LEVEL_ACTIONS = {"NoAction": ['@noWarn("unused")']}
# Package parameters that hold controls, by architecture: V1Switch(p, vr, ig, eg, ck, dep).
V1SWITCH_CONTROLS = (2, 3)


def jenkins_one_at_a_time(name: str) -> int:
    """Bob Jenkins' one-at-a-time hash, as p4c uses it for ids without @id."""
    h = 0
    for byte in name.encode():
        h = (h + byte) & 0xFFFFFFFF
        h = (h + (h << 10)) & 0xFFFFFFFF
        h ^= h >> 6
    h = (h + (h << 3)) & 0xFFFFFFFF
    h ^= h >> 11
    h = (h + (h << 15)) & 0xFFFFFFFF
    return h


@dataclass
class Symbol:
    kind: str  # action, table, counter, register
    name: str
    explicit_id: int | None
    node: object  # the p4source declaration
    control: Control | None  # where it is declared (for key widths)
    extra: dict | None = None


def control_plane_symbols(prog: Program) -> list[Symbol]:
    """Every control-plane symbol of the V1Switch program, in p4c's traversal order."""
    package = [i for i in prog.top_instances if i.name == "main"]
    if len(package) != 1 or package[0].type != "V1Switch":
        raise P4SourceError("the program must instantiate `V1Switch(...) main;`")
    symbols: list[Symbol] = []
    referenced_top: list[str] = []

    def visit(control: Control, prefix: str) -> None:
        for action in control.actions:
            symbols.append(Symbol("action", f"{prefix}.{action.name}", action.annotations.get_int("id"), action,
                                  control))
        for table in control.tables:
            symbols.append(Symbol("table", f"{prefix}.{table.name}", table.annotations.get_int("id"), table, control))
            local = {a.name for a in control.actions}
            for ref in table.actions:
                if ref.name not in local and ref.name not in TOP_LEVEL_ACTIONS:
                    raise P4SourceError(f"{prefix}.{table.name}: action {ref.name} is not declared in its control")
                if ref.name not in local and ref.name not in referenced_top:
                    referenced_top.append(ref.name)
        for inst in control.instances:
            name = f"{prefix}.{inst.name}"
            if inst.type == "register":
                symbols.append(Symbol("register", name, inst.annotations.get_int("id"), inst, control))
            elif inst.type == "counter":
                symbols.append(Symbol("counter", name, inst.annotations.get_int("id"), inst, control))
            elif inst.type in prog.controls:
                visit(prog.controls[inst.type], name)
            else:
                raise P4SourceError(f"{name}: extern {inst.type} has no P4Info mapping here")
            if inst.type in ("register", "counter") and inst.name not in control.body.split():
                raise P4SourceError(f"{name} is never used (p4c would drop it from P4Info)")

    for index in V1SWITCH_CONTROLS:
        arg = package[0].args[index]
        if len(arg) != 3 or arg[1].text != "(" or arg[2].text != ")":
            raise P4SourceError("V1Switch arguments must be `ControlType()`")
        ctype = arg[0].text
        if ctype not in prog.controls:
            raise P4SourceError(f"V1Switch argument {ctype} is not a control of the program")
        visit(prog.controls[ctype], ctype)
    for name in referenced_top:
        symbols.append(Symbol("action", name, None, None, None, {"annotations": TOP_LEVEL_ACTIONS[name]}))
    return symbols


def assign_ids(symbols: list[Symbol]) -> dict[tuple[str, str], int]:
    """p4c's id assignment: explicit @id (prefix added), then hashed names in sorted order."""
    ids: dict[tuple[str, str], int] = {}
    used: set[int] = set()
    for sym in symbols:
        if sym.explicit_id is None:
            continue
        prefix = PREFIX[sym.kind] << 24
        value = sym.explicit_id
        if value & 0xFF000000 and value & 0xFF000000 != prefix:
            raise P4SourceError(f"{sym.name}: @id 0x{value:08x} has the wrong 8-bit prefix for a {sym.kind}")
        value |= prefix
        if value in used:
            raise P4SourceError(f"{sym.name}: @id 0x{value:08x} is assigned to another declaration too")
        used.add(value)
        ids[(sym.kind, sym.name)] = value
    for sym in sorted((s for s in symbols if s.explicit_id is None), key=lambda s: s.name):
        prefix = PREFIX[sym.kind] << 24
        h = jenkins_one_at_a_time(sym.name)
        for _ in range(1 << 24):  # linear probing, as p4c's probeForId
            value = prefix | (h & 0xFFFFFF)
            if value not in used:
                break
            h += 1
        used.add(value)
        ids[(sym.kind, sym.name)] = value
    return ids


def aliases(names: list[str]) -> dict[str, str]:
    """Shortest unique dotted suffix of every name, over all names together (p4c's suffix set)."""
    counts: dict[tuple[str, ...], int] = {}
    unique = sorted(set(names))
    for name in unique:
        parts = tuple(name.split("."))
        for k in range(1, len(parts) + 1):
            counts[parts[-k:]] = counts.get(parts[-k:], 0) + 1
    out = {}
    for name in unique:
        parts = tuple(name.split("."))
        k = next(k for k in range(1, len(parts) + 1) if counts[parts[-k:]] < 2 or k == len(parts))
        out[name] = ".".join(parts[-k:])
    return out


def build_p4info(prog: Program, arch: str = "v1model") -> p4i.P4Info:
    symbols = control_plane_symbols(prog)
    ids = assign_ids(symbols)
    alias = aliases([s.name for s in symbols])
    info = p4i.P4Info()
    info.pkg_info.arch = arch

    def preamble(msg, sym: Symbol, annotations: list[str] = ()) -> None:
        msg.preamble.id = ids[(sym.kind, sym.name)]
        msg.preamble.name = sym.name
        msg.preamble.alias = alias[sym.name]
        msg.preamble.annotations.extend(annotations)

    action_ids = {s.name: ids[("action", s.name)] for s in symbols if s.kind == "action"}
    for sym in symbols:
        if sym.kind == "table":
            table, control = sym.node, sym.control
            msg = info.tables.add()
            preamble(msg, sym)
            for number, key in enumerate(table.keys, 1):
                field = msg.match_fields.add()
                field.id = number
                field.name = key.annotations.get_str("name") or key.expr
                field.bitwidth = prog.field_width(control, key.expr)
                if key.match_kind not in MATCH_TYPES:
                    raise P4SourceError(f"{sym.name}: unsupported match kind {key.match_kind}")
                field.match_type = MATCH_TYPES[key.match_kind]
            prefix = sym.name.rsplit(".", 1)[0]
            for ref in table.actions:
                aref = msg.action_refs.add()
                aref.id = action_ids.get(f"{prefix}.{ref.name}", action_ids.get(ref.name))
                if ref.annotations.has("defaultonly"):
                    aref.annotations.append("@defaultonly")
                    aref.scope = p4i.ActionRef.DEFAULT_ONLY
                elif ref.annotations.has("tableonly"):
                    aref.annotations.append("@tableonly")
                    aref.scope = p4i.ActionRef.TABLE_ONLY
            if table.const_default and table.default_action:
                msg.const_default_action_id = action_ids.get(f"{prefix}.{table.default_action}",
                                                             action_ids.get(table.default_action))
            msg.size = table.size if table.size is not None else 1024  # p4c's default table size
    for sym in symbols:
        if sym.kind == "action":
            msg = info.actions.add()
            if sym.node is None:
                preamble(msg, sym, sym.extra["annotations"])
                continue
            preamble(msg, sym)
            for number, param in enumerate(sym.node.params, 1):
                p = msg.params.add()
                p.id = number
                p.name = param.name
                p.bitwidth = prog.width(param.type)
    for sym in symbols:
        if sym.kind == "counter":
            inst = sym.node
            if len(inst.args) != 2:
                raise P4SourceError(f"{sym.name}: counter(size, CounterType.x) expected")
            unit = inst.args[1][-1].text
            msg = info.counters.add()
            preamble(msg, sym)
            msg.spec.unit = COUNTER_UNITS[unit]
            msg.size = eval_int(inst.args[0])
        elif sym.kind == "register":
            inst = sym.node
            msg = info.registers.add()
            preamble(msg, sym)
            msg.type_spec.bitstring.bit.bitwidth = prog.width(inst.type_args)
            msg.size = eval_int(inst.args[0])
    info.type_info.SetInParent()
    return info


def p4info_text(program: Path, defines: dict[str, str] | None = None,
                overrides: dict[Path, str] | None = None) -> str:
    """P4Info of the v1model program at `program`, in protobuf text format."""
    prog = read_program(program, defines, overrides)
    if "v1model.p4" not in prog.arch:
        raise P4SourceError(f"{program} does not include <v1model.p4>")
    return text_format.MessageToString(build_p4info(prog))


def load_p4info(path: Path) -> p4i.P4Info:
    return text_format.Parse(Path(path).read_text(), p4i.P4Info())


def p4info_summary(info: p4i.P4Info) -> dict[str, dict[str, tuple]]:
    """What a controller depends on, by kind and name, independent of entry order."""
    return {
        "tables": {t.preamble.name: (t.preamble.id, t.preamble.alias, t.size,
                                     tuple((f.id, f.name, f.bitwidth, f.match_type) for f in t.match_fields),
                                     tuple(sorted((r.id, r.scope) for r in t.action_refs)),
                                     t.const_default_action_id) for t in info.tables},
        "actions": {a.preamble.name: (a.preamble.id, a.preamble.alias,
                                      tuple((p.id, p.name, p.bitwidth) for p in a.params)) for a in info.actions},
        "counters": {c.preamble.name: (c.preamble.id, c.preamble.alias, c.spec.unit, c.size) for c in info.counters},
        "registers": {r.preamble.name: (r.preamble.id, r.preamble.alias, r.type_spec.bitstring.bit.bitwidth, r.size)
                      for r in info.registers},
    }


def p4info_differences(got: p4i.P4Info, want: p4i.P4Info) -> list[str]:
    """Readable differences between two P4Infos' summaries (empty: equivalent for a controller)."""
    a, b = p4info_summary(got), p4info_summary(want)
    out = []
    for kind in b:
        for name in sorted(set(a[kind]) | set(b[kind])):
            if a[kind].get(name) != b[kind].get(name):
                out.append(f"{kind} {name}: {a[kind].get(name, 'absent')} != {b[kind].get(name, 'absent')}")
    return out
