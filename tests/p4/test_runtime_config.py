"""Runtime JSON: the example validates and round-trips; bad entries get errors that say what to fix."""

from __future__ import annotations

import copy
import json

import pytest

from luwu.dataplane.p4runtime.entries import (
    RuntimeConfig,
    RuntimeConfigError,
    drop_rate_entry,
    endpoint_entry,
    route_entry,
    session_entry,
    worker_entry,
)
from luwu.p4 import P4_DIR
from luwu.p4.runtime_examples import STAR_FILE, star_runtime

STAR = P4_DIR / "runtime" / STAR_FILE


def test_example_is_valid_and_generated():
    cfg = RuntimeConfig.load(STAR)
    cfg.validate()
    assert STAR.read_text() == star_runtime().dumps()
    tables = [e.table.rsplit(".", 1)[-1] for e in cfg.table_entries]
    assert tables.count("sessions") == 3 and tables.count("workers") == 12 and tables.count("endpoints") == 13
    assert [len(g.replicas) for g in cfg.multicast_group_entries] == [4]


def test_round_trip(tmp_path):
    cfg = star_runtime()
    cfg.table_entries.append(drop_rate_entry("egress", 3, threshold=1 << 31))
    path = tmp_path / "rt.json"
    cfg.dump(path)
    again = RuntimeConfig.load(path)
    assert again.to_dict() == cfg.to_dict()
    again.validate()


def test_default_action_entry_validates():
    cfg = RuntimeConfig(table_entries=[
        route_entry("10.0.0.0", 8, port=1, dst_mac="08:00:00:00:00:01"),
    ])
    cfg.table_entries[0].default_action = True
    cfg.table_entries[0].match = {}
    cfg.validate()


def _broken(mutate) -> dict:
    raw = star_runtime().to_dict()
    mutate(raw)
    return raw


def _session(raw) -> dict:
    return raw["table_entries"][0]


@pytest.mark.parametrize("mutate, message", [
    (lambda r: _session(r).update(table="LuwuIngress.classifier.sesions"), "unknown table"),
    (lambda r: _session(r).update(action_name="set_worker"), "not an action of this table"),
    (lambda r: _session(r).update(action_name="NoAction"), "only be the table's default action"),
    (lambda r: _session(r)["match"].update(sesion=1), "unknown match field"),
    (lambda r: _session(r).update(match={}), "needs field 'session'"),
    (lambda r: _session(r)["action_params"].pop("epoch"), "needs parameter 'epoch'"),
    (lambda r: _session(r)["action_params"].update(colour=1), "no parameter"),
    (lambda r: _session(r)["action_params"].update(up_port=512), "does not fit in 9 bits"),
    (lambda r: _session(r)["action_params"].update(epoch=-1), "does not fit in 32 bits"),
    (lambda r: _session(r)["action_params"].update(mcast_grp=9), "no multicast_group_entries defines"),
    (lambda r: r["table_entries"].append(copy.deepcopy(_session(r))), "duplicate match"),
    (lambda r: r["table_entries"][-1]["match"].update(dst_addr="10.0.0.5"), "write \\[value, prefix_length\\]"),
    (lambda r: r["table_entries"][-1]["match"].update(dst_addr=["10.0.0.5", 24]), "bits set beyond the prefix"),
    (lambda r: r["table_entries"][-1]["action_params"].update(dst_mac="08:00:00"), "cannot read"),
    (lambda r: r["multicast_group_entries"][0].update(multicast_group_id=0), "0 means no multicast"),
    (lambda r: r["multicast_group_entries"].append(copy.deepcopy(r["multicast_group_entries"][0])), "defined twice"),
    (lambda r: r["multicast_group_entries"][0]["replicas"].append({"egress_port": 600, "instance": 0}),
     "egress_port"),
])
def test_errors_say_what_to_fix(mutate, message):
    with pytest.raises(RuntimeConfigError, match=message):
        RuntimeConfig.from_dict(_broken(mutate)).validate()


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RuntimeConfigError, match="not valid JSON"):
        RuntimeConfig.load(bad)
    bad.write_text(json.dumps({"table_entries": [], "tables": []}))
    with pytest.raises(RuntimeConfigError, match="unknown runtime config keys"):
        RuntimeConfig.load(bad)


def test_builders_check_their_arguments():
    with pytest.raises(RuntimeConfigError, match="power of two"):
        session_entry(1, pool_base=0, pool_size=12, num_workers=2, worker_mask=3, epoch=1, mcast_grp=1,
                      next_step=0, up_port=0, up_worker=0)
    with pytest.raises(RuntimeConfigError, match="out of range"):
        session_entry(0, pool_base=0, pool_size=16, num_workers=2, worker_mask=3, epoch=1, mcast_grp=1,
                      next_step=0, up_port=0, up_worker=0)
    with pytest.raises(RuntimeConfigError, match="'ingress' or 'egress'"):
        drop_rate_entry("sideways", 1, threshold=0)
    w = worker_entry(3, 2, worker_bit=4, port=3)
    e = endpoint_entry(3, 0xFFFF, dst_mac="08:00:00:00:00:05", dst_ip="10.0.0.5", dst_udp=19541)
    assert (w.table, w.match) == ("workers", {"session": 3, "worker": 2})  # P4Info aliases, as docs/protocol.md 6.1
    assert (e.table, e.match) == ("endpoints", {"session": 3, "dst": 0xFFFF})
    RuntimeConfig(table_entries=[w, e]).validate()  # and the P4Info knows them
