"""The topology model: builders wire what they say, round-trip through JSON, refuse double links."""

from __future__ import annotations

import json

import pytest

from luwu.controller import topology as T


def test_star_multi_rack_and_rail_builders():
    star = T.star(3, 2)
    assert star.worker_ports("s1") == [1, 2, 3] and star.node_ports("s1") == [(4, "n0"), (5, "n1")]
    mr = T.multi_rack(racks=3, workers_per_rack=2, nodes=1)
    assert [c for _, c, _ in mr.switch_neighbours("cluster")] == ["tor0", "tor1", "tor2"]
    assert mr.switch_neighbours("tor1") == [(3, "cluster", 2)]
    rail = T.rail_only(servers=4, gpus_per_server=3)
    assert rail.worker_host("rail2", 4).name == "s3g2" and rail.hosts["s3g2"].server == "s3"
    assert rail.node_attachments("n0") == [("rail0", 5), ("rail1", 5), ("rail2", 5)]
    nvlinks = [link for link in rail.links if link.kind == "nvlink"]
    assert len(nvlinks) == 4 * 2  # each server: GPU 0 to GPUs 1, 2
    per_rail = T.rail_only(2, 2, node_mode="node_per_rail")
    assert per_rail.node_attachments("n1") == [("rail1", 3)]


def test_json_round_trip_and_distinct_addresses():
    topo = T.multi_rack(2, 2, 1)
    topo.switches["tor0"].port_udp[1] = "127.0.0.1:5000"
    again = T.Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again.to_dict() == topo.to_dict()
    assert again.switches["tor0"].port_udp == {1: "127.0.0.1:5000"}
    ips = [h.ip for h in topo.hosts.values()]
    macs = [h.mac for h in topo.hosts.values()]
    assert len(set(ips)) == len(ips) and len(set(macs)) == len(macs)


def test_bad_topologies_are_refused():
    topo = T.star(2, 0)
    with pytest.raises(ValueError, match="already linked"):
        topo.add_host(T.HostSpec("x"))
        topo.link("s1", 1, "x")
    with pytest.raises(ValueError, match="neither a switch nor a host"):
        topo.link("s1", 9, "nobody")
    with pytest.raises(ValueError, match="role"):
        topo.add_switch(T.SwitchSpec("s2", role="spine"))
    with pytest.raises(ValueError, match="node_mode"):
        T.rail_only(2, 2, node_mode="both")
