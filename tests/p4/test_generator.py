"""The generator (constants from protocol.py, lanes from templates) and the committed p4c build.

The build tests that need p4c/p4test are marked `bmv2` and skip without them; the stamp check
runs everywhere, so a source edit without a rebuild fails CI even on a machine without p4c.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from finsy.proto import p4i
from google.protobuf import text_format

from luwu.dataplane import protocol
from luwu.p4 import P4_DIR, P4INFO_TXTPB, compiler
from luwu.p4.codegen import constants_p4
from luwu.p4.generate import DEFAULT_LANES, check, render_sources

needs_p4c = pytest.mark.skipif(shutil.which("p4c") is None, reason="needs p4c on PATH (p4lang/p4c)")
needs_p4test = pytest.mark.skipif(shutil.which("p4test") is None, reason="needs p4test on PATH (p4lang/p4c)")


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
    files = render_sources(lanes)
    payload = files[P4_DIR / "include" / "payload.p4"]
    assert f"#define LANES {lanes}" in payload and payload.count("bit<32> lane_") == lanes
    v1 = files[P4_DIR / "include" / "aggregation_lanes.p4"]
    assert v1.count("register<bit<32>>") == lanes
    tna = files[P4_DIR / "tna" / "aggregation_lanes.p4"]
    if lanes % 2:
        assert tna.startswith("#error")
    else:
        assert tna.count("Register<lane_pair_t") == lanes // 2


def test_a_program_wider_than_one_chunk_refuses_to_build():
    """Short aggregation packets (docs/protocol.md 3.3) need a stack of chunks a wider program does
    not parse: its payload.p4 stops the build instead of dropping every short packet as MALFORMED."""
    assert protocol.PACKET_MODES["tofino"] == protocol.LANE_CHUNK  # the BMv2/Tofino build: one chunk
    assert f"#define LUWU_LANE_CHUNK {protocol.LANE_CHUNK}" in constants_p4()
    payload = render_sources(2 * protocol.LANE_CHUNK)[P4_DIR / "include" / "payload.p4"]
    assert "#if LANES > LUWU_LANE_CHUNK\n#error" in payload


def test_default_lane_count_is_tofino_mode():
    assert DEFAULT_LANES == protocol.PACKET_MODES["tofino"] == 64


def test_committed_files_are_up_to_date():
    stale = check()
    assert not stale, [f"{s.path}: {s.reason}" for s in stale]


def test_build_stamp_catches_a_source_edit(monkeypatch, tmp_path):
    """An edited source (or a hand-edited output) makes the committed build stale, without p4c."""
    assert compiler.build_staleness() == []
    edited = tmp_path / "classifier.p4"
    edited.write_text((P4_DIR / "include" / "classifier.p4").read_text() + "\n// edited\n")
    real = compiler.p4_sources
    monkeypatch.setattr(compiler, "p4_sources", lambda: [edited if p.name == "classifier.p4" else p for p in real()])
    assert any("sources changed" in r for r in compiler.build_staleness())


def test_committed_p4info_is_p4cs_and_loads():
    info = text_format.Parse(P4INFO_TXTPB.read_text(), p4i.P4Info())
    assert P4INFO_TXTPB.read_text().startswith("# proto-file: p4/config/v1/p4info.proto")  # p4c's banner
    assert {a.preamble.name for a in info.actions} >= {"NoAction", "LuwuIngress.classifier.set_session"}
    stamp = json.loads(compiler.BUILD_INFO.read_text())
    assert stamp["compiler"].startswith("p4c ") and "luwu_v1model.p4" in stamp["command"]


@pytest.mark.bmv2
@needs_p4c
def test_p4c_compiles_without_warnings_and_matches_the_committed_build(tmp_path):
    result = compiler.compile_bmv2(tmp_path)
    assert result.warnings == []
    assert compiler.compare_with_fresh_compile() == []


@pytest.mark.bmv2
@needs_p4test
@pytest.mark.parametrize("tofino", [1, 2])
def test_tna_program_passes_p4test(tofino):
    """Front and mid end against tna.p4; the only warnings are the documented ones (p4/README.md):
    p4test analyses each RegisterAction body on its own, without its caller's header validity."""
    warnings = compiler.check_tna(tofino)
    for w in warnings:
        assert re.match(r"p4/tna/(aggregation_lanes|exponent_max)\.p4\(\d+\): \[--Wwarn=(invalid-header|"
                        r"uninitialized-use)\]", w), w


@pytest.mark.bmv2
@needs_p4test
def test_fixed16_takes_the_32bit_lanes_in_both_builds(tmp_path):
    """FIXED16 packs two int16 values a 32-bit lane (docs/protocol.md 5.2): one block fits the
    64-lane build, and both programs parse, sum and emit FIXED16 packets in the int32 `lanes` header
    (32 + 4 * LANES bytes, as every dtype; count up to 2 * LANES values): no 16-bit header, parser
    state or widening anywhere, so the TNA PHV is the 32-bit program's (p4/README.md)."""
    from luwu.dataplane.integrity import FIXED16_BLOCK, FIXED16_MIN_LANES, check_lanes

    assert -(-(FIXED16_BLOCK + 1) // 2) + check_lanes(protocol.Dtype.FIXED16) == FIXED16_MIN_LANES == 61
    assert DEFAULT_LANES >= FIXED16_MIN_LANES
    assert f"#define LUWU_FIXED16_MIN_LANES {FIXED16_MIN_LANES}" in constants_p4()
    pp = tmp_path / "tna.p4"  # p4test --pp: the program after the preprocessor, as p4test read it
    *cmd, program_path = compiler.tna_check_command(1)
    subprocess.run([*cmd, "--pp", str(pp), program_path], cwd=compiler.REPO_DIR, capture_output=True, check=True,
                   timeout=compiler.COMPILE_TIMEOUT)
    program = pp.read_text()
    headers = re.search(r"struct headers_t \{(.*?)\}", program, re.S)
    assert headers and "luwu_lanes_t" in headers.group(1)
    for text in (program, *(f.read_text() for f in P4_DIR.rglob("*.p4"))):
        assert "lanes16" not in text and "NO_FIXED16" not in text
    assert re.search(r"payload = 4 \* 64;", program), "the aggregation payload is 4 * LANES for every dtype"
    assert "hdr.data.dtype == DTYPE_FIXED16 && count <= 2 * 64" in program  # FIXED16 is still an aggregation dtype
    bmv2 = json.loads((P4_DIR / "build" / "luwu_v1model.json").read_text())
    assert {h["name"] for h in bmv2["headers"]} >= {"lanes"}
    assert not [h for h in bmv2["headers"] if "16" in h["name"] or "lanes16" in h["header_type"]]
