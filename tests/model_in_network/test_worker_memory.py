"""A ModelInNetwork worker holds only the units in flight: its memory does not grow with the number
of layers beyond their activations and a little metadata each.

Real processes, as `luwu bench capacity` runs them (capacity_run.trial: a software switch and an
optimizer node on loopback, 2 workers with their engine daemons, each building the LLaMA-shaped
model on the meta device): the same model with 4 and with 48 decoder layers (hidden 256, 3.2 MB of
fp32 parameters a layer), 3 steps each. What is compared is bytes, never time:

* malloc's free heap, which the process keeps resident: a worker allocates and frees every unit's
  parameters, gradients and activations on every use, and glibc's heap fragmented with them (free
  heap 114-136 MiB at 48 layers against 13-16 MiB at 4, before memory.py's fixed mmap threshold;
  1-2 MiB at both since);
* each worker's peak RSS: +110-130 MiB from 4 to 48 layers before (2.7 MB a layer), +13 MiB since
  (0.3 MB a layer: the checkpointed blocks' saved inputs, 128 KiB each, and the modules' metadata).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from luwu.bench.capacity_model import count_params, intermediate_for
from luwu.bench.capacity_run import trial
from luwu.bench.memcap import MemoryCap
from luwu.worker.model_in_network.memory import heap_bytes

FEW, MANY = 4, 48
HIDDEN = 256
MODEL = {"vocab": 1024, "hidden": HIDDEN, "heads": 4, "intermediate": intermediate_for(HIDDEN), "seq": 64, "seed": 1,
         "backend": "builtin"}
BASE = {"world": 2, "steps": 3, "batch": 2, "node_memory": 1 << 30, "threads": 1, "lr": 1e-4, "model": MODEL}
TRIAL_TIMEOUT = 400.0  # s one trial may take on a loaded 2-core machine


def _layer_bytes() -> int:
    """fp32 bytes of one decoder layer's parameters."""
    return 4 * (count_params(dict(MODEL, layers=2)) - count_params(dict(MODEL, layers=1)))


def _run(layers: int, tmp_path: Path) -> dict:
    rec = trial("luwu", layers, count_params(dict(MODEL, layers=layers)), BASE, MemoryCap("measured", 8 << 30),
                tmp_path / f"L{layers}", TRIAL_TIMEOUT)
    assert rec["fits"], (rec["reason"], rec.get("detail"))
    assert len(rec["mnn_memory"]) == 2 and all(rec["mnn_memory"]), rec
    return rec


@pytest.mark.skipif(not heap_bytes(), reason="malloc's heap statistics (mallinfo2) need glibc >= 2.33")
def test_a_workers_memory_does_not_grow_with_the_number_of_layers(tmp_path):
    few, many = _run(FEW, tmp_path), _run(MANY, tmp_path)
    layer, added = _layer_bytes(), MANY - FEW
    assert layer > 3_000_000  # blocks of 256 KiB to 3 MiB: the sizes glibc's heap fragmented with
    for f, m in zip(few["mnn_memory"], many["mnn_memory"]):
        # the heap's free bytes: a fixed allowance, nothing per layer (before: 2.6 MB a layer)
        assert m["heap_bytes"]["free"] < f["heap_bytes"]["free"] + 16 * 2**20, (f["heap_bytes"], m["heap_bytes"])
        assert m["malloc_mmap_threshold"] is not None  # memory.py's return_freed_memory() took effect
    for f, m in zip(few["worker_peak_rss_bytes"], many["worker_peak_rss_bytes"]):
        # per layer added: under a quarter of its fp32 parameters (activations, metadata: a tenth; before: 0.8)
        assert m - f < added * layer // 4, (f, m, layer)
    print({"layer_bytes": layer, "peak_rss": [few["worker_peak_rss_bytes"], many["worker_peak_rss_bytes"]],
           "heap": [[x["heap_bytes"] for x in r["mnn_memory"]] for r in (few, many)]})
