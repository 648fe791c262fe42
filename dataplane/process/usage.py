"""User mistakes, reported as one line: the `UserError` every command raises for bad input, the
argparse types that check flags as they are parsed, and the parser that prints one line.

`luwu` and `luwu-ctl` catch `UserError` at the top (luwu/cli.py, controller/cli.py) and print
`luwu <cmd>: <message>` with exit status 2, never a traceback. This module sits at the bottom of
the layers (it imports nothing from the project) so that daemons in every layer can use it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

USAGE_EXIT = 2  # exit status of a user mistake (argparse's own)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30}


class UserError(Exception):
    """Bad input from the user (a flag, a file, an address): the message says what to fix.

    Raised anywhere below a command's `run`; the command line prints it as one line and exits 2.
    Never raise it for a fault of the program or of the network.
    """


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`prog: message (see prog --help)`), not the
    usage block followed by the error, so that a mistake is as easy to read as any other."""

    def error(self, message: str):  # argparse's hook
        print(f"{self.prog}: {self._name_commands(message)} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(USAGE_EXIT)

    def _name_commands(self, message: str) -> str:
        """argparse says only `the following arguments are required: action` when a command (or a
        positional with choices) is missing; say which there are, as `luwu` does (luwu/cli.py)."""
        for action in self._actions:
            if not action.option_strings and action.choices and \
                    message == f"the following arguments are required: {action.metavar or action.dest}":
                what = "command" if isinstance(action, argparse._SubParsersAction) else action.dest
                return f"missing {what}: one of {', '.join(action.choices)}"
        return message


def parse_size(text: str) -> int:
    """`16MiB`, `4k`, `1e6`, `123` -> bytes (or a count). Raises ValueError saying what to write."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use a number with an optional unit (B, KiB, MiB, GiB, k, M, G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _typed(fn, name: str):
    """Wrap a checker so argparse reports its message as is (argparse hides ValueError messages)."""

    def check(text):
        try:
            return fn(text)
        except (ValueError, UserError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    check.__name__ = name
    return check


def _size(text: str) -> int:
    n = parse_size(text)
    if n <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return n


def _int_at_least(minimum: int):
    """A whole number >= `minimum` (the check behind positive_int and nonnegative_int)."""
    def check(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number") from None
        if n < minimum:
            raise ValueError(f"{n} must be >= {minimum}")
        return n
    return check


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _positive_float(text: str) -> float:
    x = _number(text)
    if not x > 0 or x == float("inf"):
        raise ValueError(f"{text} must be a positive, finite number")
    return x


def _probability(text: str) -> float:
    x = _number(text)
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{text} must be a probability in [0, 1)")
    return x


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise ValueError(f"{text}: no such file")
    if path.is_dir():
        raise ValueError(f"{text} is a directory, not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"{text}: cannot read it ({exc.strerror})") from None
    return path


def check_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); raises UserError saying what to write."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UserError(f"{what} {text!r} must be HOST:PORT with a port in 0..65535, e.g. 127.0.0.1:50051")
    return host, int(port)


def _host_port(text: str) -> str:
    check_host_port(text)
    return text


def existing_file_or_error(path, what: str) -> Path:
    """The path if it names a readable file, else a UserError naming `what` (for paths that come
    from the environment or config files rather than argparse)."""
    try:
        return _existing_file(str(path))
    except ValueError as exc:
        raise UserError(f"{what}: {exc}") from None


def pem_certificates_or_error(path, what: str) -> bytes:
    """The bytes of `path` if it is a readable PEM file with at least one X.509 certificate (a CA
    bundle), else a UserError naming `what`. Checked here, with Python's ssl module, because gRPC
    takes any bytes and reports garbage only when it connects, as several C-core log lines
    followed by an unrelated "failed to connect"."""
    import ssl

    file = existing_file_or_error(path, what)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(file))
    except ssl.SSLError as exc:
        raise UserError(f"{what} {path} is not a PEM certificate ({exc.reason or exc}): give the CA's "
                        f"certificate, the file that starts with -----BEGIN CERTIFICATE-----") from None
    return file.read_bytes()


size = _typed(_size, "size")
positive_int = _typed(_int_at_least(1), "positive_int")
nonnegative_int = _typed(_int_at_least(0), "nonnegative_int")
positive_float = _typed(_positive_float, "positive_float")
probability = _typed(_probability, "probability")
existing_file = _typed(_existing_file, "existing_file")
host_port = _typed(_host_port, "host_port")
