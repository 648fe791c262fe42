"""Which kernels run: numba-compiled ones, or the readable numpy/torch reference paths.

Shared by every package with a compiled kernel (one source for the switch). `LUWU_KERNELS`:
unset or "auto" compiles with numba when it imports; "reference" runs the reference paths only
(the compiled ones are tested bit for bit against them); "numba" insists on numba and raises
when it is missing. Compiled kernels use `cache=True` (compiled once per machine, into
`__pycache__`) and compile lazily, on first call, so nothing here costs startup time.

Example:
    >>> from luwu.dataplane import kernels
    >>> fast = kernels.use_numba()   # False under LUWU_KERNELS=reference or without numba
"""

from __future__ import annotations

import functools
import os

from ..usage import UserError

ENV = "LUWU_KERNELS"
MODES = ("auto", "numba", "reference")


def mode() -> str:
    """The requested kernel mode (read on every call, so tests can switch it)."""
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise UserError(f"{ENV}={m!r}: choose one of {', '.join(MODES)}")
    return m


@functools.lru_cache(maxsize=1)
def numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def use_numba() -> bool:
    """Whether compiled kernels run.

    Returns:
        True when numba imports and `LUWU_KERNELS` is not "reference".

    Raises:
        UserError: `LUWU_KERNELS` is not a known mode, or is "numba" and numba is missing.
    """
    m = mode()
    if m == "reference":
        return False
    if m == "numba" and not numba_available():
        raise UserError(f"{ENV}=numba but numba is not installed (pip install numba)")
    return numba_available()
