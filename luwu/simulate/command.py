"""`luwu simulate`: the command line of the simulator and capacity planner (docs/simulator.md).

Builds a Config from a preset and the flags, runs every system (or `--plan`, or `--paper`), prints
grep-able `key: value` lines (or one JSON object with `--json`) and writes simulate.json and the
timeline PNG of one iteration to `--out`. Progress goes to stderr once a run passes 2 seconds.
"""

from __future__ import annotations

import json
import sys
import time

from luwu.dataplane.process.usage import UserError
from luwu.simulate.flags import add_arguments as add_arguments  # the command's flags (luwu/cli.py reads them here)
from luwu.simulate.flags import build_config, parse_systems

PROGRESS_AFTER = 2.0  # seconds of silence before progress lines start


class Progress:
    """Progress lines on stderr, once the run has taken PROGRESS_AFTER seconds."""

    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed >= PROGRESS_AFTER:
            print(f"luwu simulate: [{elapsed:5.1f} s] {text}", file=sys.stderr, flush=True)


def run(args) -> int:
    from luwu.simulate import report
    from luwu.simulate.core import simulate

    if args.plan and (cfg_tp_pp := (args.tp or 1) * (args.pp or 1)) > 1:
        raise UserError(f"--plan sizes optimizer nodes for tp = pp = 1 only (--tp x --pp is {cfg_tp_pp}): "
                        "drop --plan, or plan one GPU per replica")
    if args.scenarios:
        from luwu.simulate.scenarios import scenario_rows

        for r in scenario_rows():
            v = r["simulated"]
            print(f"{r['command']}: {r['figure']}: " + (f"{v:.4g}" if v is not None else "cannot run"))
        return 0
    cfg = build_config(args)
    which = parse_systems(args.systems)
    progress = Progress()
    doc: dict = {}
    if args.calibrate:
        from luwu.simulate import calibrate

        progress.t0 -= PROGRESS_AFTER  # calibration always takes a while: say so from the start
        measured = calibrate.measure(progress)
        cfg = calibrate.apply(cfg, measured)
        doc["calibration"] = {"node_params_per_s_one_core": measured["node_params_per_s"],
                              "fraction_of_disk_bandwidth": measured["fraction_of_disk_bandwidth"]}
    out = simulate(cfg, which, progress=progress)
    doc.update(report.to_json(cfg, out, args.preset))
    if args.plan:
        from luwu.simulate.plan import plan

        progress("planning optimizer nodes")
        doc["plan"] = plan(cfg)
    if args.paper:
        progress("simulating the paper's figures")
        doc["paper_comparison"] = report.paper_comparison(cfg)
    if not args.no_files:
        args.out.mkdir(parents=True, exist_ok=True)
        png = args.out / "simulate.png"
        progress("plotting the timeline")
        report.plot(out, png, f"{cfg.model.name}, {cfg.workers} workers, {args.preset}")
        doc["timeline_png"] = str(png)
        (args.out / "simulate.json").write_text(json.dumps(doc, indent=1, default=float))
    if args.json:
        print(json.dumps(doc, default=float))
        return 0
    for line in report.lines(doc):
        print(line)
    if "plan" in doc:
        for k, v in doc["plan"].items():
            print(f"plan_{k}: {v:.4g}" if isinstance(v, float) else f"plan_{k}: {v}")
    for r in doc.get("paper_comparison", []):
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ("match" if r["paper"] == r["simulated"] else "differs")
        sim = f"{r['simulated']:.4g}" if isinstance(r["simulated"], float) else r["simulated"]
        print(f"paper: {r['figure']}: paper {r['paper']}, simulated {sim}, ratio {ratio}")
    return 0
