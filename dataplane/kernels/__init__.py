"""Which kernels run: numba-compiled ones, or the readable numpy/torch reference paths.

Shared by every package with a compiled kernel (one source for the switch). `LUWU_KERNELS`:
unset or "auto" compiles with numba when it imports; "reference" runs the reference paths only
(the compiled ones are tested bit for bit against them); "numba" insists on numba and raises
when it is missing. Compiled kernels use `cache=True` (compiled once per machine, into
`__pycache__`) and compile lazily, on first call, so nothing here costs startup time.

Loading them costs a process ~0.5 s of CPU (numba's import and LLVM). A daemon that starts beside
a worker (the engine, the loopback switch) loads them with `load_in_background`: a low-priority
thread, and until it is done `use_numba()` says False in "auto" mode, so the datapath runs the
reference path (the same bits) instead of waiting, and init_process_group does not pay for it.

With numba's cache cold (the kernels' source changed, a fresh checkout) every process of a job
would compile the same kernels at once (~4 s of CPU each: four engine processes, ~16 s on a 2-core
machine). A background load of one `name` is therefore one process's at a time per machine
(`_first_compiles`): the first takes an exclusive file lock in the kernels' `__pycache__` and
fills the cache, the others wait for it with a shared lock and then load what it cached, together.

Example:
    >>> from luwu.dataplane import kernels
    >>> fast = kernels.use_numba()   # False under LUWU_KERNELS=reference or without numba
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator

from ..process.usage import UserError

ENV = "LUWU_KERNELS"
MODES = ("auto", "numba", "reference")
BACKGROUND_NICE = 10  # niceness of a background load's thread: it takes mostly idle CPU, start-up goes first
COMPILE_WAIT = 120.0  # s a background load waits for another process's (`_first_compiles`), then loads anyway
LOCK_POLL = 0.02  # s between looks at that lock (a wait of seconds, on a background thread)

_background_lock = threading.Condition()
_background = 0  # `load_in_background` threads still running in this process
_loader = threading.local()  # .active: this thread is a background load (use_numba() stays true for it)


# CPython keeps os.environ's values in this dict (os.environ[...] = and monkeypatch.setenv update
# it): one C-level lookup per kernel call tells whether LUWU_KERNELS changed since it was parsed
_ENV_DATA: dict | None = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV) if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None
_parsed: dict[object, str] = {}  # raw value (None: unset) -> mode; a handful of entries at most


def _raw() -> object:
    if _ENV_DATA is not None and _ENV_KEY is not None:
        return _ENV_DATA.get(_ENV_KEY)
    return os.environ.get(ENV)


def mode() -> str:
    """The requested kernel mode (parsed once per value of `LUWU_KERNELS`, so tests can switch it)."""
    raw = _raw()
    m = _parsed.get(raw)
    if m is None:
        text = os.environ.get(ENV, "auto")
        m = text.strip().lower() or "auto"
        if m not in MODES:
            raise UserError(f"{ENV}={m!r}: choose one of {', '.join(MODES)}")
        _parsed[raw] = m
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
        True when numba imports and `LUWU_KERNELS` is not "reference"; in "auto" mode, False
        while a `load_in_background` of this process is still running (except in its thread).

    Raises:
        UserError: `LUWU_KERNELS` is not a known mode, or is "numba" and numba is missing.
    """
    m = _parsed.get(_raw()) or mode()  # a dict lookup per kernel call, not os.environ's Python layers
    if m == "reference":
        return False
    if m == "auto" and _background and not getattr(_loader, "active", False):
        return False  # still loading in the background: the reference path (same bits), not a stall
    if m == "numba" and not numba_available():
        raise UserError(f"{ENV}=numba but numba is not installed (pip install numba)")
    return numba_available()


def load_in_background(load: Callable[[], None], name: str = "luwu-kernels-load") -> None:
    """Run `load` (a module's `warm_up`: import numba, load the compiled kernels) on a daemon thread
    at lower priority; until it returns, `use_numba()` is False in "auto" mode.

    Args:
        load: the loading function; nothing when kernels are off (a bad LUWU_KERNELS is left for
            the first `use_numba()` on the datapath to report).
        name: the thread's name, and the machine-wide lock's (`_first_compiles`): loads of one
            name run in one process at a time until the first is done, then together.

    Example:
        >>> from luwu.dataplane.kernels import load_in_background
        >>> from luwu.dataplane.quantize import warm_up
        >>> load_in_background(warm_up)   # the engine daemon, at process start
    """
    global _background
    try:
        if mode() == "reference":
            return
    except UserError:
        return
    with _background_lock:
        _background += 1

    def run() -> None:
        global _background
        try:
            try:  # Linux: a thread's own niceness (its tid); elsewhere the thread runs at normal priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
            except (AttributeError, OSError):
                pass
            _loader.active = True
            with _first_compiles(name):
                load()
        except Exception:  # noqa: BLE001 - the datapath's own use of the kernels reports a broken numba
            pass
        finally:
            with _background_lock:
                _background -= 1
                _background_lock.notify_all()

    threading.Thread(target=run, name=name, daemon=True).start()


@contextlib.contextmanager
def _first_compiles(name: str) -> Iterator[None]:
    """Hold the machine-wide lock of background loads called `name` (a file in the kernels'
    `__pycache__`, numba's cache directory): exclusively when no other process holds it (this one
    may compile into a cold cache), else shared once the exclusive holder is done (its kernels are
    in the cache, to be loaded). Without a writable cache directory, or after COMPILE_WAIT, no lock
    (numba then compiles or loads as it would alone). The lock goes with the process if it dies."""
    import fcntl

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__", f"{name}.lock")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            deadline = time.monotonic() + COMPILE_WAIT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(LOCK_POLL)
        yield
    finally:
        os.close(fd)  # releases the lock


def wait_loaded(timeout: float) -> bool:
    """Wait until every `load_in_background` of this process is done, so that what follows runs
    the compiled kernels (benchmarks measure the steady state, not the first seconds).

    Args:
        timeout (float): seconds to wait at most.

    Returns:
        bool: True when no background load is left running.

    Example:
        >>> from luwu.dataplane import kernels
        >>> kernels.wait_loaded(60)
        True
    """
    with _background_lock:
        return _background_lock.wait_for(lambda: _background == 0, timeout)
