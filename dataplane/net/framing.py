"""Framing for the local control channels (the node's control channel, the engine daemon's
socket, the emulation's NVLink stand-in): a 4-byte length, a JSON header, then the binary blobs
the header lists by size. Claims are checked before anything is allocated for them.

    send_msg(sock, {"op": "add_job", ...}, [array.data])
    header, blobs = recv_msg(sock, max_message=1 << 30)
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

LENGTH = struct.Struct("!I")
MAX_HEADER = 16 << 20  # bytes of one JSON header


class FrameError(ValueError):
    """A frame that is not what the framing promises (not JSON, bad blob sizes)."""


class FrameTooLarge(FrameError):
    """A frame claims more bytes than the receiver accepts (nothing was allocated for it)."""


def recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes:
    """Exactly `n` bytes. ConnectionError if the peer closes first; with `eof_ok`, a close
    before the first byte returns b"" (a clean end between frames)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            if got == 0 and eof_ok:
                return b""
            raise ConnectionError(f"peer closed the connection mid-frame ({got} of {n} bytes)")
        got += k
    return bytes(buf)


def send_msg(sock: socket.socket, header: dict, blobs: Sequence[Any] = ()) -> None:
    """One frame: `header` (a JSON object; its `blobs` key is set to the blobs' sizes) and the blobs."""
    header = dict(header, blobs=[memoryview(b).nbytes for b in blobs])
    data = json.dumps(header).encode()
    sock.sendall(LENGTH.pack(len(data)) + data)
    for b in blobs:
        sock.sendall(memoryview(b).cast("B"))


def recv_msg(sock: socket.socket, max_message: int | None = None,
             reserve: Callable[[int], Callable[[], None]] | None = None) -> tuple[dict, list[bytes]]:
    """One frame: (header, blobs).

    Args:
        sock: a connected stream socket.
        max_message: header and blobs together may not claim more bytes (FrameTooLarge, checked
            before allocating); None allows any blobs and a header up to MAX_HEADER.
        reserve: called with the blobs' total before they are read; may refuse (raise) or
            return the release to call once they are read.

    Returns:
        The header (a dict) and the blobs (bytes).
    """
    (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    limit = MAX_HEADER if max_message is None else min(MAX_HEADER, max_message)
    if n > limit:
        raise FrameTooLarge(f"a header of {n} bytes is larger than {limit}")
    try:
        header = json.loads(recv_exact(sock, n))
    except ValueError as e:  # JSON or UTF-8
        raise FrameError(f"a header that is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise FrameError("a header must be a JSON object")
    sizes = header.get("blobs", [])
    if not isinstance(sizes, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                              for b in sizes):
        raise FrameError("`blobs` must list non-negative byte counts")
    total = sum(sizes)
    if max_message is not None and n + total > max_message:
        raise FrameTooLarge(f"a message of {n + total} bytes is larger than this receiver accepts ({max_message})")
    release = reserve(total) if reserve is not None and total else None
    try:
        blobs = [recv_exact(sock, size) for size in sizes]
    finally:
        if release is not None:
            release()
    return header, blobs
