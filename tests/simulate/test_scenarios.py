"""`luwu simulate`'s issue-30 options: tensor and pipeline parallelism (1F1B, GPipe), the
baselines' collective algorithm (ring, PAT, SHARP), GPUs sharing one host, activation offload
for the shapes above 175B; and the scenario table in docs/simulator.md, recomputed.

Deterministic model figures only; nothing here measures wall-clock time.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from luwu.simulate import MODELS, PRESETS, simulate, systems
from luwu.simulate.core import run_system
from luwu.simulate.scenarios import SCENARIOS, scenario_rows
from luwu.simulate.workload import layer_costs

BIN = Path(sys.executable).parent
DOC = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"
TESTBED = PRESETS["paper-testbed"]


def _same(a, b) -> None:
    for k in ("feasible", "micro_batch", "iteration_s", "tokens_per_s_per_worker", "tokens_per_s", "mfu", "hfu",
              "utilisation", "bottleneck", "memory_gib_per_worker", "recompute"):
        assert getattr(a, k) == getattr(b, k), k


@pytest.mark.parametrize("model", ["175b", "opt-1.3b"])
def test_defaults_spelled_out_change_nothing(model):
    """tp = pp = 1, one micro-batch, a ring, one GPU per host: exactly the figures of before."""
    cfg = TESTBED.with_(model=MODELS[model])
    spelled = cfg.with_(tp=1, pp=1, micro_batches=1, schedule="gpipe", collective="ring", host_shared_by=1)
    for s in ("luwu", "zero_3", "zero_infinity", "zero_offload"):
        _same(run_system(s, cfg), run_system(s, spelled))


def test_scenario_table_in_docs_is_the_simulation():
    """Every (command, figure) row of docs/simulator.md's scenario table is what the code gives."""
    text = DOC.read_text()
    rows = scenario_rows()
    assert len(rows) == sum(len(f) for _, f in SCENARIOS)
    for r in rows:
        line = next((ln for ln in text.splitlines()
                     if ln.startswith(f"| `{r['command']}` | {r['figure']} |")), None)
        assert line is not None, f"docs/simulator.md has no scenario row for {r['command']!r} {r['figure']!r}"
        cell = line.strip("|").split("|")[2].strip()
        if r["simulated"] is None:
            assert cell == "cannot run", line
        else:
            assert float(cell) == pytest.approx(r["simulated"], rel=0.01), line


def test_sharp_reduces_faster_than_a_ring():
    """SHARP sums in the switch: a reduce-scatter or allreduce sends the buffer once at the link
    rate, with no GPU reduction kernels, and takes two hops of latency; an allgather is unchanged."""
    cfg = TESTBED.with_(model=MODELS["opt-1.3b"])
    sharp = cfg.with_(collective="sharp")
    S = 2 * cfg.model.block_params
    for op in ("reduce_scatter", "allreduce"):
        ring_t, sharp_t = systems.collective(cfg, op, S), systems.collective(sharp, op, S)
        assert max(sharp_t[:2]) + sharp_t[2] < max(ring_t[:2]) + ring_t[2]
    assert systems.collective(cfg, "allgather", S) == systems.collective(sharp, "allgather", S)

    def rs_seconds(c):
        r = run_system("zero_3", c)
        t0, t1 = r.window
        return sum(t.end - t.start for t in r.timeline.tasks if t0 <= t.start < t1 and t.label.startswith("reduce"))

    assert rs_seconds(sharp) < 0.9 * rs_seconds(cfg)
    assert run_system("zero_3", sharp).tokens_per_s > run_system("zero_3", cfg).tokens_per_s


def test_pat_has_log_latency_and_the_rings_bytes():
    cfg = TESTBED.with_(workers=256)
    pat = cfg.with_(collective="pat")
    S = 1e6
    ring_t, pat_t = systems.collective(cfg, "allgather", S), systems.collective(pat, "allgather", S)
    assert pat_t[:2] == ring_t[:2]
    assert pat_t[2] == pytest.approx(ring_t[2] * math.log2(256) / 255)
    small = cfg.with_(model=MODELS["opt-1.3b"])
    assert run_system("zero_3", small.with_(collective="pat")).tokens_per_s > run_system("zero_3", small).tokens_per_s


def test_a_shared_host_slows_zero_offloads_optimizer():
    """Eight GPUs on one host share its CPU and DRAM: CPU-Adam on each GPU's partition takes 8x
    as long; the collectives move onto NVLink."""
    cfg = TESTBED.with_(model=MODELS["opt-13b"])
    box = cfg.with_(host_shared_by=8)

    def adam_seconds(c):
        r = run_system("zero_offload", c)
        t0, t1 = r.window
        return sum(t.end - t.start for t in r.timeline.tasks if t0 <= t.start < t1 and t.label == "cpu adam")

    assert adam_seconds(box) == pytest.approx(8 * adam_seconds(cfg), rel=1e-6)
    assert systems.host_adam_rate(box) == pytest.approx(systems.host_adam_rate(cfg) / 8)
    assert systems.nccl_bandwidth(box) == pytest.approx(cfg.net.nvlink * cfg.net.nvlink_efficiency)
    assert systems.host_of(box).pcie == cfg.host.pcie  # each GPU keeps its own PCIe link


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule):
    p, m = 4, 12
    cfg = TESTBED.with_(model=MODELS["175b"], tp=8, pp=p, micro_batches=m, schedule=schedule,
                        node=replace(TESTBED.node, nodes=32))
    for s in ("luwu", "zero_3"):
        r = run_system(s, cfg)
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert r.iteration_s == pytest.approx((m + p - 1) * r.micro_batch_s + r.step_tail_s)
        assert 1 - m * r.micro_batch_s / (r.iteration_s - r.step_tail_s) == pytest.approx(r.bubble)


def test_gpipe_holds_more_activations_than_1f1b():
    base = TESTBED.with_(model=MODELS["175b"], tp=8, pp=4, micro_batches=16)
    one = systems.memory("zero_3", base, 4, recompute="full")
    gp = systems.memory("zero_3", base.with_(schedule="gpipe"), 4, recompute="full")
    assert gp.gpu > one.gpu


def test_tensor_parallelism_splits_a_block_and_adds_nvlink_allreduces():
    cfg = TESTBED.with_(model=MODELS["175b"])
    one, eight = layer_costs(cfg, 4)[1], layer_costs(cfg.with_(tp=8), 4)[1]
    assert eight.params == one.params // 8
    assert one.fwd / 8 < eight.fwd < one.fwd / 4  # replicated norms and the allreduces cost something
    assert systems.gpu_params(cfg.with_(tp=8, pp=4)) < cfg.model.params / 30


def test_activation_offload_lets_1t_run_a_full_micro_batch():
    """The DisDP 1T shape on 40 GiB: one sequence without offload; with the checkpoints in host
    RAM, the preset's 8, with their PCIe copies on the timeline."""
    cfg = TESTBED.with_(model=MODELS["1t-disdp"])
    plain, off = run_system("luwu", cfg), run_system("luwu", cfg.with_(activation_offload=True))
    assert plain.micro_batch == 1 and off.micro_batch == 8
    assert off.tokens_per_s > 3 * plain.tokens_per_s
    labels = {t.label.split()[0] + " " + t.label.split()[1] for t in off.timeline.tasks if "act" in t.label}
    assert labels == {"d2h act", "h2d act"}
    mem = systems.memory("luwu", cfg.with_(activation_offload=True), 8, prefetch=False)
    assert mem.host > 50e9 and mem.fits(cfg)[0]
    z = run_system("zero_infinity", TESTBED.with_(model=MODELS["276b"], activation_offload=True))
    assert any(t.label.startswith("h2d act") for t in z.timeline.tasks)


def test_largest_trainable_is_unchanged_by_the_new_shapes():
    out = simulate(TESTBED.with_(model=MODELS["175b"]), which=("luwu", "zero_infinity"))
    assert out["largest_trainable"] == {"luwu": "1t", "zero_infinity": "175b"}


@pytest.mark.parametrize("argv,word", [
    (["--tp", "7"], "--tp"),
    (["--pp", "1000"], "--pp"),
    (["--collective", "tree"], "--collective"),
    (["--host-shared-by", "0"], "--host-shared-by"),
    (["--plan", "--tp", "8"], "--plan"),
])
def test_bad_parallelism_flags_are_one_line(tmp_path, argv, word):
    proc = subprocess.run([str(BIN / "luwu"), "simulate", *argv, "--no-files"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in proc.stderr, proc.stderr
