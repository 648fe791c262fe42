"""The emulated topologies and plans, without building anything: names, addresses, neighbours,
bridges, endpoint wiring, runtime entries, option errors, the `show` command."""

from __future__ import annotations

import ipaddress
import json
import shutil

import pytest
from mininet_helpers import luwu_mininet

from luwu.controller.planner import ip_to_int
from luwu.dataplane.protocol import NODE
from luwu.mininet.emulation import EmulationSpec
from luwu.mininet.job import plan_job
from luwu.mininet.switches import drop_entries
from luwu.mininet.topologies import IFNAME_MAX, TopologyError, TopologyOptions, build_topology, emulate

CASES = [TopologyOptions("star", workers=3), TopologyOptions("multi-rack", workers=4, racks=2),
         TopologyOptions("rail-only", workers=6, gpus=3),
         TopologyOptions("rail-only", workers=4, gpus=2, node_mode="node_per_rail")]


def _spec(opt, run_id="t0"):
    topo = build_topology(opt)
    return topo, emulate(topo, run_id, bw_mbit=100)


@pytest.mark.parametrize("opt", CASES, ids=lambda o: f"{o.name}-{o.node_mode}")
def test_every_port_has_a_unique_interface_and_every_host_reaches_its_switch(opt):
    topo, spec = _spec(opt)
    assert {s.name for s in spec.switches} == set(topo.switches)
    for s in spec.switches:
        linked = {link.port_of(s.name) for link in topo.links_of(s.name)}
        assert set(s.ports) == linked
        assert ipaddress.ip_address(s.service_ip) in ipaddress.ip_network(spec.subnet)
    names = spec.root_interfaces() + [b.ifname for b in spec.bridges]
    assert len(names) == len(set(names)) and all(len(n) <= IFNAME_MAX and n.startswith("lwmt0-") for n in names)
    services = {s.name: s for s in spec.switches}
    host_ips = [i.ip for h in spec.hosts for i in h.interfaces]
    assert len(host_ips) == len(set(host_ips))
    for h in spec.hosts:
        model = topo.hosts[h.name]
        assert h.interfaces[0].ip == model.ip and h.interfaces[0].mac == model.mac
        for iface in h.interfaces:
            if not iface.switch:
                continue
            sw = services[iface.switch]
            assert (sw.service_ip, sw.service_mac, iface.name) in h.neighbors
            assert (f"{sw.service_ip}/32", iface.name) in h.routes
            # the planner addresses the host by the MAC the model now knows for that port
            assert topo.switches[iface.switch].port_mac[iface.port] == iface.mac


def test_rail_only_servers_get_one_nvlink_bridge_with_every_gpu():
    _topo, spec = _spec(TopologyOptions("rail-only", workers=6, gpus=3))
    assert len(spec.bridges) == 2  # two servers of three GPUs
    for b in spec.bridges:
        members = [lk.b for lk in spec.links if lk.a == b.name]
        assert len(members) == 3 and len({spec.host(m).server for m in members}) == 1
        addrs = [spec.host(m).nvlink for m in members]
        assert len({str(ipaddress.ip_interface(f"{a}/24").network) for a in addrs}) == 1
    n0 = spec.host("n0")  # a port per rail, each with its own address
    assert [i.switch for i in n0.interfaces] == ["rail0", "rail1", "rail2"]
    assert len({i.ip for i in n0.interfaces}) == 3


def _walk(spec: EmulationSpec, src: str, dst_ip: str) -> list[str]:
    """Follow the spec's routes hop by hop from host `src` to the host owning `dst_ip`: the nodes passed."""
    by_nvlink = {h.nvlink: h for h in spec.hosts if h.nvlink}
    services = {s.service_ip: s for s in spec.switches}
    here, path = spec.host(src), [src]
    for _ in range(8):  # a loop would never end
        if here.interfaces[0].ip == dst_ip:
            return path
        (via,) = [r[1] for r in here.via_routes if r[0] == f"{dst_ip}/32"]
        if via in by_nvlink:
            here = by_nvlink[via]
            path += ["nvlink", here.name]
        else:
            sw = services[via]
            (port,) = [r[2] for r in sw.ipv4_routes if r[0] == dst_ip and r[1] == 32]
            here = next(h for h in spec.hosts if h.interfaces and (h.interfaces[0].switch, h.interfaces[0].port)
                        == (sw.name, port))
            path += [sw.name, here.name]
    raise AssertionError(f"no route from {src} to {dst_ip}: {path}")


def test_rail_only_routes_cross_rails_through_a_mates_nvlink_only():
    """Every GPU reaches every other GPU's rail address: a mate over NVLink, the same rail through its
    switch, another rail over NVLink to the mate on that rail and then through that rail (the Rail-only
    paper's path), never from one rail to another; every GPU forwards, the node does not."""
    _topo, spec = _spec(TopologyOptions("rail-only", workers=6, gpus=3))
    gpus = [h for h in spec.hosts if h.nvlink]
    assert len(gpus) == 6 and not spec.host("n0").via_routes and "net.ipv4.ip_forward" not in spec.host("n0").sysctls
    for x in gpus:
        assert x.sysctls["net.ipv4.ip_forward"] == "1" and x.tx_checksum_off == ["eth0", "nv0"]
        assert {r[3] for r in x.via_routes} == {x.interfaces[0].ip}  # one source address: replies find it
        for y in gpus:
            if y is x:
                continue
            path = _walk(spec, x.name, y.interfaces[0].ip)
            rail_x, rail_y = x.interfaces[0].switch, y.interfaces[0].switch
            if x.server == y.server:
                assert path == [x.name, "nvlink", y.name]
            elif rail_x == rail_y:
                assert path == [x.name, rail_x, y.name]
            else:
                mate = next(h for h in gpus if h.server == x.server and h.interfaces[0].switch == rail_y)
                assert path == [x.name, "nvlink", mate.name, rail_y, y.name]
    for sw in spec.switches:  # a rail switch routes only to its own GPUs
        assert sorted(r[2] for r in sw.ipv4_routes) == [1, 2]


def test_spec_round_trips_through_json():
    _, spec = _spec(TopologyOptions("rail-only", workers=4, gpus=2))
    again = EmulationSpec.from_dict(json.loads(spec.to_json()))
    assert again == spec


@pytest.mark.parametrize("opt", CASES, ids=lambda o: f"{o.name}-{o.node_mode}")
def test_plan_wires_every_endpoint_to_its_own_address_and_its_switch(opt):
    topo, spec = _spec(opt)
    job = plan_job(topo, spec, layers=[(0, 5000), (1, 777)], seed=3)
    assert sorted(job.worker_host) == list(range(opt.workers))
    for rank, plan in job.worker_plans.items():
        host = spec.host(job.worker_host[rank])
        w = plan.wiring
        assert w.transport == "ip" and w.local[0] == host.interfaces[0].ip
        assert w.switch[0] == spec.switch(host.interfaces[0].switch).service_ip
    for node, plans in job.node_plans.items():
        for plan in plans:  # one engine per attachment: distinct local addresses, the rail's entries point there
            switch = next(s for s in spec.switches if s.service_ip == plan.wiring.switch[0])
            iface = spec.host(node).iface_to(switch.name)
            assert plan.wiring.local[0] == iface.ip
            mine = {s.session for s in plan.sessions}
            eps = [e for e in job.runtime[switch.name]["table_entries"]
                   if e["table"] == "endpoints" and e["match"]["dst"] == NODE and e["match"]["session"] in mine]
            assert eps and all(e["action_params"]["dst_ip"] == ip_to_int(iface.ip) for e in eps)
        assert len({p.wiring.local for p in plans}) == len(plans)


def test_drop_entries_program_the_p4_drop_simulator_on_every_port():
    entries = drop_entries([3, 1, 2], 0.25)
    assert [e["match"]["port"] for e in entries] == [1, 2, 3]
    assert all(e["table"].endswith("ingress_drop_sim") and e["action_params"]["threshold"] == 1 << 30
               for e in entries)
    assert drop_entries([1, 2], 0.0) == []


@pytest.mark.parametrize("opt, words", [
    (TopologyOptions("multi-rack", workers=5, racks=2), "split evenly"),
    (TopologyOptions("rail-only", workers=5, gpus=2), "multiple of --gpus"),
    (TopologyOptions("star", workers=33), "at most 32"),
    (TopologyOptions("mesh"), "must be one of"),
])
def test_options_that_make_no_topology_say_what_to_change(opt, words):
    with pytest.raises(TopologyError, match=words):
        build_topology(opt)


def test_show_prints_the_spec_and_the_plan_without_root():
    r = luwu_mininet("show", "--topo", "multi-rack", "--workers", "4", "--push-pull", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert sorted(s["name"] for s in out["spec"]["switches"]) == ["cluster", "tor0", "tor1"]
    assert set(out["runtime"]) == {"cluster", "tor0", "tor1"}
    assert any("root cluster" in line for line in out["explanation"])


@pytest.mark.parametrize("args, words", [
    (["--topo", "multi-rack", "--workers", "3"], "split evenly"),
    (["--size", "5"], "multiple of 4"),
    (["--drop", "1.5"], "probability"),
    (["--switch", "bmv2", "--packet-mode", "jumbo"], "64-lane"),
    (["--link", "s9:1=bw=10"], "no switch 's9'"),
    (["--link", "s1:7=drop=0.1"], "has ports"),
    (["--link", "s1:1=drop=2"], "probability"),
])
def test_bad_options_exit_2_with_a_message(args, words):
    r = luwu_mininet("show", *args, timeout=120)
    assert r.returncode == 2 and words in r.stderr, (r.returncode, r.stderr)


@pytest.mark.skipif(shutil.which("simple_switch_grpc") is not None, reason="BMv2 is installed here")
def test_bmv2_without_simple_switch_grpc_is_a_clear_error():
    r = luwu_mininet("run", "--switch", "bmv2", "--backend", "netns", timeout=120)
    assert r.returncode == 2 and "simple_switch_grpc" in r.stderr and "--switch software" in r.stderr, r.stderr


@pytest.mark.parametrize("args, timeout", [([], 120.0), (["--switch", "bmv2"], 600.0),
                                           (["--switch", "bmv2", "--timeout", "50"], 50.0)])
def test_the_workload_time_limit_scales_with_the_switch(args, timeout):
    """BMv2 forwards about 100x slower than the software switch: its default limit is 5x; an
    explicit --timeout is taken as given."""
    from luwu.dataplane.process.usage import OneLineParser
    from luwu.mininet import runner

    parser = OneLineParser(prog="luwu mininet")
    runner.add_arguments(parser)
    _, run_opts = runner._options(parser.parse_args(["run", *args]))
    assert run_opts.timeout == timeout
