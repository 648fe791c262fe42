"""Lazy asynchronous checkpoints: a restored node resumes bit-exactly; interrupted, corrupted
and truncated checkpoints are refused with a clear error and never loaded."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch
from optimizer_reference import initial_values, model_layers, summed_grad

from luwu.dataplane.optimizer import (
    CheckpointError,
    JobSpec,
    NodeConfig,
    OptimizerInputError,
    OptimizerNode,
    OptimizerSpec,
    ScheduleSpec,
)
from luwu.dataplane.optimizer.checkpoint_files import checkpoint_dirs

STEPS = 6


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _spec(name="adamw") -> JobSpec:
    layers = model_layers(6, rows=96, cols=80)
    if name == "sgd":
        opt = OptimizerSpec("sgd", lr=0.05, momentum=0.9, nesterov=True)
    else:
        opt = OptimizerSpec("adamw", lr=1e-2, weight_decay=0.05, clip_grad_norm=1.0,
                            schedule=ScheduleSpec("cosine", warmup_steps=2, total_steps=STEPS))
    return JobSpec("ck", opt, layers, "bf16", initial_values(layers, seed=3))


def _train(node, spec, start, stop, before_step=None):
    for step in range(start, stop):
        if before_step:
            before_step(step)
        for ly in reversed(spec.layers):
            node.submit_gradient("ck", ly.layer_id, step, summed_grad(ly, step, 2), contributors=2)
    for ly in spec.layers:
        node.params("ck", ly.layer_id, stop, timeout=120)


def _states(node, spec):
    return {ly.layer_id: node.layer_state("ck", ly.layer_id) for ly in spec.layers}


def _assert_same(a, b):
    for lid in a:
        for k, v in a[lid].items():
            assert np.array_equal(np.asarray(v), np.asarray(b[lid][k])), (lid, k)


def _cfg(tmp_path, name, **kw):
    return NodeConfig(tmp_path / f"state-{name}", checkpoint_dir=tmp_path / "ckpts", **kw)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("budget", [32 << 20, 180_000], ids=["ram", "out_of_core"])
def test_lazy_checkpoint_resumes_bit_exactly(tmp_path, opt, budget):
    spec = _spec(opt)
    handles = {}
    cfg = dict(ram_budget=budget, max_shard_elems=4096)
    with OptimizerNode(_cfg(tmp_path, "a", **cfg)) as node:
        node.add_job(spec)
        # checkpoint of step 2 (version 3), requested before step 2's gradients; the next steps
        # follow at once, so shards not yet written get copy-on-write snapshots
        _train(node, spec, 0, STEPS, before_step=lambda s: handles.update({s: node.request_checkpoint(s)})
               if s == 2 else None)
        path = handles[2].wait(120)
        final = _states(node, spec)
        st = node.stats()["checkpoint"]
        assert st["committed"] == 1 and st["failed"] == 0
    manifest = json.loads((path / "manifest.json").read_text())
    assert {ly["version"] for ly in manifest["jobs"][0]["state"]} == {3}
    with OptimizerNode.restore(_cfg(tmp_path, "b", **cfg), path) as node:
        assert {node.version("ck", ly.layer_id) for ly in spec.layers} == {3}
        _train(node, spec, 3, STEPS)
        _assert_same(final, _states(node, spec))


@pytest.mark.parametrize("staging", [0, 64 << 20], ids=["wait_for_writer", "copy_on_write"])
def test_a_step_never_changes_a_shard_before_its_checkpoint_copy(tmp_path, staging):
    """The writer is held after its first file; layer 0's next step then has to snapshot its
    shards (copy-on-write) or wait for them: either way the checkpoint holds version 3. (No
    global clipping here: it would hold layer 0's step until every layer's gradient is in.)"""
    spec = _spec("sgd")
    with OptimizerNode(_cfg(tmp_path, "ref", ram_budget=32 << 20)) as node:
        node.add_job(spec)
        _train(node, spec, 0, 3)
        want = _states(node, spec)
    release, first = threading.Event(), threading.Event()

    def hold_writer(event, info):
        if event == "file" and not first.is_set():
            first.set()
            release.wait(120)

    with OptimizerNode(_cfg(tmp_path, "a", ram_budget=32 << 20, checkpoint_staging=staging)) as node:
        node.add_job(spec)
        node.add_checkpoint_listener(hold_writer)
        handle = None
        for step in range(3):
            if step == 2:
                handle = node.request_checkpoint(2)
            for ly in reversed(spec.layers):
                node.submit_gradient("ck", ly.layer_id, step, summed_grad(ly, step, 2), contributors=2)
        assert first.wait(120)
        if not staging:  # the step waits for the held writer: release it from aside, not after 120 s
            threading.Timer(1.0, release.set).start()
        node.submit_gradient("ck", 0, 3, summed_grad(spec.layers[0], 3, 2), contributors=2)
        if staging:
            node.params("ck", 0, 4, timeout=120)  # went ahead on a snapshot while the writer is held
            assert node.stats()["checkpoint"]["cow_copies"] >= len(node.jobs["ck"].layers[0].plan.shards)
        release.set()
        path = handle.wait(120)
        node.params("ck", 0, 4, timeout=120)
        if not staging:
            assert node.stats()["checkpoint"]["cow_copies"] == 0
    with OptimizerNode.restore(_cfg(tmp_path, "b", ram_budget=32 << 20), path) as node:
        _assert_same(want, _states(node, spec))


def test_checkpoint_now_and_restore_equal_the_live_state(tmp_path):
    spec = _spec()
    with OptimizerNode(_cfg(tmp_path, "a", ram_budget=180_000, max_shard_elems=4096)) as node:
        node.add_job(spec)
        _train(node, spec, 0, 2)
        path = node.checkpoint_now(timeout=120)
        live = _states(node, spec)
        assert OptimizerNode.latest_checkpoint(tmp_path / "ckpts") == path
    with OptimizerNode.restore(_cfg(tmp_path, "b", ram_budget=32 << 20), path) as node:
        _assert_same(live, _states(node, spec))


def test_a_commit_makes_every_name_durable_before_and_after_its_manifest(tmp_path, monkeypatch):
    """A manifest that survives a crash must not outlive the names of the files it lists: the
    records' folders are fsynced before the manifest's rename, the checkpoint and the root after."""
    synced: list[str] = []  # the paths fsync was called on, in order (os.fsync itself still runs)
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    spec = _spec()
    with OptimizerNode(_cfg(tmp_path, "a", ram_budget=32 << 20)) as node:
        node.add_job(spec)
        _train(node, spec, 0, 1)
        monkeypatch.setattr(os, "fsync", recording_fsync)
        path = node.checkpoint_now(timeout=120)
        monkeypatch.undo()
    path, root = os.path.realpath(path), os.path.realpath(tmp_path / "ckpts")
    manifest = synced.index(os.path.join(path, "manifest.json.tmp"))
    job_dirs = [d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))]
    assert job_dirs
    for d in job_dirs:  # each records' folder, before the manifest
        assert os.path.join(path, d) in synced[:manifest]
    assert path in synced[manifest + 1:] and root in synced[manifest + 1:]


def test_too_late_and_retention(tmp_path):
    spec = _spec()
    with OptimizerNode(_cfg(tmp_path, "a", ram_budget=32 << 20, checkpoint_keep=2)) as node:
        node.add_job(spec)
        _train(node, spec, 0, 2)
        with pytest.raises(OptimizerInputError, match="too late to checkpoint step 0"):
            node.request_checkpoint(0)
        paths = [node.checkpoint_now(timeout=60) for _ in range(3)]
        assert [p.exists() for p in paths] == [False, True, True]  # only the newest two are kept
        handle = node.request_checkpoint(1)  # version 2: the current one, taken at once
        assert handle.wait(60).exists()


def test_retention_lists_once_and_keeps_what_it_must(tmp_path):
    """_retire_old (one listing, manifests looked at only from the newest down): an older interrupted
    checkpoint is deleted, a committed one from an earlier run counts towards `keep`, and entries
    that are not checkpoint directories (a file named like one, other names) are left alone."""
    spec = _spec()
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "ckpt-000001").mkdir()  # interrupted: no manifest
    (root / "ckpt-000002").mkdir()  # committed by an earlier run
    (root / "ckpt-000002" / "manifest.json").write_text("{}")
    (root / "ckpt-000000").write_text("not a directory")
    (root / "notes").mkdir()
    with OptimizerNode(_cfg(tmp_path, "a", ram_budget=32 << 20, checkpoint_keep=2)) as node:
        node.add_job(spec)
        _train(node, spec, 0, 1)
        first = node.checkpoint_now(timeout=60)
        assert first.name == "ckpt-000003"  # numbered after the highest checkpoint directory
        assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000", "ckpt-000002", "ckpt-000003", "notes"]
        second = node.checkpoint_now(timeout=60)
        assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000", "ckpt-000003", "ckpt-000004", "notes"]
        assert OptimizerNode.latest_checkpoint(root) == second
    assert checkpoint_dirs(tmp_path / "missing") == []


def _checkpoint(tmp_path) -> tuple:
    spec = _spec()
    with OptimizerNode(_cfg(tmp_path, "a", ram_budget=32 << 20, max_shard_elems=4096)) as node:
        node.add_job(spec)
        _train(node, spec, 0, 1)
        return spec, node.checkpoint_now(timeout=60)


def _some_shard(path):
    files = sorted((path / "ck").glob("*.ckpt"))
    assert files
    return files[len(files) // 2]


def _refused(tmp_path, path, words):
    with pytest.raises(CheckpointError, match=words):
        OptimizerNode.restore(NodeConfig(tmp_path / "state-r", ram_budget=32 << 20), path)
    # nothing was loaded: the refused restore left no state files behind
    assert not list((tmp_path / "state-r").rglob("*.state"))


def test_corrupted_shard_file_is_refused(tmp_path):
    _, path = _checkpoint(tmp_path)
    f = _some_shard(path)
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x40]))
    _refused(tmp_path, path, f"{f.name}: CRC-32 .* does not match")


def test_truncated_and_missing_files_are_refused(tmp_path):
    _, path = _checkpoint(tmp_path)
    f = _some_shard(path)
    os.truncate(f, os.path.getsize(f) - 4096)
    _refused(tmp_path, path, f"{f.name}: .* bytes, expected \\d+ \\(truncated")
    f.unlink()
    _refused(tmp_path, path, f"{f.name}: missing")


def test_bad_manifests_are_refused(tmp_path):
    _, path = _checkpoint(tmp_path)
    manifest = path / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    _refused(tmp_path, path, "manifest.json is unreadable")
    manifest.write_text(json.dumps({"format": "something else"}))
    _refused(tmp_path, path, "not a luwu-optimizer-checkpoint")
    doc = json.loads(text)
    doc["jobs"][0]["state"][0]["shards"][0]["crc32"] ^= 1
    manifest.write_text(json.dumps(doc))
    _refused(tmp_path, path, "CRC-32")
    manifest.unlink()
    _refused(tmp_path, path, "interrupted checkpoint")
    assert OptimizerNode.latest_checkpoint(tmp_path / "ckpts") is None


def test_a_checkpoint_of_another_layout_is_refused(tmp_path):
    """A shard file swapped in from another layer has the right size but the wrong header (and CRC)."""
    _, path = _checkpoint(tmp_path)
    files = sorted((path / "ck").glob("*.ckpt"), key=lambda p: p.stat().st_size)
    same = [f for f in files if f.stat().st_size == files[-1].stat().st_size]
    a, b = same[0], same[1]
    doc = json.loads((path / "manifest.json").read_text())
    for layer in doc["jobs"][0]["state"]:
        for sh in layer["shards"]:
            if sh["file"].endswith(a.name):
                sh["crc32"] = next(s["crc32"] for ly in doc["jobs"][0]["state"] for s in ly["shards"]
                                   if s["file"].endswith(b.name))
    (path / "manifest.json").write_text(json.dumps(doc))
    a.write_bytes(b.read_bytes())
    _refused(tmp_path, path, "header describes")


def test_closing_fails_a_checkpoint_whose_step_never_comes(tmp_path):
    spec = _spec("sgd")
    node = OptimizerNode(_cfg(tmp_path, "a", ram_budget=32 << 20))
    node.add_job(spec)
    _train(node, spec, 0, 1)
    handle = node.request_checkpoint(5)
    node.close(timeout=30)
    with pytest.raises(CheckpointError, match="closed before every layer reached"):
        handle.wait(5)
    assert OptimizerNode.latest_checkpoint(tmp_path / "ckpts") is None
    assert not list((tmp_path / "ckpts").glob("ckpt-*"))
