"""The pipeline under concurrency: many layers, several threads per step, queues of depth 1, a
tight RAM budget, gradients submitted from several threads and several steps ahead. It must not
deadlock, must publish each layer's versions in order, and must compute exactly what a
sequential run computes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from optimizer_reference import initial_values, model_layers, summed_grad

from luwu.dataplane.optimizer import JobSpec, NodeConfig, OptimizerNode, OptimizerSpec

LAYERS = 24
STEPS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _spec(clip: str | None) -> JobSpec:
    layers = model_layers(LAYERS, rows=40, cols=24)
    opt = OptimizerSpec("adamw", lr=1e-2, weight_decay=0.05, clip_grad_norm=None if clip is None else 1.0,
                        clip_scope=clip or "global")
    return JobSpec("p", opt, layers, "fp16", initial_values(layers, seed=9))


def _run(tmp_path, name: str, spec: JobSpec, submitters: int, ahead: bool, **cfg) -> tuple[dict, list, dict]:
    """Train STEPS steps; returns the final states, the publication log and the stats."""
    log: list[tuple[str, int, int]] = []
    log_lock = threading.Lock()
    with OptimizerNode(NodeConfig(tmp_path / name, **cfg)) as node:
        node.add_job(spec)
        node.add_listener(lambda j, lid, v: (log_lock.acquire(), log.append((j, lid, v)), log_lock.release()))
        errors = []

        def submit(my_layers):
            try:
                for step in range(STEPS):
                    for ly in my_layers:
                        node.submit_gradient("p", ly.layer_id, step, summed_grad(ly, step, 3), contributors=3)
                    if not ahead:  # wait for this step's versions before the next step, like workers do
                        for ly in my_layers:
                            node.params("p", ly.layer_id, step + 1, timeout=120)
            except BaseException as e:
                errors.append(e)

        backward = list(reversed(spec.layers))
        threads = [threading.Thread(target=submit, args=(backward[i::submitters],)) for i in range(submitters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a submitter hung"
        assert not errors, errors
        assert node.wait_idle(120), "the pipeline did not drain (deadlock?)"
        st = node.stats()
        assert st["node"]["published"] == LAYERS * STEPS and st["node"]["error"] is None
        states = {ly.layer_id: node.layer_state("p", ly.layer_id) for ly in spec.layers}
    return states, log, st


def _check_log(log):
    per_layer: dict[int, list[int]] = {}
    for _, lid, v in log:
        per_layer.setdefault(lid, []).append(v)
    assert sorted(per_layer) == list(range(LAYERS))
    for lid, versions in per_layer.items():
        assert versions == list(range(1, STEPS + 1)), (lid, versions)


def _same(a, b):
    for lid in a:
        for k in ("master", "exp_avg", "exp_avg_sq", "served", "version"):
            assert np.array_equal(a[lid][k], b[lid][k]), (lid, k)


@pytest.mark.parametrize("clip", [None, "global", "layer"])
def test_concurrent_pipeline_equals_sequential(tmp_path, clip):
    spec = _spec(clip)
    base, log, st = _run(tmp_path, "base", spec, submitters=1, ahead=False, ram_budget=32 << 20)
    _check_log(log)
    shard_steps = STEPS * st["store"]["shards"]
    # in RAM every shard takes the fast lane (no read or write thread); out of core, misses do not
    assert st["pipeline"]["fast_reads"] == st["pipeline"]["fast_writes"] == shard_steps
    # small layers in RAM are stepped on the submitting thread, but for a global-norm gate
    assert st["pipeline"]["inline_layers"] == (0 if clip == "global" else LAYERS * STEPS)
    # several threads per step, depth-1 queues, submitters racing, every step submitted at once
    busy, log, st = _run(tmp_path, "busy", spec, submitters=4, ahead=True, ram_budget=32 << 20,
                      threads_per_step=3, queue_depth=1)
    _check_log(log)
    assert st["pipeline"]["fast_reads"] == st["pipeline"]["fast_writes"] == shard_steps
    _same(base, busy)
    # the same through the pipeline's threads only (no inline lane)
    threaded, log, st = _run(tmp_path, "threaded", spec, submitters=4, ahead=True, ram_budget=32 << 20,
                             threads_per_step=3, queue_depth=1, inline_elems=0)
    _check_log(log)
    assert st["pipeline"]["inline_layers"] == 0
    assert st["pipeline"]["fast_reads"] == st["pipeline"]["fast_writes"] == shard_steps
    _same(base, threaded)
    # the same, out of core: a budget of a few shards, shards of 4096 elements
    tight, log, st = _run(tmp_path, "tight", spec, submitters=3, ahead=True, ram_budget=120_000, max_shard_elems=4096,
                      threads_per_step=2, queue_depth=1, prefetch=3)
    _check_log(log)
    _same(base, tight)
    assert st["store"]["evictions"] > LAYERS and st["store"]["peak_bytes"] <= st["store"]["budget"]
    assert st["pipeline"]["fast_reads"] < STEPS * st["store"]["shards"]
    # layer-centric
    lc, log, _ = _run(tmp_path, "lc", spec, submitters=2, ahead=True, ram_budget=120_000, max_shard_elems=4096,
                   pipeline="layer", threads_per_step=2)
    _check_log(log)
    _same(base, lc)


def test_params_waits_for_its_version(tmp_path):
    spec = _spec(None)
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=32 << 20)) as node:
        node.add_job(spec)
        got = {}

        def puller():
            got["arr"] = node.params("p", 3, 2, timeout=120)
            got["version"] = node.version("p", 3)

        t = threading.Thread(target=puller)
        t.start()
        ly = spec.layers[3]
        node.submit_gradient("p", 3, 0, summed_grad(ly, 0, 1))
        node.submit_gradient("p", 3, 1, summed_grad(ly, 1, 1))
        t.join(120)
        assert got["version"] >= 2
        assert np.array_equal(got["arr"], node.layer_state("p", 3)["served"])


def test_nothing_touches_the_disk_when_the_state_fits(tmp_path):
    spec = _spec("global")
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=64 << 20)) as node:
        node.add_job(spec)
        after_start = node.stats()["io"]
        for step in range(STEPS):
            for ly in reversed(spec.layers):
                node.submit_gradient("p", ly.layer_id, step, summed_grad(ly, step, 1))
        assert node.wait_idle(120)
        for ly in spec.layers:
            node.params("p", ly.layer_id, STEPS)
        io = node.stats()["io"]
        assert io["reads"] == after_start["reads"] == 0
        assert io["writes"] == after_start["writes"] == 0
        assert node.stats()["store"]["evictions"] == 0


def test_served_copies_out_of_core_are_read_back_and_read_ahead(tmp_path):
    """Served copies beyond their budget go to the shard files; pulls in forward order (read
    ahead by the prefetcher) and in backward order get exactly the published values."""
    spec = _spec(None)
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=120_000, max_shard_elems=4096, prefetch=2)) as node:
        node.add_job(spec)
        for step in range(2):
            for ly in reversed(spec.layers):
                node.submit_gradient("p", ly.layer_id, step, summed_grad(ly, step, 1))
        assert node.wait_idle(120)
        want = {ly.layer_id: node.layer_state("p", ly.layer_id)["served"] for ly in spec.layers}
        for ids in ([ly.layer_id for ly in spec.layers], [ly.layer_id for ly in reversed(spec.layers)]):
            for lid in ids:
                assert np.array_equal(node.params("p", lid, 2, timeout=60), want[lid]), lid
        st = node.stats()
        assert st["served"]["evictions"] > 0 and st["served"]["loads"] > 0
        assert st["param_prefetch"]["hints"] > 0 and st["param_prefetch"]["errors"] == 0


def test_a_disk_failure_fails_the_node_loudly(tmp_path):
    """A state file truncated under an out-of-core node: the next read of it fails the node;
    waiters and callers get NodeFailed (not a hang), and the error is in stats."""
    import os

    from luwu.dataplane.optimizer import NodeFailed

    spec = _spec(None)
    node = OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=120_000, max_shard_elems=4096))
    try:
        node.add_job(spec)
        for ly in reversed(spec.layers):
            node.submit_gradient("p", ly.layer_id, 0, summed_grad(ly, 0, 1))
        assert node.wait_idle(120)
        # a shard out of RAM that the next step reads late (not among those being read ahead)
        order = node.order.order("p")
        soon = set(node.order.next_keys("p", 4))
        absent = [k for k in order[len(order) // 2:] if node.store.entries[k].buf is None and k not in soon]
        assert absent
        os.truncate(node._state_path(node.store.entries[absent[-1]].plan), 0)
        with pytest.raises(NodeFailed, match="restore it from a checkpoint"):  # while submitting or waiting
            for ly in reversed(spec.layers):
                node.submit_gradient("p", ly.layer_id, 1, summed_grad(ly, 1, 1))
            for ly in spec.layers:
                node.params("p", ly.layer_id, 2, timeout=120)
        with pytest.raises(NodeFailed):
            node.submit_gradient("p", 0, 2, summed_grad(spec.layers[0], 2, 1))
        err = node.stats()["node"]["error"]
        # a short read, or (if a served copy was written past the cut meanwhile) a header of zeros
        assert "file ends" in err or "not a luwu shard record" in err, err
    finally:
        node.close(timeout=10)


def test_steady_state_reuses_every_buffer(tmp_path):
    """Once warm, a step allocates no memory: served copies and state come from the pools (a
    fresh buffer costs a page fault per 4 KiB, more than the step itself on this class of VM),
    also when every layer's next gradient is queued at once and the served copies sit exactly
    at their budget."""
    layers = model_layers(4, 64, 64)
    spec = JobSpec("p", OptimizerSpec("adamw", lr=1e-3), layers, "bf16", initial_values(layers))
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=64 << 20)) as node:
        node.add_job(spec)
        store_allocated = node.stats()["store"]["buffers_allocated"]
        for step in range(8):
            for ly in reversed(layers):  # the whole backward pass queued before anything is published
                node.submit_gradient("p", ly.layer_id, step, summed_grad(ly, step, 1))
            assert node.wait_idle(120)
        st = node.stats()
        # at most a current and a next copy per layer ever existed: none was dropped and made again
        assert st["served"]["buffers_allocated"] <= 2 * len(layers)
        assert st["served"]["recycled"] >= 8 * len(layers) - 2 * len(layers)
        assert st["store"]["buffers_allocated"] == store_allocated


def test_a_copy_held_past_its_replacement_is_recycled_once_let_go(tmp_path):
    """The engine's parameter stream holds the copy a pull is sent from until the workers
    acknowledge it, usually past the next version's publication: such a copy is recycled once
    its holder lets go (not left for the allocator, which faulted a fresh mapping in per layer
    per step), and never while it is held (a held array's bits never change)."""
    layers = model_layers(3, 64, 64)
    spec = JobSpec("p", OptimizerSpec("adamw", lr=1e-3), layers, "bf16", initial_values(layers))
    with OptimizerNode(NodeConfig(tmp_path / "s", ram_budget=64 << 20)) as node:
        node.add_job(spec)
        for step in range(3):  # warm: every layer's current and next buffer exist
            for ly in reversed(layers):
                node.submit_gradient("p", ly.layer_id, step, summed_grad(ly, step, 1))
            assert node.wait_idle(120)
        allocated = node.stats()["served"]["buffers_allocated"]
        for step in range(3, 9):
            held = [node.lookup("p", ly.layer_id, step)[0] for ly in layers]  # a pull in flight
            before = [a.copy() for a in held]
            for ly in reversed(layers):
                node.submit_gradient("p", ly.layer_id, step, summed_grad(ly, step, 1))
            assert node.wait_idle(120)
            for a, b in zip(held, before):
                np.testing.assert_array_equal(a, b)  # replaced while held: never written
            del held, a  # the pull is acknowledged: the next step may reuse the buffers
        st = node.stats()["served"]
        assert st["kept_by_caller"] >= 6 * len(layers)
        assert st["recycled_late"] >= 5 * len(layers)
        # one more buffer per layer than when nothing is held: the held copy, the current and the next
        assert st["buffers_allocated"] <= allocated + len(layers), (st, allocated)


def test_state_buffers_are_private_memory_that_may_get_huge_pages():
    """State and served-copy buffers are private anonymous memory: a shared anonymous mapping is
    shmem, which gets no transparent huge pages unless shmem_enabled allows (`never` by default),
    and the compiled AdamW pass then ran 7-10% slower on 4 KiB pages (docs/optimizer.md)."""
    from luwu.dataplane.optimizer.buffers import HUGE_PAGE, aligned_buffer

    buf = aligned_buffer(2 * HUGE_PAGE)
    addr = buf.__array_interface__["data"][0]
    assert addr % 4096 == 0 and not buf.any()
    buf[:] = 1  # touched: the pages exist
    with open("/proc/self/maps") as f:
        spans = [line.split()[:2] for line in f]
    perms = [p for r, p in spans if int(r.split("-")[0], 16) <= addr < int(r.split("-")[1], 16)]
    assert perms and perms[0][3] == "p", perms  # rw-p, not rw-s
