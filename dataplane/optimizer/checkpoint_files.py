"""Checkpoint files on disk: shard records with checksums, and the manifest that makes a
checkpoint exist.

A checkpoint is a directory `ckpt-NNNNNN/` holding one record per shard (`<job>/L<layer>.S<k>.ckpt`:
the shard's header page and fp32 state, exactly as in RAM) and `manifest.json`, written last,
atomically (temp file, fsync, rename, fsync of the directory), after the records' folders are
fsynced and before the root is. A directory without a valid manifest is an interrupted checkpoint
and is never loaded. The manifest lists every file with
its size and CRC-32; a file that is missing, shorter or longer, or whose bytes do not match is
refused with `CheckpointError` naming it.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .buffers import aligned_buffer
from .errors import CheckpointError
from .layout import ShardPlan
from .shard_file import pread_full

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "luwu-optimizer-checkpoint/1"
DIR_RE = re.compile(r"^ckpt-(\d{6,})$")


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """(sequence number, path) of every checkpoint directory under root, oldest first."""
    out = []
    try:
        # scandir: the entry's type comes with the listing (d_type), not a stat per entry
        with os.scandir(root) as it:
            for entry in it:
                m = DIR_RE.match(entry.name)
                if m and entry.is_dir():
                    out.append((int(m.group(1)), Path(entry.path)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under root whose manifest was committed (interrupted ones are skipped)."""
    for _, p in reversed(checkpoint_dirs(Path(root))):
        if (p / MANIFEST).is_file():
            return p
    return None


def shard_file_name(plan: ShardPlan) -> str:
    return f"{plan.job_id}/{plan.name()}.ckpt"


def write_manifest(directory: Path, manifest: dict) -> None:
    """Commit the checkpoint in `directory`: its records' directory entries made durable first, then
    the manifest (temp file, fsync, rename), then the entries of the manifest and of the checkpoint
    itself in the root -- so a checkpoint whose manifest survives a crash has every file it names."""
    for entry in os.scandir(directory):  # the records' folders (<job>/): their files' names
        if entry.is_dir(follow_symlinks=False):
            fsync_dir(Path(entry.path))
    tmp = directory / (MANIFEST + ".tmp")
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, directory / MANIFEST)
    fsync_dir(directory)
    fsync_dir(directory.parent)  # ckpt-NNNNNN's own entry in the root


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory}: no such directory")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: no {MANIFEST} (an interrupted checkpoint; use an older one, "
                              f"e.g. latest_checkpoint() of its parent)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} is not a {MANIFEST_FORMAT} manifest")
    try:
        for job in manifest["jobs"]:
            for layer in job["state"]:
                for f in layer["shards"]:
                    int(f["bytes"]), int(f["crc32"]), str(f["file"])
                int(layer["layer_id"]), int(layer["version"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} lacks a field ({e!r})") from None
    return manifest


class RecordWriter:
    """Writes one record file in chunks (O_DIRECT when `direct()`), each chunk's write (on a
    helper thread) overlapping its CRC-32 (on the caller's), with an optional rate cap (a token
    bucket shared by every file of the writer)."""

    def __init__(self, direct: Callable[[], bool], chunk: int, rate: float | None, sleep: Callable[[float], None],
                 nice: int = 0):
        self.direct = direct  # () -> bool: decided once the node's state files exist
        self.chunk = chunk
        self.rate = rate
        self.sleep = sleep  # interruptible sleep(seconds) -> None
        self.budget_t: float | None = None
        self._made: Path | None = None  # the directory the last file went to (it exists)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="luwu-opt-ckpt-io",
                                     initializer=lower_priority, initargs=(nice,))

    def write(self, path: Path, nbytes: int, source: Callable[[], np.ndarray], lock: threading.Lock) -> int:
        """Write `nbytes` of `source()` (re-read at every chunk, under `lock`: the source may
        switch to a snapshot between chunks) to a new file, fsync it; returns the CRC-32."""
        if path.parent != self._made:  # a checkpoint's files share their directory: one mkdir for all
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made = path.parent
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = None
        if self.direct() and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                fd = None
        if fd is None:
            fd = os.open(path, flags, 0o644)
        crc = 0
        try:
            for off in range(0, nbytes, self.chunk):
                with lock:
                    # .data is memoryview(array): numpy's stubs type arrays as buffers on Python 3.12+ only
                    piece = source().reshape(-1).view(np.uint8).data[off: min(nbytes, off + self.chunk)]
                    pending = self.io.submit(_pwrite_all, fd, piece, off)
                    crc = zlib.crc32(piece, crc)
                    pending.result()
                self._throttle(len(piece))
            os.fsync(fd)
        finally:
            os.close(fd)
        return crc

    def _throttle(self, nbytes: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        if self.budget_t is None or self.budget_t < now:
            self.budget_t = now
        self.budget_t += nbytes / self.rate
        if self.budget_t > now:
            self.sleep(self.budget_t - now)

    def close(self) -> None:
        self.io.shutdown(wait=True)

def _pwrite_all(fd: int, piece: memoryview, off: int) -> None:
    done = 0
    while done < len(piece):
        done += os.pwrite(fd, piece[done:], off + done)


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority (Linux threads have their own nice value): the
    checkpoint's checksums and copies then use idle CPU before the pipeline's."""
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError):
            pass


def verify_record(directory: Path, entry: dict, plan: ShardPlan, version: int, keep: bool) -> np.ndarray | None:
    """Check one shard file against its manifest entry (size, CRC-32, header). Returns the record
    (page-aligned) when `keep`, else None. Raises CheckpointError naming the file."""
    path = directory / entry["file"]
    want = int(entry["bytes"])
    if want != plan.entry_bytes:
        raise CheckpointError(f"{path}: the manifest says {want} bytes, the job's layout needs {plan.entry_bytes}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    if size != want:
        raise CheckpointError(f"{path}: {size} bytes, expected {want} (truncated or overwritten)")
    buf = aligned_buffer(want)
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_full(fd, buf, 0)
        os.posix_fadvise(fd, 0, want, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    crc = zlib.crc32(buf.data)  # memoryview(buf); numpy's stubs type arrays as buffers on Python 3.12+ only
    if crc != int(entry["crc32"]):
        raise CheckpointError(f"{path}: CRC-32 {crc:#010x} does not match the manifest's {int(entry['crc32']):#010x} "
                              f"(the file is corrupted)")
    step = plan.read_header(buf, str(path))
    if step != version:
        raise CheckpointError(f"{path}: record holds step {step}, the manifest says version {version}")
    return buf if keep else None
