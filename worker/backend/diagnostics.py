"""Error messages that say what failed and what to check."""

from __future__ import annotations


class LuwuError(RuntimeError):
    """A luwu collective failed (switch unreachable, engine gone, timeout); the message says what to check."""


def _results_seen(stats: dict | None) -> int | None:
    if not stats:
        return None
    total = 0
    for key, entry in stats.items():
        if key.startswith("session ") and isinstance(entry, dict):
            total += int(entry.get("results", 0))
    return total


def engine_failure(name: str, error: BaseException, link, lease) -> LuwuError:
    dead = link.failure()
    parts = [f"luwu {name} failed: {error}."]
    if dead:
        parts.append(f"The engine is gone: {dead}.")
    parts.append(f"Check {link.describe()}; the switch: {lease.hint}{_controller(lease)}")
    return LuwuError(" ".join(parts))


def _controller(lease) -> str:
    """What the lease knows of a lost controller (a sentence with a leading space, or '')."""
    note = getattr(lease, "controller_note", None)
    return note() if note is not None else ""


def timeout_failure(name: str, seconds: float, link, lease, probe: bool = False) -> LuwuError:
    dead = link.failure()
    if dead:
        return LuwuError(f"luwu {name} did not complete within {seconds:g} s because the engine is gone: {dead}. "
                         f"Check {link.describe()}.")
    seen = _results_seen(link.stats())
    # "timeout" as a word: the term c10d's other backends use, which callers match
    what = (f"the switch at {lease.switch_address} is unreachable: no result came back from it within the timeout "
            f"of {seconds:g} s" + (" (or not every rank reached init_process_group in that time)" if probe else ""))
    if not probe and seen:
        what = (f"did not complete within the group's timeout of {seconds:g} s: the switch at {lease.switch_address} "
                "has stopped answering, or another rank is not issuing the same collectives in the same order")
    return LuwuError(f"luwu {name}: {what}. Check {lease.hint} Plan source: {lease.source}; this rank's engine: "
                     f"{link.describe()}." + ("" if probe else " The process group is unusable now.") + _controller(lease))
