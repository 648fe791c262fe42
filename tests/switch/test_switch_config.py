"""Switch configuration: the example YAML documents every option and loads; bad values and
unknown keys are refused with the key and what to fix."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from luwu.daemons.switch import EXAMPLE
from luwu.dataplane.switch.config import (
    ConfigError,
    DaemonConfig,
    SwitchConfig,
    daemon_config_from_dict,
    load_daemon_config,
)


def test_example_yaml_documents_every_option_and_loads():
    text = EXAMPLE.read_text()
    keys = set(re.findall(r"^#?\s{0,2}(\w+):", text, flags=re.M))
    # shm ports are written under ports: (N: shm), which the example documents
    options = {f.name for f in fields(SwitchConfig)} | {f.name for f in fields(DaemonConfig)} - {"switch", "shm_ports"}
    assert options <= keys, f"undocumented: {options - keys}"
    assert re.search(r"^#?\s+\d+: shm\b", text, flags=re.M), "the example shows no shm port"
    for line in text.splitlines():  # every option line carries a comment
        if re.match(r"^\w+:", line) and not line.startswith(("ports:", "ifaces:", "drop:")):
            assert "#" in line, line
    cfg = load_daemon_config(EXAMPLE)
    assert cfg.switch.lanes == 2048 and cfg.ports[1].peer == ("127.0.0.1", 48001) and cfg.ports[2].peer is None


@pytest.mark.parametrize("raw,needle", [
    ({"lanes": "wide"}, "unknown packet mode"),
    ({"slots": 0}, "slots 0 must be an integer in 1..16777216"),
    ({"udp_port": 70000}, "udp_port"),
    ({"max_datagram": 100}, "a 2048-lane packet is 8224 bytes"),
    ({"lanes": "loopback", "slots": 65536}, "max_register_bytes"),
    ({"poll_interval": 0}, "poll_interval"),
    ({"service_ip": "switch"}, "not an IPv4 address"),
    ({"colour": 1}, "unknown keys colour"),
    ({"ports": {1: {"listen": "127.0.0.1"}}}, "HOST:PORT"),
    ({"ports": {1: {"peer": "127.0.0.1:1"}}}, "needs listen"),
    ({"ports": {1: "127.0.0.1:0"}, "ifaces": {1: "eth0"}}, "both a UDP port and an interface"),
    ({"drop": {"all": {"ingress": 2}}}, "must be in [0, 1]"),
    ({"drop": {"x": {"ingress": 0.1}}}, "not a number"),
    ({"stats_interval": 0}, "stats_interval"),
])
def test_bad_values_are_refused(raw, needle):
    with pytest.raises(ConfigError) as e:
        daemon_config_from_dict(raw)
    assert needle in str(e.value)


def test_yaml_errors(tmp_path: Path):
    p = tmp_path / "c.yaml"
    p.write_text("lanes: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_daemon_config(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_daemon_config(p)
    with pytest.raises(ConfigError, match="cannot read switch config"):
        load_daemon_config(tmp_path / "missing.yaml")


def test_drop_merges_all_and_port():
    cfg = daemon_config_from_dict({"drop": {"all": {"ingress": 0.1, "egress": 0.2}, 3: {"egress": 0.5}}})
    assert cfg.drop_for(3) == {"ingress": 0.1, "egress": 0.5} and cfg.drop_for(1) == {"ingress": 0.1, "egress": 0.2}


def test_packet_modes():
    assert SwitchConfig(lanes="tofino").lanes == 64 and SwitchConfig(lanes=100).lanes == 100
    assert SwitchConfig(lanes="loopback", slots=256).lanes == 16000
