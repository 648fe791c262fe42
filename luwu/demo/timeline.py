"""The demo's timeline plot: one steady-state iteration of trace.json as a Gantt chart, its critical
path highlighted, and the share of the iteration each component holds on that path.

Rows, top to bottom: the critical path itself (segments coloured by component), each worker
(pull wait, forward, backward, push, push wait; gaps are untraced Python and autograd), the switch's
pipeline turns, and each optimizer node's receive / read / optimize / write / publish threads. Spans on the
path are outlined in black. The analysis is dataplane/observe/critical_path.py's; this file only draws.
"""

from __future__ import annotations

from pathlib import Path

from luwu.dataplane.observe import critical_path

COLOURS = {"pull wait": "tab:gray", "forward": "tab:blue", "backward": "tab:orange", "push": "tab:green",
           "push wait": "tab:olive", "pipeline turn": "tab:purple", "receive": "teal", "read": "tab:cyan", "optimize": "tab:red",
           "write": "tab:brown", "publish": "tab:pink", "switch": "tab:purple", "network": "lightsteelblue",
           "other / queue": "whitesmoke"}


def _colour(component: str) -> str:
    name = component.split(" ", 1)[-1] if component.split(" ", 1)[0] in ("worker", "node") else component
    return COLOURS.get(name, COLOURS["other / queue"] if name in ("other", "queue") else "black")


def plot(events: list[dict], analysis: dict, path: Path) -> Path:
    """Draw `analysis` (critical_path.analyse of `events`) to `path` (a PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = analysis["start_us"], analysis["end_us"]
    ms = lambda t: (t - lo) / 1000.0  # noqa: E731 - the x axis: milliseconds into the iteration
    rows: dict[str, list[critical_path.Span]] = {}
    for s in critical_path.spans(events):
        if s.end < lo or s.start > hi:
            continue
        row = s.process if s.role != "node" else f"{s.process}: {s.name}"
        rows.setdefault(row, []).append(s)
    stages = ["receive", "read", "optimize", "write", "publish"]
    order = sorted(rows, key=lambda r: (0 if r.startswith("worker") else 1 if r.startswith("switch") else 2,
                                        r.rsplit(": ", 1)[0], next((i for i, n in enumerate(stages)
                                                                    if r.endswith(f": {n}")), 0), r))

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(14, 1.2 + 0.45 * (len(order) + 1)),
                                   gridspec_kw={"width_ratios": [4, 1.3]})
    labels = ["critical path", *order]
    for seg in analysis["path"]:
        ax.barh(0, ms(seg["end_us"]) - ms(seg["start_us"]), left=ms(seg["start_us"]), height=0.7,
                color=_colour(seg["component"]), edgecolor="none")
    for y, row in enumerate(order, start=1):
        for s in rows[row]:
            a, b = max(s.start, lo), min(s.end, hi)
            hit = any(seg["process"] == s.process and seg["name"] == s.name and s.start <= seg["start_us"] < s.end
                      for seg in analysis["path"])
            ax.barh(y, max(ms(b) - ms(a), 0.01), left=ms(a), height=0.6, color=_colour(s.name),
                    edgecolor="black" if hit else "none", linewidth=1.2 if hit else 0)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set(xlabel=f"ms into iteration {analysis['iteration']} ({analysis['seconds'] * 1000:.1f} ms)",
           title="One steady-state iteration (outlined: on the critical path)", xlim=(0, ms(hi)))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), ncol=7, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18))

    share = sorted(analysis["share"].items(), key=lambda kv: kv[1])
    bars.barh([k for k, _ in share], [100 * v for _, v in share], color=[_colour(k) for k, _ in share],
              edgecolor="black", linewidth=0.5)
    bars.set(xlabel="% of the iteration", title="critical path by component")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
