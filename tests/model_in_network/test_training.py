"""Acceptance of model-in-network training: two worker processes train a small transformer for 50
steps through the software switch and an optimizer node, and match one process training the same
model on the whole batch with torch.optim.AdamW; each worker's resident model state stays far
below what a DDP worker holds.

Tolerance. The workers' gradients are summed in 32-bit fixed point with a shared exponent per
chunk (docs/protocol.md 5: error at most N/2 quanta, a quantum being 2^-30 of the chunk's largest
magnitude for N = 2) and averaged on the node, where the single process computes the full-batch
gradient directly: both differ from the exact mean by ~1e-7 relative (fp32 rounding dominates).
AdamW normalises each element's step, so a relative gradient error becomes the same relative
error of the step (bounded by lr per step), and over 50 steps at lr 1e-2 parameters agree to a
few 1e-6 (measured 3.6e-6) and losses to a few fp32 ulps (measured 6e-7): the test allows 1e-4
on parameters and 2e-5 on losses. The node serves fp32 here: bf16 parameters would differ by
bf16 rounding (2^-8 relative) in every forward. The model has no attention biases: a key bias
has an exactly zero gradient (softmax ignores a shift), so its float noise (~1e-12) is below the
fixed-point quantum and both runs would step it by noise, apart, without any effect on the loss.
"""

from __future__ import annotations

import numpy as np
from mnn_reference import single_process

from luwu.demo.launch import WorkerGroup
from luwu.worker.model_in_network.local import LocalNetwork

WAIT = 600.0  # s the workers may take on a loaded 2-core machine before the test gives up
SPEC = dict(mode="mnn", workers=2, model=dict(d_model=32, n_layers=6, n_heads=2, context=16, attn_bias=False),
            steps=50, batch=8, lr=1e-2, weight_decay=0.1, seed=3, served_dtype="fp32", engine="process", gather=True)


def _train(tmp_path, spec, nodes=1, drop=None):
    with LocalNetwork(spec["workers"], nodes, mode="jumbo", state_dir=tmp_path / "net", drop=drop) as net:
        spec = dict(spec, networks=[net.network(r).to_json() for r in range(spec["workers"])])
        group = WorkerGroup(spec, tmp_path, "mnn").start()
        try:
            reports = group.wait(WAIT)
        finally:
            group.stop()
        node_stats = net.node_stats()
    return reports, node_stats


def test_two_workers_match_single_process_adamw_with_a_fraction_of_the_memory(tmp_path):
    reports, node_stats = _train(tmp_path, SPEC)
    ref = single_process(SPEC)
    mean_losses = np.mean([reports[r]["losses"] for r in range(2)], axis=0)
    np.testing.assert_allclose(mean_losses, ref["losses"], rtol=0, atol=2e-5)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # it did learn something
    for r in range(2):
        got = reports[r]["params"]
        assert set(got) == set(ref["params"])
        for name, want in ref["params"].items():
            np.testing.assert_allclose(np.asarray(got[name]), want.reshape(-1).numpy(), rtol=0, atol=1e-4,
                                       err_msg=name)
    # every step's every unit went through the node: 8 units (embeddings, 6 blocks, norm, head)
    assert node_stats[0]["node"]["node"]["published"] == 50 * 9
    # memory: a DDP worker holds parameters, gradients and AdamW's two moments of the whole model
    ddp_bytes = ref["state_bytes"]["total"]
    model_bytes = ref["state_bytes"]["params"]
    assert ddp_bytes >= 4 * model_bytes
    for r in range(2):
        mem = reports[r]["mnn"]["memory"]
        unit = reports[r]["mnn"]["largest_unit_bytes"]
        assert mem["peak_bytes"] > 0 and mem["peak_rss_bytes"] > 0
        assert mem["peak_bytes_by_kind"]["params"] <= 3 * unit  # the unit computing, one kept, one more at most
        assert mem["peak_bytes"] < ddp_bytes / 3, (mem, ddp_bytes)
