"""The committed P4Info against the P4 sources and docs/protocol.md.

The sources are scanned here with plain regular expressions, independently of p4c (which
writes the P4Info), so a disagreement between the sources, the P4Info and the spec shows up.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from finsy import P4Schema
from finsy.proto import p4i
from google.protobuf import text_format

from luwu.p4 import P4_DIR, P4INFO_TXTPB
from luwu.p4.generate import check, committed_lanes

REPO = P4_DIR.parent
PREFIX = {"tables": 0x02, "actions": 0x01, "counters": 0x12, "registers": 0x16}
NOACTION_ID = 21257015  # p4c: 0x01 << 24 | jenkins_one_at_a_time("NoAction") & 0xffffff


@pytest.fixture(scope="module")
def info() -> p4i.P4Info:
    return text_format.Parse(P4INFO_TXTPB.read_text(), p4i.P4Info())


def v1model_sources() -> str:
    """Text of luwu_v1model.p4 and every file it includes, comments removed."""
    seen: list[Path] = []

    def walk(path: Path) -> str:
        if path in seen:
            return ""
        seen.append(path)
        text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
        text = re.sub(r"//[^\n]*", "", text)
        out = [text]
        for inc in re.findall(r'#include "([^"]+)"', text):
            out.append(walk((path.parent / inc).resolve()))
        return "\n".join(out)

    return walk(P4_DIR / "luwu_v1model.p4")


def macros(text: str) -> dict[str, int]:
    out = {}
    for name, value in re.findall(r"#define (\w+) (.+)", text):
        try:
            out[name] = int(eval(value, {"__builtins__": {}}, out))  # noqa: S307 - numbers from our own sources
        except Exception:  # noqa: BLE001 - non-numeric defines are not sizes
            pass
    return out


def widths(text: str) -> dict[str, int]:
    return {name: int(w) for w, name in re.findall(r"typedef bit<(\d+)>\s+(\w+);", text)}


def test_generated_files_are_up_to_date():
    stale = check()
    assert not stale, f"stale generated files (run `luwu p4 generate --lanes {committed_lanes()}`): {stale}"


def test_p4info_loads_with_finsy():
    schema = P4Schema(P4INFO_TXTPB)
    assert schema.p4info.pkg_info.arch == "v1model"
    assert {t.alias for t in schema.tables} == {"ingress_drop_sim", "egress_drop_sim", "sessions", "workers",
                                                 "child_ports", "endpoints", "ipv4_lpm"}


def test_ids_unique_and_prefixed(info):
    ids = []
    for kind, prefix in PREFIX.items():
        for entity in getattr(info, kind):
            ids.append(entity.preamble.id)
            assert entity.preamble.id >> 24 == prefix, f"{entity.preamble.name}: id {entity.preamble.id:#x}"
    assert len(ids) == len(set(ids))
    assert [a.preamble.id for a in info.actions if a.preamble.name == "NoAction"] == [NOACTION_ID]


def test_every_source_declaration_is_in_p4info(info):
    text = v1model_sources()
    sizes, types = macros(text), widths(text)

    def width(t: str) -> int:
        m = re.fullmatch(r"bit<(\d+)>", t)
        return int(m.group(1)) if m else types[t]

    actions = {a.preamble.name.rsplit(".", 1)[-1]: a for a in info.actions}
    declared = re.findall(r"@id\((\d+)\)\s+action\s+(\w+)\s*\(([^)]*)\)", text)
    assert declared, "no actions found in the sources"
    for number, name, params in declared:
        a = actions[name]
        assert a.preamble.id == (PREFIX["actions"] << 24 | int(number)), name
        want = [(p.split()[-1], width(" ".join(p.split()[:-1]))) for p in params.split(",") if p.strip()]
        assert [(p.name, p.bitwidth) for p in a.params] == want, name
        assert [p.id for p in a.params] == list(range(1, len(want) + 1)), name
    assert set(actions) == {n for _, n, _ in declared} | {"NoAction"}

    tables = {t.preamble.name.rsplit(".", 1)[-1]: t for t in info.tables}
    found = re.findall(r"@id\((\d+)\)\s+table\s+(\w+)\s*\{(.*?)\n    \}", text, flags=re.S)
    assert {n for _, n, _ in found} == set(tables)
    for number, name, body in found:
        t = tables[name]
        assert t.preamble.id == (PREFIX["tables"] << 24 | int(number)), name
        keys = re.findall(r"([\w.]+)\s*:\s*(\w+)\s*@name\(\"(\w+)\"\)", body)
        assert [(f.name, p4i.MatchField.MatchType.Name(f.match_type).lower()) for f in t.match_fields] == \
               [(n, kind) for _, kind, n in keys], name
        assert [f.id for f in t.match_fields] == list(range(1, len(keys) + 1))
        refs = re.search(r"actions\s*=\s*\{(.*?)\}", body, flags=re.S).group(1)
        ref_names = [r.split()[-1] for r in refs.split(";") if r.strip()]
        assert [actions_by_id(info)[r.id] for r in t.action_refs] == ref_names, name
        assert t.size == sizes[re.search(r"size\s*=\s*(\w+);", body).group(1)], name

    registers = {r.preamble.name.rsplit(".", 1)[-1]: r for r in info.registers}
    regs = re.findall(r"@id\((\d+)\)\s+register<bit<(\d+)>>\((\w+)\)\s+(\w+);", text)
    assert {n for *_, n in regs} == set(registers)
    for number, bits, size, name in regs:
        r = registers[name]
        assert r.preamble.id == (PREFIX["registers"] << 24 | int(number)), name
        assert r.type_spec.bitstring.bit.bitwidth == int(bits)
        assert r.size == sizes[size], name

    counters = {c.preamble.name: c for c in info.counters}
    found_c = re.findall(r"control (\w+)\(.*?@id\((\d+)\)\s+counter\((\w+),\s*CounterType\.(\w+)\)\s+(\w+);",
                         text, flags=re.S)
    decls = re.findall(r"@id\((\d+)\)\s+counter\((\w+),\s*CounterType\.(\w+)\)\s+(\w+);", text)
    assert len(decls) == len(counters) == 5 and found_c
    for number, size, unit, name in decls:
        match = [c for c in counters.values() if c.preamble.id == (PREFIX["counters"] << 24 | int(number))]
        assert len(match) == 1 and match[0].preamble.name.endswith("." + name)
        assert match[0].size == sizes[size] and unit == "packets_and_bytes" and match[0].spec.unit == 3


def actions_by_id(info) -> dict[int, str]:
    return {a.preamble.id: a.preamble.name.rsplit(".", 1)[-1] for a in info.actions}


# -- docs/protocol.md --------------------------------------------------------------------------

def protocol_section(number: str) -> str:
    text = (REPO / "docs" / "protocol.md").read_text()
    start = text.index(f"### {number} ")
    return text[start:text.index("\n### ", start + 1)]


def protocol_tables() -> dict[str, tuple[list[tuple[str, int, str]], dict[str, list[tuple[str, int]]]]]:
    """6.1 rows: table -> ([(key, bits, kind)], {action: [(param, bits)]})."""
    out = {}
    for line in protocol_section("6.1").splitlines():
        m = re.match(r"\| `(\w+)`[^|]*\| (.*?) \| (.*?) \|$", line)
        if not m:
            continue
        kind = re.search(r"(exact|lpm)", m.group(2)).group(1)  # one kind per row ("`a:16`, `b:16` exact")
        keys = [(k, int(b), kind) for k, b in re.findall(r"`(\w+):(\d+)`", m.group(2))]
        acts = {}
        for name, params in re.findall(r"`(\w+)(?:\(([^)]*)\))?`", m.group(3)):
            acts[name] = [(p.split(":")[0].strip(), int(p.split(":")[1])) for p in params.split(",") if p.strip()]
        out[m.group(1)] = (keys, acts)
    return out


def test_tables_match_protocol_md(info):
    spec = protocol_tables()
    assert set(spec) == {"ingress_drop_sim", "egress_drop_sim", "sessions", "workers", "child_ports", "endpoints",
                         "ipv4_lpm"}
    by_alias = {t.preamble.alias: t for t in info.tables}
    action_of = {a.preamble.id: a for a in info.actions}
    for name, (keys, acts) in spec.items():
        t = by_alias[name]
        got = [(f.name, f.bitwidth, p4i.MatchField.MatchType.Name(f.match_type).lower()) for f in t.match_fields]
        assert sorted(got) == sorted(keys), name
        got_acts = {action_of[r.id].preamble.alias: [(p.name, p.bitwidth) for p in action_of[r.id].params]
                    for r in t.action_refs if action_of[r.id].preamble.name != "NoAction"}
        assert got_acts == acts, name


def test_registers_and_counters_named_in_protocol_md(info):
    names = {r.preamble.name.rsplit(".", 1)[-1] for r in info.registers}
    rows = [line.split("|")[1] for line in protocol_section("6.2").splitlines() if line.startswith("| `")]
    spec = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("(index")[0])}
    lanes = committed_lanes()
    expected = (spec - {"lane_0", "lane_{lanes-1}"}) | {f"lane_{k}" for k in range(lanes)}
    assert names == expected
    counter_leaves = {c.preamble.name.rsplit(".", 1)[-1] for c in info.counters}
    assert counter_leaves == {"drops", "events", "rx_types", "session_packets"}
    assert len(re.findall(r"\b(drops|rx_types|events|session_packets)\b", protocol_section("6.6"))) >= 4
