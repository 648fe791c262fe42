"""The P4 reader, the P4Info rules (ids, aliases) and the generator, on real and broken sources."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from finsy.proto import p4i
from google.protobuf import text_format

from luwu.dataplane import protocol
from luwu.p4 import P4_DIR, P4INFO_TXTPB
from luwu.p4.codegen import constants_p4
from luwu.p4.generate import DEFAULT_LANES, TNA_PROGRAM, V1MODEL_PROGRAM, render_all
from luwu.p4.p4info import aliases, assign_ids, jenkins_one_at_a_time, p4info_text
from luwu.p4.p4source import P4SourceError, read_program

HEADER = '#include <core.p4>\n#include <v1model.p4>\n'
PACKAGE = ("\ncontrol E(inout H h, inout M m, inout standard_metadata_t s) { apply { } }\n"
           "V1Switch(P(), V(), I(), E(), C(), D()) main;\n")


def program(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "prog.p4"
    path.write_text(HEADER + "struct H { }\nstruct M { bit<8> a; }\n" + body + PACKAGE)
    return path


def test_jenkins_gives_p4c_id_of_noaction():
    assert (0x01 << 24) | (jenkins_one_at_a_time("NoAction") & 0xFFFFFF) == 21257015


def test_aliases_are_shortest_unique_suffixes():
    got = aliases(["d.a.c", "e.b.c", "x.y", "I.drops", "E.drops", "I.k.sessions"])
    assert got == {"d.a.c": "a.c", "e.b.c": "b.c", "x.y": "y", "I.drops": "I.drops", "E.drops": "E.drops",
                   "I.k.sessions": "sessions"}


def test_explicit_ids_get_prefix_and_must_be_unique():
    from luwu.p4.p4info import Symbol as Sym

    ids = assign_ids([Sym("table", "I.t", 7, None, None), Sym("action", "I.a", 7, None, None),
                      Sym("action", "NoAction", None, None, None)])
    assert ids[("table", "I.t")] == 0x02000007 and ids[("action", "I.a")] == 0x01000007
    assert ids[("action", "NoAction")] == 21257015
    with pytest.raises(P4SourceError, match="assigned to another"):
        assign_ids([Sym("table", "I.t", 7, None, None), Sym("table", "I.u", 0x02000007, None, None)])
    with pytest.raises(P4SourceError, match="wrong 8-bit prefix"):
        assign_ids([Sym("table", "I.t", 0x01000007, None, None)])


def test_both_programs_parse():
    v1 = read_program(V1MODEL_PROGRAM)
    assert "v1model.p4" in v1.arch and [i.type for i in v1.top_instances] == ["V1Switch"]
    tna = read_program(TNA_PROGRAM)
    assert "tna.p4" in tna.arch and [i.type for i in tna.top_instances] == ["Pipeline", "Switch"]
    # the TNA program declares the same tables, actions and @ids as the reference
    for control in ("Classifier", "IngressDropSimulator", "EgressDropSimulator", "Forwarder", "Sender"):
        assert [(t.name, t.annotations.get_int("id")) for t in tna.controls[control].tables] == \
               [(t.name, t.annotations.get_int("id")) for t in v1.controls[control].tables]
    regs = {i.name: i.annotations.get_int("id") for c in tna.controls.values() for i in c.instances
            if i.type == "Register"}
    assert regs["slot_owner"] == 1 and regs["hb_credit"] == 10 and len([r for r in regs if "lane_pair" in r]) == 32


@pytest.mark.parametrize("body, message", [
    ("#if 1\n#endif\n", "unsupported directive"),
    ("#define F(x) x\n", "function-like"),
    ("#include <psa.p4>\n", "unknown system include"),
    ("control I(inout H h, inout M m, inout standard_metadata_t s) { meter(4, MeterType.bytes) q; apply { q; } }",
     "no P4Info mapping"),
    ("control I(inout H h, inout M m, inout standard_metadata_t s) { register<bit<32>>(4) r; apply { } }",
     "never used"),
    ("control I(inout H h, inout M m, inout standard_metadata_t s) {\n"
     " table t { key = { m.a: exact; } actions = { x; } } apply { t.apply(); } }", "not declared"),
    ("control I(inout H h, inout M m, inout standard_metadata_t s) {\n"
     " action a() { } table t { key = { m.a: exact; } actions = { a; } counters = c; } apply { } }",
     "unsupported property"),
])
def test_reader_rejects_what_it_cannot_see(tmp_path, body, message):
    with pytest.raises(P4SourceError, match=message):
        p4info_text(program(tmp_path, body))


def test_small_program_p4info(tmp_path):
    body = ("typedef bit<9> p_t;\n"
            "control I(inout H h, inout M m, inout standard_metadata_t s) {\n"
            "  @id(3) counter(8, CounterType.packets) c;\n"
            "  @id(9) action go(p_t port, bit<48> mac) { }\n"
            "  @id(2) table t { key = { m.a: exact @name(\"a\"); s.ingress_port: lpm; }\n"
            "                   actions = { go; @defaultonly NoAction; } const default_action = NoAction(); }\n"
            "  apply { t.apply(); c.count(0); } }\n")
    info = text_format.Parse(p4info_text(program(tmp_path, body)), p4i.P4Info())
    (t,) = info.tables
    assert (t.preamble.id, t.preamble.name, t.preamble.alias, t.size) == (0x02000002, "I.t", "t", 1024)
    assert [(f.id, f.name, f.bitwidth, f.match_type) for f in t.match_fields] == \
           [(1, "a", 8, p4i.MatchField.EXACT), (2, "s.ingress_port", 9, p4i.MatchField.LPM)]
    assert [(r.id, r.scope) for r in t.action_refs] == [(0x01000009, 0), (21257015, p4i.ActionRef.DEFAULT_ONLY)]
    assert t.const_default_action_id == 21257015
    go = [a for a in info.actions if a.preamble.alias == "go"][0]
    assert [(p.id, p.name, p.bitwidth) for p in go.params] == [(1, "port", 9), (2, "mac", 48)]
    (c,) = info.counters
    assert (c.preamble.id, c.size, c.spec.unit) == (0x12000003, 8, p4i.CounterSpec.PACKETS)


def test_constants_come_from_protocol():
    text = constants_p4()
    assert f"#define LUWU_UDP_PORT {protocol.DEFAULT_UDP_PORT}" in text
    for cls, prefix in ((protocol.MsgType, "TYPE_"), (protocol.DropReason, "DROP_"), (protocol.Event, "EVENT_"),
                        (protocol.Flag, "FLAG_")):
        for member in cls:
            if member.name != "NONE":
                assert re.search(rf"const bit<\d+> {prefix}{member.name} = {int(member)};", text), member
    assert "(count << 2) + (count << 3)" in text  # 12-byte PULL requests, without a multiplier


@pytest.mark.parametrize("lanes", [4, 5])
def test_other_lane_counts(lanes):
    files = render_all(lanes)
    payload = files[P4_DIR / "include" / "payload.p4"]
    assert f"#define LANES {lanes}" in payload and payload.count("bit<32> lane_") == lanes
    info = text_format.Parse(files[P4INFO_TXTPB], p4i.P4Info())
    assert sorted(r.preamble.alias for r in info.registers if r.preamble.alias.startswith("lane_")) == \
           sorted(f"lane_{k}" for k in range(lanes))
    tna = files[P4_DIR / "tna" / "aggregation_lanes.p4"]
    if lanes % 2:
        assert tna.startswith("#error")
    else:
        assert tna.count("Register<lane_pair_t") == lanes // 2


def test_default_lane_count_is_tofino_mode():
    assert DEFAULT_LANES == protocol.PACKET_MODES["tofino"] == 64
