"""The tables API and the runtime JSON loader: what is accepted, and that every refusal is a
TableError naming the table, the field and what is allowed, and changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from switch_setup import LANES, SESSIONS, SLOTS, agg_packet, runtime

from luwu.dataplane.protocol import MAX_SESSIONS
from luwu.dataplane.switch import SCHEMA, SoftwareSwitch, SwitchConfig, TableError

SESSION = {"pool_base": 0, "pool_size": 4, "num_workers": 2, "worker_mask": 3, "epoch": 1, "mcast_grp": 1,
           "next_step": 0, "up_port": 4, "up_worker": 0}


@pytest.fixture
def sw():
    return SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))


def refused(sw, *needles, call):
    before = {t: sw.tables.entries(t) for t in SCHEMA}
    with pytest.raises(TableError) as e:
        call()
    for n in needles:
        assert n in str(e.value), f"{n!r} not in {e.value}"
    assert {t: sw.tables.entries(t) for t in SCHEMA} == before
    return str(e.value)


def test_insert_lookup_entries_modify_delete(sw):
    t = sw.tables
    t.insert("LuwuIngress.classifier.sessions", {"hdr.luwu.session": 5}, "LuwuIngress.classifier.set_session", SESSION)
    assert t.entries("sessions") == [{"match": {"session": 5}, "action": "set_session", "params": SESSION}]
    t.insert("sessions", {"session": 5}, "set_session", {**SESSION, "epoch": 2}, modify=True)
    assert t.lookup("sessions", {"session": 5})["params"]["epoch"] == 2
    t.insert("endpoints", {"session": 5, "dst": 0xFFFF}, "set_endpoint",
             {"dst_mac": "aa:bb:cc:dd:ee:ff", "dst_ip": "10.0.0.1", "dst_udp": 19541})
    assert t.entries("endpoints")[0]["params"] == {"dst_mac": 0xAABBCCDDEEFF, "dst_ip": 0x0A000001, "dst_udp": 19541}
    t.insert("ipv4_lpm", {"dst_addr": ["10.0.0.0", 8]}, "ipv4_forward", {"port": 3, "dst_mac": b"\x02\x00\x00\x00\x00\x01"})
    assert t.entries("ipv4_lpm")[0]["match"] == {"dst_addr": (0x0A000000, 8)}
    t.insert("ingress_drop_sim", {"standard_metadata.ingress_port": 2}, "set_ingress_drop_rate", {"threshold": "0x10"})
    assert t.entries("ingress_drop_sim")[0] == {"match": {"port": 2}, "action": "set_ingress_drop_rate",
                                                 "params": {"threshold": 16}}
    t.delete("sessions", {"session": 5})
    assert t.entries("sessions") == []


def test_unknown_names_and_shapes(sw):
    t = sw.tables
    refused(sw, "unknown table 'flows'", "sessions", call=lambda: t.insert("flows", {"x": 1}, "a", {}))
    refused(sw, "unknown action 'set_worker'", "set_session",
            call=lambda: t.insert("sessions", {"session": 1}, "set_worker", {}))
    refused(sw, "unknown match field 'port'", "session:16 exact",
            call=lambda: t.insert("sessions", {"port": 1}, "set_session", SESSION))
    refused(sw, "missing worker", call=lambda: t.insert("workers", {"session": 1}, "set_worker",
                                                        {"worker_bit": 1, "port": 1}))
    refused(sw, "missing epoch", "unexpected colour",
            call=lambda: t.insert("sessions", {"session": 1}, "set_session",
                                  {**{k: v for k, v in SESSION.items() if k != "epoch"}, "colour": 1}))
    refused(sw, "cannot read dst_ip", "dotted IPv4",
            call=lambda: t.insert("endpoints", {"session": 1, "dst": 0}, "set_endpoint",
                                  {"dst_mac": 1, "dst_ip": "ten", "dst_udp": 1}))


@pytest.mark.parametrize("field,value,width", [("session", 70000, 16), ("up_port", 512, 9), ("num_workers", 256, 8),
                                               ("epoch", 2**32, 32), ("pool_base", -1, 32)])
def test_values_must_fit_their_bit_width(sw, field, value, width):
    if field == "session":
        msg = refused(sw, "session", "16 bits", call=lambda: sw.tables.insert("sessions", {"session": value},
                                                                               "set_session", SESSION))
    else:
        msg = refused(sw, field, f"{width} bits", call=lambda: sw.tables.insert(
            "sessions", {"session": 1}, "set_session", {**SESSION, field: value}))
    assert f"0..{2**width - 1}" in msg


def test_duplicates_and_missing_entries(sw):
    t = sw.tables
    t.insert("workers", {"session": 1, "worker": 0}, "set_worker", {"worker_bit": 1, "port": 1})
    refused(sw, "already exists", "modify=True", call=lambda: t.insert("workers", {"session": 1, "worker": 0},
                                                                      "set_worker", {"worker_bit": 2, "port": 1}))
    refused(sw, "no entry", "to modify", call=lambda: t.insert("workers", {"session": 1, "worker": 1}, "set_worker",
                                                               {"worker_bit": 2, "port": 1}, modify=True))
    refused(sw, "no entry", "to delete", call=lambda: t.delete("workers", {"session": 2, "worker": 0}))


@pytest.mark.parametrize("params,needle", [
    ({"pool_size": 48}, "power of two"),
    ({"pool_size": 24}, "or 0 for a session without slots"),
    ({"pool_base": SLOTS - 2, "pool_size": 4}, f"inside [0, {SLOTS})"),
    ({"num_workers": 0, "worker_mask": 0}, "1..32"),
    ({"num_workers": 33, "worker_mask": 2**32 - 1}, "1..32"),
    ({"worker_mask": 7}, "OR of the session's worker_bits"),
    ({"next_step": 2}, "UPSTREAM"),
])
def test_session_semantics(sw, params, needle):
    refused(sw, needle, call=lambda: sw.tables.insert("sessions", {"session": 1}, "set_session",
                                                      {**SESSION, **params}))


def test_session_ids_and_worker_semantics(sw):
    t = sw.tables
    refused(sw, "out of range", f"1..{MAX_SESSIONS - 1}", call=lambda: t.insert("sessions", {"session": 0},
                                                                               "set_session", SESSION))
    refused(sw, f"1..{MAX_SESSIONS - 1}", call=lambda: t.insert("sessions", {"session": MAX_SESSIONS},
                                                              "set_session", SESSION))
    refused(sw, "exactly one bit", call=lambda: t.insert("workers", {"session": 1, "worker": 0}, "set_worker",
                                                          {"worker_bit": 3, "port": 1}))
    refused(sw, "node/parent", call=lambda: t.insert("workers", {"session": 1, "worker": 0xFFFF}, "set_worker",
                                                      {"worker_bit": 1, "port": 1}))


def test_lpm_and_defaults(sw):
    t = sw.tables
    refused(sw, "bits set outside the prefix", "10.0.0.0/8",
            call=lambda: t.insert("ipv4_lpm", {"dst_addr": ("10.1.2.3", 8)}, "drop", {}))
    refused(sw, "prefix length 33", call=lambda: t.insert("ipv4_lpm", {"dst_addr": ("10.0.0.0", 33)}, "drop", {}))
    t.set_default("ipv4_lpm", "LuwuIngress.forwarder.ipv4_forward", {"port": 1, "dst_mac": 2})
    assert t.default("ipv4_lpm") == ("ipv4_forward", {"port": 1, "dst_mac": 2})
    t.set_default("sessions", "NoAction")
    refused(sw, "default action", call=lambda: t.set_default("sessions", "set_session", SESSION))


def test_multicast_groups(sw):
    t = sw.tables
    t.set_multicast_group(3, [(1, 0), (2, 1)])
    assert t.multicast_groups() == {3: [(1, 0), (2, 1)]}
    t.set_multicast_group(3, [(5, 7)])  # replace
    assert t.multicast_groups() == {3: [(5, 7)]}
    with pytest.raises(TableError, match="reserved"):
        t.set_multicast_group(0, [])
    with pytest.raises(TableError, match="duplicate replica"):
        t.set_multicast_group(4, [(1, 0), (1, 0)])
    with pytest.raises(TableError, match="egress_port value 600 does not fit in 9 bits"):
        t.set_multicast_group(4, [(600, 0)])
    with pytest.raises(TableError, match="does not exist"):
        t.delete_multicast_group(9)
    t.delete_multicast_group(3)
    assert t.multicast_groups() == {}


def test_clear_removes_everything_and_resets_registers(sw):
    sw.load_runtime(runtime())
    sw.process_datagrams([(1, agg_packet(1, 0, 0, [5] * LANES))])
    assert sw.registers.slot_owner.any() and sw.registers.lanes.any()
    sw.tables.clear()
    assert all(sw.tables.entries(t) == [] for t in SCHEMA) and sw.tables.multicast_groups() == {}
    assert not sw.registers.slot_owner.any() and not sw.registers.lanes.any()


def test_runtime_json_loads_from_file_and_names_bad_entry(sw, tmp_path):
    rt = runtime()
    path = tmp_path / "rt.json"
    path.write_text(json.dumps(rt))
    got = sw.load_runtime(str(path))
    assert got == {"table_entries": len(rt["table_entries"]), "multicast_groups": len(rt["multicast_group_entries"])}
    assert len(sw.tables.entries("sessions")) == len(SESSIONS)
    other = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS))
    bad = json.loads(json.dumps(rt))
    bad["table_entries"][2]["action_params"]["port"] = 999  # a workers entry
    with pytest.raises(TableError, match=r"table_entries\[2\].*port value 999 does not fit in 9 bits"):
        other.load_runtime(bad)
    assert all(other.tables.entries(t) == [] for t in SCHEMA)  # one transaction: nothing was applied
    bad = {"table_entries": [], "multicast_group_entries": [{"multicast_group_id": 2, "replicas": [{"port": 1}]}]}
    with pytest.raises(TableError, match=r"multicast_group_entries\[0\]: replicas\[0\] needs egress_port"):
        other.load_runtime(bad)
    with pytest.raises(TableError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        other.load_runtime(str(tmp_path / "bad.json"))
    with pytest.raises(TableError, match="unknown top-level keys"):
        other.load_runtime({"tables": []})
    with pytest.raises(TableError, match="cannot read runtime file"):
        other.load_runtime(str(tmp_path / "missing.json"))
    # the same file again conflicts with what is loaded, unless replacing
    with pytest.raises(TableError, match="already exists"):
        sw.load_runtime(rt)
    sw.load_runtime(rt, replace=True)
    assert len(sw.tables.entries("sessions")) == len(SESSIONS)


def test_runtime_default_action_entries(sw):
    sw.load_runtime({"table_entries": [{"table": "MyIngress.ipv4_lpm", "default_action": True,
                                        "action_name": "MyIngress.drop", "action_params": {}}]})
    assert sw.tables.default("ipv4_lpm") == ("drop", {})


def test_committed_p4_runtime_example_loads():
    import pathlib

    import luwu.p4
    from luwu.dataplane.p4runtime import entries  # noqa: F401  (the P4 engineer's builders exist)

    for path in sorted((pathlib.Path(luwu.p4.__file__).parent / "runtime").glob("*.json")):
        data = json.loads(path.read_text())
        sw = SoftwareSwitch(SwitchConfig(lanes=64, slots=4096))
        sw.load_runtime(data)
        assert sw.tables.entries("sessions")


def test_set_drop_sim_programs_the_p4_tables(sw):
    sw.set_drop_sim(3, ingress=0.25, egress=1.0)
    assert sw.tables.entries("ingress_drop_sim")[0]["params"]["threshold"] == 2**30
    assert sw.tables.entries("egress_drop_sim")[0]["params"]["threshold"] == 2**32 - 1
    sw.set_drop_sim(3)
    assert sw.tables.entries("ingress_drop_sim") == [] and sw.tables.entries("egress_drop_sim") == []
    with pytest.raises(TableError, match="must be in"):
        sw.set_drop_sim(3, ingress=1.5)
    with pytest.raises(TableError, match="out of range"):
        sw.set_drop_sim(600)
    assert np.all(sw.tables.compiled().ingress_threshold < 0)
