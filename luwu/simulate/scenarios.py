"""The issue-30 scenarios as `luwu simulate` command lines, and their figures: tensor and
pipeline parallelism with up to 256 data-parallel replicas, the baselines' collective algorithm
(ring, PAT, SHARP), one 8-GPU server sharing its host, and the DisDP revision's shapes above 175B.
docs/simulator.md ("Scenarios") shows each command next to what it gives; tests/simulate checks
that the table is what this module computes. `luwu simulate --scenarios` prints them.
"""

from __future__ import annotations

import argparse
import shlex

# (command-line flags, figures to report: "<system> tokens/s per GPU", "<system> micro-batch",
# "<system> mfu", "<system> bubble", "<system> <resource>" (its utilisation) or "speedup_over_<system>")
SCENARIOS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--model 175b --tp 8 --pp 4 --workers 8 --optimizer-nodes 32",
     ("luwu tokens/s per GPU", "zero_3 tokens/s per GPU", "zero_offload tokens/s per GPU", "luwu bubble")),
    ("--model 175b --tp 8 --pp 4 --schedule gpipe --workers 8 --optimizer-nodes 32",
     ("luwu tokens/s per GPU", "luwu micro-batch")),
    ("--model 175b --tp 8 --pp 4 --workers 256 --optimizer-nodes 32 --systems zero_3",
     ("luwu tokens/s per GPU", "zero_3 tokens/s per GPU")),
    ("--model 175b --tp 8 --pp 4 --workers 256 --optimizer-nodes 32 --systems zero_3 --collective pat",
     ("zero_3 tokens/s per GPU",)),
    ("--model opt-1.3b --workers 256 --systems zero_3", ("zero_3 tokens/s per GPU",)),
    ("--model opt-1.3b --workers 256 --systems zero_3 --collective pat", ("zero_3 tokens/s per GPU",)),
    ("--model 175b --systems zero_infinity --collective sharp",
     ("zero_infinity tokens/s per GPU", "speedup_over_zero_infinity")),
    ("--model opt-1.3b --systems zero_3,zero_infinity --collective sharp",
     ("speedup_over_zero_3", "speedup_over_zero_infinity")),
    ("--model opt-13b --systems zero_offload",
     ("zero_offload tokens/s per GPU", "zero_offload host_cpu", "speedup_over_zero_offload")),
    ("--model opt-13b --systems zero_offload --host-shared-by 8",
     ("zero_offload tokens/s per GPU", "zero_offload host_cpu", "speedup_over_zero_offload")),
    ("--model 276b", ("luwu tokens/s per GPU", "luwu micro-batch", "luwu mfu")),
    ("--model 276b --activation-offload", ("luwu tokens/s per GPU", "luwu micro-batch", "luwu mfu")),
    ("--model 505b", ("luwu tokens/s per GPU", "luwu micro-batch", "luwu mfu")),
    ("--model 505b --activation-offload", ("luwu tokens/s per GPU", "luwu micro-batch", "luwu mfu")),
    ("--model 1t-disdp", ("luwu tokens/s per GPU", "luwu micro-batch", "luwu mfu")),
    ("--model 1t-disdp --activation-offload", ("luwu tokens/s per GPU", "luwu micro-batch", "luwu mfu")),
)


def run_scenario(flags: str) -> dict:
    """The JSON object `luwu simulate FLAGS --json --no-files` prints (built in process)."""
    from luwu.simulate import flags as simulate_flags
    from luwu.simulate import report
    from luwu.simulate.core import simulate

    parser = argparse.ArgumentParser()
    simulate_flags.add_arguments(parser)
    args = parser.parse_args(shlex.split(flags))
    cfg = simulate_flags.build_config(args)
    return report.to_json(cfg, simulate(cfg, simulate_flags.parse_systems(args.systems)), args.preset)


def figure(doc: dict, name: str) -> float | int | None:
    """One named figure of a scenario's JSON (None where the system cannot run)."""
    if name.startswith("speedup_over_"):
        return doc[name]
    system, what = name.split(" ", 1)
    r = doc["systems"][system]
    if not r["feasible"]:
        return None
    known = {"tokens/s per GPU": r["tokens_per_s_per_worker"], "micro-batch": r["micro_batch"],
             "mfu": r["mfu"], "bubble": r.get("bubble", 0.0)}
    return known[what] if what in known else r["utilisation"][what]


def scenario_rows() -> list[dict]:
    """One row per (scenario, figure): {"command", "figure", "simulated"}."""
    rows: list[dict] = []
    for flags, names in SCENARIOS:
        doc = run_scenario(flags)
        rows.extend({"command": f"luwu simulate {flags}", "figure": n, "simulated": figure(doc, n)} for n in names)
    return rows
