"""`luwu p4`: check, build without p4c, commands, and load against a real P4Runtime server."""

from __future__ import annotations

import json

import pytest

from luwu.cli import main
from luwu.dataplane.p4runtime import device_config_marker
from luwu.p4 import P4_DIR, P4INFO_TXTPB


def test_check_passes_on_the_committed_files(capsys):
    assert main(["p4", "check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_build_without_compilers_names_what_is_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no p4c, no bf-p4c
    assert main(["p4", "build", "--target", "all", "-D", "SLOTS=8192"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3  # one line per missing compiler, naming what to install
    assert "p4c is not on PATH" in err[0] and "p4lang" in err[0]
    assert "p4test is not on PATH" in err[1] and "bf-p4c is not on PATH" in err[2] and "SDE" in err[2]
    assert main(["p4", "commands", "-D", "SLOTS=8192"]) == 0
    assert "p4c --target bmv2 --arch v1model -DSLOTS=8192 --p4runtime-files" in capsys.readouterr().out


def test_commands(capsys):
    assert main(["p4", "commands"]) == 0
    out = capsys.readouterr().out
    assert "luwu_v1model.p4" in out and "luwu_tna.p4" in out and "--device-id 0" in out and "50051" in out


def test_load_reports_missing_build(capsys, tmp_path):
    runtime = tmp_path / "rt.json"
    runtime.write_text(json.dumps({"p4info": "nowhere.txtpb", "bmv2_json": "nowhere.json", "table_entries": []}))
    assert main(["p4", "load", "--runtime", str(runtime)]) == 2
    assert "luwu p4 build" in capsys.readouterr().out


def test_load_programs_a_p4runtime_switch(capsys, tmp_path):
    """`luwu p4 load` pushes the example star to the software switch's P4Runtime server; the
    switch then routes a PULL from rank 2 to the optimizer node as the example says."""
    sw_mod = pytest.importorskip("luwu.dataplane.switch")
    p4rt = pytest.importorskip("luwu.dataplane.switch.p4runtime_server")
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    from luwu.dataplane.integrity import HCHECK_OFFSET, header_check, trailer
    from luwu.dataplane.protocol import DEFAULT_UDP_PORT, MsgType
    from luwu.dataplane.scapy_layer import Luwu

    blob = tmp_path / "device.bin"
    blob.write_bytes(device_config_marker(64, 1024))
    runtime = tmp_path / "star.json"
    raw = json.loads((P4_DIR / "runtime" / "star4.json").read_text())
    raw["p4info"], raw["bmv2_json"] = str(P4INFO_TXTPB), str(blob)
    runtime.write_text(json.dumps(raw))
    sw = sw_mod.SoftwareSwitch(sw_mod.SwitchConfig(lanes=64, slots=1024))
    server = p4rt.serve(sw, "127.0.0.1:0", P4INFO_TXTPB)
    try:
        assert main(["p4", "load", "--addr", server.address, "--runtime", str(runtime)]) == 0
        assert "entities written" in capsys.readouterr().out
        head = bytearray(bytes(Luwu(type=int(MsgType.PULL), session=3, worker=2, count=1)))
        head[HCHECK_OFFSET:HCHECK_OFFSET + 2] = header_check(bytes(head)).to_bytes(2, "big")  # sealed (v2)
        pull = (Ether(src="08:00:00:00:00:03", dst="02:00:00:00:00:fe") / IP(src="10.0.0.3", dst="10.0.0.254")
                / UDP(sport=DEFAULT_UDP_PORT, dport=DEFAULT_UDP_PORT)
                / Raw(bytes(head) + bytes(12) + trailer(bytes(12))))
        out = sw.process_frames([(3, bytes(pull))])
    finally:
        server.stop(None)
    assert [port for port, _ in out] == [5]
    got = Ether(out[0][1])
    assert (got[Ether].dst, got[IP].dst, got[UDP].chksum) == ("08:00:00:00:00:05", "10.0.0.5", 0)


def test_load_presents_the_switch_token(capsys, tmp_path):
    """An authenticated software switch (`luwu switch --p4runtime-token-file`): `luwu p4 load`
    without its token is refused in one line naming the switch; with `--token-file` it programs it."""
    sw_mod = pytest.importorskip("luwu.dataplane.switch")
    p4rt = pytest.importorskip("luwu.dataplane.switch.p4runtime_server")
    from luwu.dataplane.switch.p4runtime_auth import P4RuntimeAuth

    blob = tmp_path / "device.bin"
    blob.write_bytes(device_config_marker(64, 1024))
    runtime = tmp_path / "star.json"
    raw = json.loads((P4_DIR / "runtime" / "star4.json").read_text())
    raw["p4info"], raw["bmv2_json"] = str(P4INFO_TXTPB), str(blob)
    runtime.write_text(json.dumps(raw))
    token = tmp_path / "switch.token"
    token.write_text("the-switch-token\n")
    sw = sw_mod.SoftwareSwitch(sw_mod.SwitchConfig(lanes=64, slots=1024))
    server = p4rt.serve(sw, "127.0.0.1:0", P4INFO_TXTPB, auth=P4RuntimeAuth("the-switch-token"))
    try:
        assert main(["p4", "load", "--addr", server.address, "--runtime", str(runtime)]) == 1
        refused = capsys.readouterr().err.strip().splitlines()
        assert not sw.tables.entries("sessions")
        assert main(["p4", "load", "--addr", server.address, "--runtime", str(runtime), "--token-file", str(token)]) == 0
        assert "entities written" in capsys.readouterr().out
        assert sw.tables.entries("sessions")
    finally:
        server.stop(None)
    assert len(refused) == 1 and f"switch at {server.address}" in refused[0] and "UNAUTHENTICATED" in refused[0], refused
