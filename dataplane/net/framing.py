"""Framing for the local control channels (the node's control channel, the engine daemon's
socket, the emulation's NVLink stand-in): a 4-byte length, a JSON header, then the binary blobs
the header lists by size. Claims are checked before anything is allocated for them.

    send_msg(sock, {"op": "add_job", ...}, [array.data])
    header, blobs = recv_msg(sock, max_message=1 << 30)
    reader = FrameReader(sock); header, blobs = reader.recv_msg()   # buffered: one recv per burst
    reader.feed(data); msg = reader.next_msg()   # an event loop that reads the socket itself
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

LENGTH = struct.Struct("!I")
MAX_HEADER = 16 << 20  # bytes of one JSON header
GROW_CHUNK = 1 << 20  # bytes `recv_exact` allocates at a time (memory follows the bytes that arrived)


class FrameError(ValueError):
    """A frame that is not what the framing promises (not JSON, bad blob sizes)."""


class FrameTooLarge(FrameError):
    """A frame claims more bytes than the receiver accepts (nothing was allocated for it)."""


def recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes:
    """Exactly `n` bytes. ConnectionError if the peer closes first; with `eof_ok`, a close
    before the first byte returns b"" (a clean end between frames). Memory is taken as the
    bytes arrive, `GROW_CHUNK` at a time: a peer that claims a large frame and sends little
    pins little (the parts are joined once all have come)."""
    parts: list[bytearray] = []
    got = 0
    while got < n:
        part = bytearray(min(GROW_CHUNK, n - got))
        view = memoryview(part)
        filled = 0
        while filled < len(part):
            k = sock.recv_into(view[filled:])
            if not k:
                if got + filled == 0 and eof_ok:
                    return b""
                raise ConnectionError(f"peer closed the connection mid-frame ({got + filled} of {n} bytes)")
            filled += k
        parts.append(part)
        got += filled
    return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


def send_msg(sock: socket.socket, header: dict, blobs: Sequence[Any] = ()) -> None:
    """One frame: `header` (a JSON object; its `blobs` key is set to the blobs' sizes) and the blobs."""
    header = dict(header, blobs=[memoryview(b).nbytes for b in blobs])
    data = json.dumps(header).encode()
    sock.sendall(LENGTH.pack(len(data)) + data)
    for b in blobs:
        sock.sendall(memoryview(b).cast("B"))


def send_json_text(sock: socket.socket, text: str) -> None:
    """One frame with no blobs whose header is `text`, a JSON object the caller formatted itself
    (a reply of fixed shape, sent thousands of times a second: dataplane/engine/daemon.py); it must
    be what `send_msg` would send for that header, `"blobs": []` aside (readers default to none)."""
    data = text.encode()
    sock.sendall(LENGTH.pack(len(data)) + data)


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
    return _read_msg(lambda k: recv_exact(sock, k), max_message, reserve)


class FrameReader:
    """`recv_msg` for one socket through a buffer: one recv call takes every frame that has
    arrived (a worker's requests to its engine daemon come in bursts) instead of two calls per
    frame. Use one reader per socket and nothing else reading from it.

    Args:
        sock: a connected stream socket.
        chunk: bytes asked for per recv call (more when one frame needs more).

    Examples:
        >>> reader = FrameReader(sock)  # doctest: +SKIP
        >>> header, blobs = reader.recv_msg(max_message=1 << 20)
    """

    def __init__(self, sock: socket.socket, chunk: int = 1 << 16):
        self.sock = sock
        self.chunk = chunk
        self._buf = bytearray()
        self._pos = 0

    def _exact(self, n: int) -> bytes:
        while len(self._buf) - self._pos < n:
            data = self.sock.recv(max(self.chunk, n - (len(self._buf) - self._pos)))
            if not data:
                raise ConnectionError(f"peer closed the connection mid-frame ({len(self._buf) - self._pos} of {n} "
                                      "bytes)")
            if self._pos:  # drop what was consumed before growing (the buffer stays about a chunk)
                del self._buf[:self._pos]
                self._pos = 0
            self._buf += data
        out = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        return out

    def recv_msg(self, max_message: int | None = None,
                 reserve: Callable[[int], Callable[[], None]] | None = None) -> tuple[dict, list[bytes]]:
        """One frame, as the module's `recv_msg`."""
        return _read_msg(self._exact, max_message, reserve)

    def has_buffered(self) -> bool:
        """Whether bytes past the last frame handed out are buffered (read, not yet a frame)."""
        return len(self._buf) > self._pos

    def take_buffered(self) -> bytes:
        """The bytes past the last frame handed out (and forget them): what the socket's next
        reader must see first when this reader hands the socket on."""
        out = bytes(self._buf[self._pos:])
        self._buf.clear()
        self._pos = 0
        return out

    def feed(self, data: bytes) -> None:
        """Add bytes the caller received itself (an event loop that owns the socket's readiness:
        dataplane/engine/daemon.py); `next_msg` then hands out the frames they complete."""
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def next_msg(self, max_message: int | None = None) -> tuple[dict, list[bytes]] | None:
        """The next frame if `feed` has buffered all of it, else None (nothing consumed). A frame
        that cannot be one (FrameError, FrameTooLarge) raises as soon as its length or header is
        buffered, as `recv_msg` does: a garbage length is never waited for.

        Examples:
            >>> reader.feed(sock.recv(1 << 16))  # doctest: +SKIP
            >>> while (msg := reader.next_msg(max_message=1 << 20)) is not None:  # doctest: +SKIP
            ...     header, blobs = msg
        """
        start = self._pos
        buf = self._buf
        if len(buf) - start >= LENGTH.size:  # the common frame, a header with no blobs, in a few calls
            (n,) = LENGTH.unpack_from(buf, start)
            end = start + LENGTH.size + n
            if n <= min(MAX_HEADER, max_message or MAX_HEADER) and len(buf) >= end:
                try:
                    header = json.loads(buf[start + LENGTH.size:end].decode())
                except ValueError:
                    header = None  # the full path below says what is wrong with it
                if type(header) is dict:
                    blobs = header.get("blobs")
                    if blobs is None or (type(blobs) is list and not blobs):
                        self._pos = end
                        return header, []

        def buffered(n: int) -> bytes:
            if len(self._buf) - self._pos < n:
                raise _Incomplete
            out = bytes(self._buf[self._pos:self._pos + n])
            self._pos += n
            return out

        try:
            return _read_msg(buffered, max_message, None)
        except _Incomplete:
            self._pos = start
            return None


class _Incomplete(Exception):
    """`FrameReader.next_msg`: the buffered bytes end inside the frame."""


def read_msg(read: Callable[[int], bytes], max_message: int | None = None,
             reserve: Callable[[int], Callable[[], None]] | None = None) -> tuple[dict, list[bytes]]:
    """`recv_msg` over any `read(n) -> exactly n bytes` (a reader that first hands out bytes an
    event loop already took from the socket: luwu/dataplane/optimizer/control.py)."""
    return _read_msg(read, max_message, reserve)


def _read_msg(read: Callable[[int], bytes], max_message: int | None,
              reserve: Callable[[int], Callable[[], None]] | None) -> tuple[dict, list[bytes]]:
    (n,) = LENGTH.unpack(read(LENGTH.size))
    limit = MAX_HEADER if max_message is None else min(MAX_HEADER, max_message)
    if n > limit:
        raise FrameTooLarge(f"a header of {n} bytes is larger than {limit}")
    try:
        header = json.loads(read(n).decode())  # str: json skips its encoding sniffing
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
        blobs = [read(size) for size in sizes]
    finally:
        if release is not None:
            release()
    return header, blobs
