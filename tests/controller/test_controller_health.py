"""Heartbeats: a silent node is marked down and its jobs hear it (WatchJob); it comes back when it reports."""

from __future__ import annotations

import dataclasses

import pytest
from ctl_helpers import ADMIN, job, node, star_switch

from luwu.controller.client import ControllerClient
from luwu.controller.server import BackgroundController
from luwu.proto import controller_pb2 as pb

WATCH_LIMIT = 60.0  # seconds a watch may take before the test gives up (never a timing assertion)


def events_until(client, job_id, kind, token=None, include_past=False):
    seen = []
    for event in client.watch(job_id, include_past=include_past, token=token, timeout=WATCH_LIMIT):
        seen.append(event)
        if event.kind == kind:
            return seen
    pytest.fail(f"no {kind!r} event; got {[e.kind for e in seen]}")


def test_silent_node_goes_down_and_comes_back(controller_config, fake_switch):
    config = dataclasses.replace(controller_config, health_timeout=0.5, health_check_interval=0.1)
    bc = BackgroundController(config)
    admin = ControllerClient(bc.address, ADMIN)
    beats = []
    try:
        _, address = fake_switch()
        admin.register_node(node("n0"))
        admin.register_switch(star_switch("s1", address, 2, ["n0"]))
        switch_beat = admin.heartbeat_loop("switch", "s1", interval=0.1)
        beats.append(switch_beat)
        created, token = admin.create_job(job("a", 2, [10]))
        down = events_until(admin, created.job_id, "node_down", token=token, include_past=True)
        assert [e.kind for e in down][:1] == ["created"] and down[-1].subject == "n0"
        assert admin.job(created.job_id).state == pb.DEGRADED
        assert {n.name: n.health for n in admin.nodes()} == {"n0": "down"}
        # no job goes to a node that is down
        refused = None
        try:
            admin.create_job(job("b", 2, [10]))
        except Exception as exc:  # noqa: BLE001 - the message is what matters
            refused = str(exc)
        assert refused and "usable optimizer node" in refused
        node_beat = admin.heartbeat_loop("node", "n0", interval=0.1, counters=lambda: {"steps": 7})
        beats.append(node_beat)
        up = events_until(admin, created.job_id, "node_up", token=token, include_past=True)
        assert up[-1].subject == "n0"
        assert admin.job(created.job_id).state == pb.PLANNED
        assert bc.server.core.health.counters[("node", "n0")] == {"steps": 7}
        node_beat.stop()
        switch_beat.stop()
        assert switch_beat.sent > 0 and switch_beat.last_error is None
        admin.end_job(created.job_id, token=token)
        ended = list(admin.watch(created.job_id, include_past=True, token=token, timeout=WATCH_LIMIT))
        assert ended[-1].kind == "ended"
    finally:
        for beat in beats:
            beat.stop()
        admin.close()
        bc.stop()


def test_drain_keeps_running_jobs_and_steers_new_ones(controller, fake_switch):
    _, admin = controller
    _, address = fake_switch()
    admin.register_node(node("n0", 5e6))
    admin.register_node(node("n1", 1e6))
    admin.register_switch(star_switch("s1", address, 4, ["n0", "n1"]))
    first, token = admin.create_job(job("a", 2, [10]))
    assert list(first.nodes) == ["n0"]
    drained = admin.drain("n0")
    assert drained.node.drained and list(drained.affected_jobs) == [first.job_id]
    second, _ = admin.create_job(job("b", 2, [10]))
    assert list(second.nodes) == ["n1"]
    kinds = [e.kind for e in admin.watch(first.job_id, include_past=True, token=token, timeout=1.0)]
    assert kinds[:2] == ["created", "drained"]
