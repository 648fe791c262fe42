"""How a model is cut into units and which pulls a worker issues: the default cut of a GPT, explicit
units, refusals with advice (tied weights, parameters outside every unit, non-fp32), and the pull
schedule's determinism and prefetching (pure logic, no network)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from luwu.demo.model import GPTConfig, build
from luwu.worker.model_in_network.network import JobNetwork, balance
from luwu.worker.model_in_network.optimizers import AdamW, as_optimizer_spec
from luwu.worker.model_in_network.schedule import BACKWARD, FORWARD, PullSchedule, Ticket
from luwu.worker.model_in_network.units import UnitError, split_units

CFG = GPTConfig(vocab=11, d_model=8, n_layers=3, n_heads=2, context=4)


def test_a_gpt_is_cut_into_embeddings_blocks_norm_and_head():
    model = build(CFG, 0)
    units = split_units(model)
    assert [u.name for u in units] == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert [u.index for u in units] == list(range(6))
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())
    spec = units[1].layer_spec()
    assert spec.layer_id == 1 and spec.shapes["attn.qkv.weight"] == (24, 8)
    assert "ln1.weight" in spec.no_decay and "attn.qkv.weight" not in spec.no_decay  # no_decay="auto"


def test_explicit_units_by_module_or_path():
    model = build(CFG, 0)
    units = split_units(model, ["embed", model.blocks, model.norm, "head"])
    assert [u.name for u in units] == ["embed", "blocks", "norm", "head"]
    with pytest.raises(UnitError, match="outside every unit: blocks.0"):
        split_units(model, ["embed", "norm", "head"])
    with pytest.raises(UnitError, match="in two units"):
        split_units(model, ["embed", "blocks", "blocks.0", "norm", "head"])
    with pytest.raises(UnitError, match="no submodule 'nope'"):
        split_units(model, ["nope"])


def test_a_tied_weight_belongs_to_its_first_unit_and_the_other_module_is_its_site():
    model = build(CFG, 0)
    model.head = nn.Linear(CFG.d_model, CFG.vocab, bias=False)
    model.head.weight = model.embed.tokens.weight
    units = split_units(model)
    # the head holds nothing of its own: no unit, a site of the embeddings' unit
    assert [u.name for u in units] == ["embed"] + [f"blocks.{i}" for i in range(CFG.n_layers)] + ["norm"]
    assert [(n, m) for n, m in units[0].sites] == [("head", model.head)]
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())  # the tied tensor once
    assert all(not u.sites for u in units[1:])


def test_parameters_held_by_the_model_itself_and_other_dtypes_are_refused():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.lin = nn.Linear(3, 3)

    with pytest.raises(UnitError, match="holds parameters directly.*scale"):
        split_units(Bare())
    assert [u.name for u in split_units(Bare(), [""])] == [""]  # the model itself as one unit
    with pytest.raises(UnitError, match="float64"):
        split_units(nn.Sequential(nn.Linear(2, 2).double()))


def test_frozen_parameters_stay_out_of_the_units():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    model[1].weight.requires_grad_(False)
    units = split_units(model)
    assert [[n for n, _ in u.params] for u in units] == [["weight", "bias"], ["bias"]]


def test_a_torch_optimizer_is_refused_and_specs_follow_torch_defaults():
    with pytest.raises(TypeError, match="luwu.AdamW"):
        as_optimizer_spec(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    spec = AdamW(lr=3e-4)
    assert (spec.name, spec.lr, spec.weight_decay, spec.betas) == ("adamw", 3e-4, 1e-2, (0.9, 0.999))
    import luwu

    assert luwu.AdamW is AdamW and luwu.SGD(lr=0.1, momentum=0.9).state_names == ("master", "momentum_buffer")


def test_units_are_balanced_over_nodes_deterministically():
    sizes = {0: 10, 1: 100, 2: 100, 3: 100, 4: 5, 5: 50}
    a = balance(sizes, [0, 1])
    assert a == balance(dict(reversed(list(sizes.items()))), [0, 1])  # order of the input does not matter
    load = [sum(n for u, n in sizes.items() if a[u] == k) for k in (0, 1)]
    assert abs(load[0] - load[1]) <= 50


def test_controller_shard_maps_become_slices_and_routes_refuse_what_cannot_be_honoured():
    from luwu.dataplane.session import EndpointPlan, SessionSpec, Wiring
    from luwu.worker.model_in_network.network import Slice
    from luwu.worker.model_in_network.routes import PlanError, plan_routes

    units = split_units(nn.Sequential(nn.Linear(3, 3), nn.Linear(2, 3, bias=False)))  # 12 and 6 elements
    plan = EndpointPlan(Wiring(1), [SessionSpec(5, "node", 1, 0, 64, 2, 64, node_rank=0),
                                    SessionSpec(6, "node", 1, 64, 64, 2, 64, node_rank=1)])
    info = {"job_id": "j-1", "shards": [{"layer_id": 0, "offset": 0, "numel": 12, "node_rank": 1, "session": 6},
                                        {"layer_id": 1, "offset": 0, "numel": 4, "node_rank": 0, "session": 5},
                                        {"layer_id": 1, "offset": 4, "numel": 2, "node_rank": 1, "session": 6}]}
    net = JobNetwork.from_controller(plan, info, ["unix:/a", "unix:/b"])
    assert net.slices == {0: [Slice(0, 12, 1, 6)], 1: [Slice(0, 4, 0, 5), Slice(4, 2, 1, 6)]}
    assert net.node_sessions == {0: 5, 1: 6} and net.world_size == 2 and net.local_size == 1
    assert JobNetwork.from_json(net.to_json()) == net
    routes = plan_routes(units, net)  # a sliced layer goes per slice to each slice's node
    assert [(p.offset, p.numel, p.session) for p in routes[1].pieces] == [(0, 4, 5), (4, 2, 6)]
    assert routes[0].whole and not routes[1].whole

    def refused(shards, match):
        with pytest.raises(PlanError, match=match):
            plan_routes(units, JobNetwork.from_controller(plan, dict(info, shards=shards), []))

    whole0 = info["shards"][:1]
    refused(whole0 + [{"layer_id": 1, "offset": 0, "numel": 4, "node_rank": 0}], "do not cover")  # a gap
    refused(whole0 + [{"layer_id": 1, "offset": 0, "numel": 4, "node_rank": 0},
                      {"layer_id": 1, "offset": 3, "numel": 3, "node_rank": 1}], "do not tile")  # an overlap
    refused(whole0 + [{"layer_id": 1, "offset": 0, "numel": 4, "node_rank": 0},
                      {"layer_id": 1, "offset": 4, "numel": 2, "node_rank": 0}], "two slices of layer 1")
    refused(whole0 + [{"layer_id": 1, "offset": 0, "numel": 6, "node_rank": 2}], "does not reach")
    refused(whole0, "no slice of layer 1")
    # rail-only: rank 1 of 4 in rail group [1, 3] owns shard 1 of every layer (the planner's cut)
    rail = dict(info, num_workers=4, group_ranks=[1, 3], group=1,
                shards=[{"layer_id": 0, "offset": 6, "numel": 6, "node_rank": 1, "session": 6, "group": 1},
                        {"layer_id": 1, "offset": 3, "numel": 3, "node_rank": 1, "session": 6, "group": 1},
                        {"layer_id": 1, "offset": 0, "numel": 3, "node_rank": 0, "session": 5, "group": 0}])
    net = JobNetwork.from_controller(plan, rail, [])
    assert net.local_size == 2 and net.world_size == 4 and sorted(net.slices) == [0, 1]  # rail 0's slice left out
    assert {u: (r.lo, r.hi) for u, r in plan_routes(units, net).items()} == {0: (6, 12), 1: (3, 6)}
    with pytest.raises(PlanError, match="numbered server by server"):
        plan_routes(units, JobNetwork.from_controller(plan, dict(rail, group_ranks=[1, 2]), []))
    rail["shards"][0] = dict(rail["shards"][0], offset=5, numel=7)  # not the rail cut: rank 1 reduces [6, 12)
    with pytest.raises(PlanError, match="do not tile"):
        plan_routes(units, JobNetwork.from_controller(plan, rail, []))


def _schedule(order, keep, prefetch):
    issued = []

    def issue(unit, phase, version):
        issued.append((unit, phase, version))
        return Ticket(unit, phase, version)

    return PullSchedule(order, keep, prefetch, issue), issued


def _one_step(s, version, saves=None):
    """Forward over all units, then backward over the non-kept ones that saved parameters."""
    s.begin_pass(grad=True)
    for u in s.order:
        s.take(u, FORWARD, version, resident=False)
        s.prefetch_after(u, FORWARD, version)
        if saves is not None:
            s.saves_params[u] = saves[u]
    for u in reversed(s.order):
        if u in s.keep or not s.saves_params[u]:
            continue
        s.take(u, BACKWARD, version, resident=False)
        s.prefetch_after(u, BACKWARD, version)
    s.drain()


def test_the_pull_schedule_prefetches_along_forward_then_backward():
    s, issued = _schedule([0, 1, 2, 3], keep={3}, prefetch=1)
    s.prefetch_next_pass(0)
    _one_step(s, 0, saves={0: False, 1: True, 2: True, 3: True})
    f, b = FORWARD, BACKWARD
    assert issued == [(0, f, 0), (1, f, 0), (2, f, 0), (3, f, 0), (2, b, 0), (1, b, 0)]
    issued.clear()
    s.prefetch_next_pass(1)
    _one_step(s, 1)
    assert issued == [(0, f, 1), (1, f, 1), (2, f, 1), (3, f, 1), (2, b, 1), (1, b, 1)]


def test_deeper_prefetch_issues_the_same_pulls_earlier():
    s1, a = _schedule([0, 1, 2, 3, 4], keep={4}, prefetch=1)
    s3, b = _schedule([0, 1, 2, 3, 4], keep={4}, prefetch=3)
    for s in (s1, s3):
        s.prefetch_next_pass(0)
        _one_step(s, 0)
    assert sorted(a) == sorted(b) and a == b  # same pulls, same order: only their timing differs
    assert s3.issued_count == s1.issued_count == 9


def test_gradient_slots_are_each_parameters_place_in_the_staging_buffer():
    """The gradient hook copies each parameter's gradient into its slot (inflight.grad_slots):
    a view shaped as the parameter over exactly its offsets in the unit's flat staging buffer,
    made once per buffer and unit; a copy through it lands where the push reads it, bit for bit."""
    import numpy as np

    from luwu.worker.engine_link import Staging
    from luwu.worker.model_in_network.inflight import grad_slots

    unit = split_units(build(CFG, 0))[1]
    st = Staging(np.full(unit.numel + 5, -1.0, dtype=np.float32))
    st.tensor = torch.from_numpy(st.array)
    slots = grad_slots(st, unit)
    assert grad_slots(st, unit) is slots  # kept on the buffer
    grads = [torch.randn(p.shape) for _, p in unit.params]
    for slot, g in zip(slots, grads):
        slot.copy_(g)
    want = torch.cat([g.reshape(-1) for g in grads])
    assert torch.equal(st.tensor[:unit.numel].view(torch.int32), want.view(torch.int32))
    assert [(s.data_ptr() - st.tensor.data_ptr()) // 4 for s in slots] == [lo for lo, _ in unit.offsets]
    assert bool((st.tensor[unit.numel:] == -1.0).all())  # nothing past the unit


def test_the_default_cut_descends_into_a_body_that_wraps_a_stack_of_blocks():
    class Body(nn.Module):  # no parameters of its own, a ModuleList below: its blocks become units
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                             enable_nested_tensor=False)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.body = Body()
            self.mlp = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # a Sequential is a container: cut
            self.head = nn.Linear(8, 10)

    units = split_units(Model())
    assert [u.name for u in units] == ["embed", "body.enc.layers.0", "body.enc.layers.1", "mlp.0", "mlp.1", "head"]
    # a block holding a Sequential (the demo GPT's MLP) stays one unit
    assert [u.name for u in split_units(build(CFG, 0))][1] == "blocks.0"
