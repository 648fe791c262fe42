"""The engine's scalar fast paths against the vectorised reference code they stand in for.

A worker's engine reads a lone RESULT (a push's exponent agreement: `CollectiveSession._one_result`)
and a pull's in-order PARAM batch (`WorkerNodeSession._params_in_order`) in Python scalars; the
numpy code they skip is the reference. The same pushes and pulls, one at a time (so that each
RESULT arrives alone, as in training), run once with the fast paths and once with them off must
give bit-identical parameters, with and without loss, and the fast paths must actually have run.
"""

from __future__ import annotations

import numpy as np
import pytest
from node_star import node_star

from luwu.dataplane.engine.collective import CollectiveSession
from luwu.dataplane.engine.node_worker import WorkerNodeSession
from luwu.dataplane.loopback import StarPlan
from luwu.mininet.paramstore import SgdParamStore

LOSSY = {"ingress": 0.05, "egress": 0.05, "duplicate": 0.02, "reorder": 0.02}


def _train(fast: bool, drop, monkeypatch) -> tuple[dict[int, list[np.ndarray]], dict[str, int]]:
    """Three rounds of push-then-pull of three layers by two workers, each push and pull waited
    for before the next; returns every pulled array and how often each fast path took a batch."""
    taken = {"_one_result": 0, "_params_in_order": 0}
    for cls, name in ((CollectiveSession, "_one_result"), (WorkerNodeSession, "_params_in_order")):
        real = getattr(cls, name)

        def counted(self, *a, _real=real, _name=name):
            ok = fast and _real(self, *a)
            taken[_name] += bool(ok)
            return ok

        monkeypatch.setattr(cls, name, counted)
    rng = np.random.default_rng(3)
    layers = {4: rng.standard_normal(5000).astype(np.float32), 5: rng.standard_normal(70).astype(np.float32),
              6: rng.standard_normal(1).astype(np.float32)}
    workers = 2
    plan = StarPlan(workers=workers, nodes=1, mode="tofino", node_pool=32, param_window=64)
    server = SgdParamStore(layers, lr=0.5)
    sid = plan.node_session(0)
    pulled: dict[int, list[np.ndarray]] = {t: [] for t in layers}
    with node_star(plan, server, drop=drop, seed=11) as star:
        engines = star.engines
        for version in range(3):
            for t, p in layers.items():
                outs = [np.empty(p.size, np.float32) for _ in engines]
                for h in [e.pull(sid, t, version, out=o) for e, o in zip(engines, outs)]:
                    h.wait(60)
                pulled[t] += outs
            for t, p in layers.items():
                grads = [(rng.standard_normal(p.size) * 0.01).astype(np.float32) for _ in engines]
                for h in [e.push(sid, t, g) for e, g in zip(engines, grads)]:
                    h.wait(60)
    return pulled, taken


@pytest.mark.parametrize("drop", [None, LOSSY], ids=["clean", "lossy"])
def test_scalar_paths_match_the_reference(drop, monkeypatch):
    fast, taken = _train(True, drop, monkeypatch)
    ref, untaken = _train(False, drop, monkeypatch)
    assert taken["_one_result"] > 0 and taken["_params_in_order"] > 0, taken
    assert untaken == {"_one_result": 0, "_params_in_order": 0}
    for t in fast:
        assert len(fast[t]) == len(ref[t]) == 6
        for a, b in zip(fast[t], ref[t]):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("lanes,pool_size,numel", [(64, 8, 1000), (16000, 1024, 70001), (3, 2, 7)])
def test_scalar_headers_match_the_reference(lanes, pool_size, numel):
    """aggregation_fill packs a few rows' headers one struct call per row: every field as the
    vectorised reference writes it, with sequence numbers wrapping past 2^32, flags set, and
    exponents across the int8 field's whole range (and past it: numpy's wrap)."""
    from luwu.dataplane.engine.packets import _template, aggregation_headers, aggregation_headers_scalar
    from luwu.dataplane.protocol import Dtype, MsgType, ver_type
    from luwu.dataplane.quantize import num_chunks

    rng = np.random.default_rng(lanes)
    chunks = num_chunks(numel, lanes)
    for seg_start in (0, 5, 0xFFFFFFFF - 2, int(rng.integers(0, 2**32))):
        for flags in (0, 0x40):
            exps = rng.integers(-140, 140, size=chunks).astype(np.int32)
            exps[:2] = (-128, 127)[: min(2, chunks)]
            vt = ver_type(MsgType.GRAD)
            shared = (vt, 9, 1, 77, int(Dtype.FIXED32), numel, seg_start, 16, pool_size, lanes, flags)
            template = _template(vt, 9, 1, 0, 77, int(Dtype.FIXED32), numel)
            for i0, i1 in ((0, 1), (0, min(chunks, 8)), (chunks - 1, chunks), (max(0, chunks - 3), chunks)):
                for e in (exps, None):
                    ref = aggregation_headers(template, shared, i0, i1, e)
                    fast = aggregation_headers_scalar(shared, i0, i1, e)
                    assert fast.shape == ref.shape and fast.tobytes() == ref.tobytes(), (seg_start, i0, i1)


def test_scalar_batch_grouping_matches_the_reference():
    """A received batch mixing sessions and types (PARAM + HEARTBEAT, AGG + PULL), with packets
    of another version and shorter than a header among them: the Python grouping of small
    batches gives the reference's groups, in its order, and the same count of bad packets."""
    from luwu.dataplane.engine.grouping import groups_reference, groups_scalar
    from luwu.dataplane.protocol import DATA_HEADER, HEADER_LEN, VERSION

    rng = np.random.default_rng(11)
    for k in list(range(1, 17)) * 40:
        hb = rng.integers(0, 256, size=(k, HEADER_LEN), dtype=np.uint8)
        versions = rng.choice([VERSION, VERSION, VERSION, (VERSION + 1) & 0xF], size=k)
        hb[:, 0] = (versions << 4) | rng.choice([1, 2, 5, 7, 15], size=k)  # a few types, some repeated
        session = rng.choice([0, 1, 3, 0x1FF, 0xFFFF], size=k)
        hb[:, 2], hb[:, 3] = session >> 8, session & 0xFF
        lens = rng.choice([HEADER_LEN - 1, HEADER_LEN, 100, 65536], size=k).astype(np.int64)
        ref, ref_bad = groups_reference(hb.view(DATA_HEADER)[:, 0], lens)
        fast, fast_bad = groups_scalar(hb, lens)
        assert fast_bad == ref_bad
        assert [(s, t) for s, t, _ in fast] == [(s, t) for s, t, _ in ref]
        for (_, _, a), (_, _, b) in zip(fast, ref):
            assert a.dtype == b.dtype and np.array_equal(a, b)
