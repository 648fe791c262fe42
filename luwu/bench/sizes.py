"""Human sizes for benchmark flags: `16MiB`, `4k`, `1e6`, `123`."""

from __future__ import annotations

from luwu.dataplane.process.usage import parse_size, size  # noqa: F401 - one parser of sizes (usage.py), re-exported


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 1024)):
        if n >= scale and n % (scale // 1024 or 1) == 0:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
