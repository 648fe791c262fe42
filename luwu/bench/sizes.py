"""Human sizes for benchmark flags: `16MiB`, `4k`, `1e6`, `123`."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use a number with an optional unit (B, KiB, MiB, GiB, k, M, G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 1024)):
        if n >= scale and n % (scale // 1024 or 1) == 0:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
