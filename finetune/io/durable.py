"""Durable writes: every helper that puts bytes on disk so that they survive a crash or power loss.

fsync of files *and* of the directories that name them (a rename is durable only once its
directory is), atomic replacement of small files, and hashing while writing, so a checkpoint's
checksums cost no second read of what a rank wrote.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from pathlib import Path
from typing import BinaryIO

import xxhash

from finetune.io.progress import progress

_WRITEBACK_EVERY = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    """Linux sync_file_range(2) through libc; None elsewhere (the closing fsync still runs)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range()

_CHUNK = 8 << 20


class Writeback:
    """Starts the kernel's writeback of what was written to ``f`` every 32 MB without waiting for
    it (sync_file_range(2)), so the disk works while the writer produces the rest and the closing
    fsync has little left to do. ``write`` passes bytes through; ``wrote(n)`` counts bytes written
    to ``f`` directly. Offsets count from where ``f`` was when this began: a file opened empty."""

    def __init__(self, f: BinaryIO):
        self.f, self.size, self.kicked = f, 0, 0  # kicked: bytes already handed to writeback

    def write(self, data) -> int:
        n = self.f.write(data)
        self.wrote(n)
        return n

    def wrote(self, n: int) -> None:
        self.size += n
        if self.size - self.kicked < _WRITEBACK_EVERY:
            return
        self.f.flush()
        if _sync_file_range is not None:
            _sync_file_range(
                self.f.fileno(), self.kicked, self.size - self.kicked, _SYNC_FILE_RANGE_WRITE
            )
        self.kicked = self.size


class WriteCancelled(RuntimeError):
    """A write given up on purpose (``HashingWriter``'s ``cancelled`` was set)."""


class HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through it. ``cancelled``: when
    set, the next piece raises WriteCancelled instead of being written."""

    def __init__(
        self,
        f: BinaryIO,
        cancelled: threading.Event | None = None,
        stats: dict | None = None,
        pace=None,
    ):
        self.f, self.h, self.size, self.cancelled = f, xxhash.xxh3_128(), 0, cancelled
        # seconds spent hashing, writing and (paced) waiting, added up (a save's profile)
        self.stats = stats
        self.pace = pace  # called with each piece's size once written (a background save's Pacer)
        self.direct = getattr(f, "direct", False)
        # torch.save's C++ writer turns an exception from write() into an opaque RuntimeError;
        # keep the real one (ENOSPC, EIO…) so the report names it.
        self.os_error: OSError | None = None
        self.writeback = Writeback(f)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            # torch hands over a whole storage (often hundreds of MB) in one call: slice it so the
            # disk starts on the first slice while later ones are still being hashed and copied.
            for i in range(0, len(view), _WRITEBACK_EVERY):
                if self.cancelled is not None and self.cancelled.is_set():
                    raise WriteCancelled("the write was given up")
                piece = view[i : i + _WRITEBACK_EVERY]
                t0 = time.perf_counter()
                self.h.update(piece)
                t1 = time.perf_counter()
                self.f.write(piece)
                self.size += len(piece)
                # O_DIRECT (io/direct.py) bypasses the page cache: nothing to start
                if not self.direct:
                    self.writeback.wrote(len(piece))
                t2 = time.perf_counter()
                self._add("hash", t1 - t0)
                self._add("write", t2 - t1)
                if self.pace is not None:
                    self.pace(len(piece))
                    self._add("paced", time.perf_counter() - t2)  # waiting, not writing
            return len(view)
        except OSError as e:
            self.os_error = self.os_error or e
            raise

    def _add(self, key: str, seconds: float) -> None:
        if self.stats is not None:
            self.stats[key] = self.stats.get(key, 0.0) + seconds

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> str:
        return self.h.hexdigest()


def hash_file(path: str | os.PathLike) -> tuple[int, str]:
    """(size, xxh3-128) of a file, read in 8 MB chunks into one buffer (no new bytes object per
    chunk: 1.3x the throughput of plain reads from the page cache); counted in ``bytes_hashed``.
    Plain reads, not a memory map: a damaged medium's EIO stays an OSError, not a SIGBUS."""
    h, size = xxhash.xxh3_128(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
            with _read_back_lock:
                _read_back[0] += n
            progress()  # a verification of many GB is slow, not hung
    return size, h.hexdigest()


_read_back = [0]
_read_back_lock = threading.Lock()  # files are hashed on several threads (manifest.check_files)


def bytes_hashed() -> int:
    """Bytes this process has read back through ``hash_file`` so far (save I/O accounting)."""
    return _read_back[0]


def hash_bytes(data: bytes) -> str:
    """xxh3-128 of ``data``, as ``hash_file`` gives it for a file holding it."""
    return xxhash.xxh3_128(data).hexdigest()


def write_bytes_durably(path: str | os.PathLike, data: bytes) -> tuple[int, str]:
    """Create or truncate ``path`` with ``data`` and fsync it; (size, xxh3-128) of ``data``."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hash_bytes(data)


def write_json_durably(path: str | os.PathLike, obj) -> tuple[int, str]:
    return write_bytes_durably(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def replace_text(path: str | os.PathLike, text: str | bytes) -> None:
    """Replace ``path`` atomically: temp file, fsync, rename over, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_syncfs():
    """Linux syncfs(2) through libc; None elsewhere."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    return fn


_syncfs = _load_syncfs()


def sync_filesystem(path: str | os.PathLike) -> bool:
    """Make everything written to ``path``'s filesystem durable (file data and the directory entries
    that name it) with one syncfs(2): cheaper than an fsync of each of thousands of small files and
    their folders. False where it is unavailable (then fsync them one by one); raises OSError when
    the filesystem reports a write error."""
    if _syncfs is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if _syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)
    return True
