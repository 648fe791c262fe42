"""`luwu-ctl top`: one frame of per-worker lag, throughput and drops from two GetTop snapshots taken
`window` seconds apart (controller/top.py gathers them), and the rule that names a straggler.

A straggler rule that a healthy job never trips (with two equal workers each is last in about
half of the slots, with lags of an event-loop turn) and a slow worker always does:

    a rank is named the straggler of its switch when, over the window,
      - at least MIN_SLOTS slots of its sessions completed there,
      - it was last in at least max(SHARE, FAIR_FACTOR / N) of them (N: ranks on that switch;
        half the slots, and 1.5x its fair share, so with 2 ranks 75%),
      - its mean lag when last (first contribution to its own) is at least MIN_LAG, and at least
        LAG_FACTOR times the other ranks' mean lag when they were last (0 if they never were).
"""

from __future__ import annotations

MIN_SLOTS = 20
SHARE = 0.5
FAIR_FACTOR = 1.5
LAG_FACTOR = 2.0
MIN_LAG = 0.001  # seconds: below this a lag is event-loop jitter, not a slow worker
RULE = (f"last in >= max({SHARE:.0%}, {FAIR_FACTOR}/N) of >= {MIN_SLOTS} slots completed in the window, with a mean "
        f"lag >= {MIN_LAG * 1e3:g} ms and >= {LAG_FACTOR:g}x the other ranks' mean lag")
COUNTED = ("contributions", "duplicates", "last", "lag_seconds", "completed", "rx_packets", "rx_dropped",
           "tx_sim_lost")


def frame(before: dict, after: dict) -> dict:
    """The window between two GetTop snapshots: {"window_seconds", "rule", "jobs": {job: {"workers":
    {rank: row}, "switch_errors": {switch: text}, "straggler": rank or None, "why": text}}}.

    A row: switch, port, contributions_per_second, duplicates, last, completed, last_share,
    mean_lag_ms, rx_dropped, tx_sim_lost (window deltas); `error` instead when its switch could not
    be read."""
    window = max(after["time"] - before["time"], 1e-9)
    jobs = {}
    for job, now in sorted(after["jobs"].items()):
        then = before["jobs"].get(job, {}).get("workers", {})
        rows: dict[str, dict] = {}
        for rank, w in sorted(now["workers"].items(), key=lambda kv: int(kv[0])):
            row: dict = {"switch": w["switch"], "port": w["port"]}
            if "last" not in w:
                row["error"] = now["switches"].get(w["switch"], "") or "not read"
                rows[rank] = row
                continue
            old = then.get(rank, {})
            d = {f: w.get(f, 0.0) - old.get(f, 0.0) for f in COUNTED}
            row.update({"contributions_per_second": d["contributions"] / window, "duplicates": int(d["duplicates"]),
                        "last": int(d["last"]), "completed": int(d["completed"]),
                        "last_share": d["last"] / d["completed"] if d["completed"] else 0.0,
                        "mean_lag_ms": 1e3 * d["lag_seconds"] / d["last"] if d["last"] else 0.0,
                        "rx_dropped": int(d["rx_dropped"]), "tx_sim_lost": int(d["tx_sim_lost"]),
                        "_lag": d["lag_seconds"]})
            rows[rank] = row
        straggler, why = name_straggler(rows)
        for row in rows.values():
            row.pop("_lag", None)
        jobs[job] = {"workers": rows, "switch_errors": {k: v for k, v in now["switches"].items() if v},
                     "straggler": straggler, "why": why}
    return {"window_seconds": window, "rule": RULE, "jobs": jobs}


def name_straggler(rows: dict[str, dict]) -> tuple[str | None, str]:
    """(rank, why) of the job's straggler under the module's rule, or (None, why not)."""
    readable = {r: w for r, w in rows.items() if "last" in w}
    best: tuple[str | None, str] = (None, "no rank is consistently last")
    for rank, w in readable.items():
        peers = [p for r, p in readable.items() if r != rank and p["switch"] == w["switch"]]
        n = len(peers) + 1
        if n < 2:
            continue
        if w["completed"] < MIN_SLOTS:
            best = (None, f"fewer than {MIN_SLOTS} slots completed in the window") if best[0] is None else best
            continue
        share = w["last_share"]
        lag = w["_lag"] / w["last"] if w["last"] else 0.0
        other_last = sum(p["last"] for p in peers)
        other_lag = sum(p["_lag"] for p in peers) / other_last if other_last else 0.0
        if share >= max(SHARE, FAIR_FACTOR / n) and lag >= MIN_LAG and lag >= LAG_FACTOR * other_lag:
            return rank, (f"rank {rank} was last in {share:.0%} of {w['completed']} slots on {w['switch']}, "
                          f"{lag * 1e3:.1f} ms after the first contribution (others: {other_lag * 1e3:.1f} ms)")
    return best


COLUMNS = ("rank", "switch:port", "contrib/s", "dups", "last", "of slots", "share", "lag ms", "rx dropped", "tx lost")


def _cells(j: dict) -> list[tuple[list[str], str]]:
    """(cells, error) per worker row of a job's frame; error is "" for a readable row."""
    rows = []
    for rank, w in j["workers"].items():
        where = f"{w['switch']}:{w['port']}"
        if "error" in w:
            rows.append(([rank, where], w["error"]))
            continue
        rows.append(([rank, where, f"{w['contributions_per_second']:.0f}", str(w["duplicates"]), str(w["last"]),
                      str(w["completed"]), f"{w['last_share']:.0%}", f"{w['mean_lag_ms']:.1f}", str(w["rx_dropped"]),
                      str(w["tx_sim_lost"])], ""))
    return rows


def render(top: dict, console) -> None:
    """Print one frame, one table per job and its straggler line: rich tables on a terminal, plain
    aligned text (no colour, no box, nothing cut short) when the output is a pipe or a file."""
    if not console.is_terminal:
        _render_plain(top, console.file)
        return
    from rich.table import Table

    for job, j in top["jobs"].items():
        t = Table(title=f"{job}: last {top['window_seconds']:.1f} s")
        for col in COLUMNS:
            t.add_column(col, justify="right")
        for cells, error in _cells(j):
            if error:
                t.add_row(*cells, "[red]" + error[:60] + "[/red]", *[""] * 7)
            else:
                t.add_row(*cells)
        console.print(t)
        if j["straggler"] is not None:
            console.print(f"[bold yellow]straggler: rank {j['straggler']}[/bold yellow] ({j['why']})")
        else:
            console.print(f"no straggler: {j['why']}")
    if not top["jobs"]:
        console.print("no live jobs")


def _render_plain(top: dict, out) -> None:
    for job, j in top["jobs"].items():
        rows = _cells(j)
        width = [max([len(col)] + [len(cells[i]) for cells, error in rows if not error and i < len(cells)])
                 for i, col in enumerate(COLUMNS)]
        print(f"{job}: last {top['window_seconds']:.1f} s", file=out)
        print("  ".join(col.rjust(w) for col, w in zip(COLUMNS, width)), file=out)
        for cells, error in rows:
            line = "  ".join(c.rjust(w) for c, w in zip(cells, width))
            print(f"{line}  error: {error}" if error else line, file=out)
        if j["straggler"] is not None:
            print(f"straggler: rank {j['straggler']} ({j['why']})", file=out)
        else:
            print(f"no straggler: {j['why']}", file=out)
    if not top["jobs"]:
        print("no live jobs", file=out)
    out.flush()
