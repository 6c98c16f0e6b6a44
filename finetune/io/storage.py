"""Storage: the file operations a checkpoint's save, commit, retention and resume need, behind one
interface, so the policy above it is testable without a filesystem and another backend (an object
store) is one more class.

Paths are ``str``, relative to the storage's root, ``/``-separated (``.staging/global_step4``), so
an ``s3://bucket/prefix`` root is never mangled by ``pathlib``. ``""`` is the root itself. Every
write is durable when it returns: a crash afterwards keeps it. ``rename`` is atomic: a reader sees
the old name or the new one, never a half-moved folder.

``LocalStorage`` is the first implementation (a POSIX folder, shared or node-local). What DeepSpeed
and transformers write themselves (rank files, ``save_pretrained``) needs a real local folder:
``local_path`` gives it, or None for a backend that has none.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from finetune.io.durable import fsync_path, hash_file, replace_text, write_bytes_durably


@dataclass(frozen=True)
class Stat:
    is_dir: bool
    size: int  # bytes of a file; 0 for a folder
    allocated: int  # disk space it takes (blocks, what ``du`` counts); ``size`` where unknown


@dataclass(frozen=True)
class Entry:
    name: str
    is_dir: bool


@runtime_checkable
class Storage(Protocol):
    def describe(self, rel: str = "") -> str:
        """Where ``rel`` is, for messages: a path or a URI."""

    def local_path(self, rel: str = "") -> str | None:
        """A local filesystem path for ``rel`` (for DeepSpeed and transformers), or None."""

    def stat(self, rel: str) -> Stat | None:
        """None when nothing is there."""

    def list(self, rel: str = "") -> list[Entry]:
        """The children of folder ``rel``, sorted by name; [] when it is missing or unreadable."""

    def walk(self, rel: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """(folder, its subfolders, its files) for ``rel`` and each folder under it, deepest
        first (what a removal needs), folders relative to the root."""

    def read_bytes(self, rel: str) -> bytes | None:
        """A whole (small) file; None when it is missing."""

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Create or truncate a file with ``data``, durably (not atomically: see
        ``replace_bytes``)."""

    def replace_bytes(self, rel: str, data: bytes) -> None:
        """Replace a file atomically and durably: a reader sees the old content or the new."""

    def checksum(self, rel: str) -> tuple[int, str]:
        """(size, xxh3-128 hex) of a file, read in chunks (``io.progress`` counts each)."""

    def makedirs(self, rel: str) -> None:
        """Create folder ``rel`` and its parents; nothing when it exists."""

    def rename(self, src: str, dst: str) -> None:
        """Move a file or folder to a name that is free, atomically and durably."""

    def exchange(self, a: str, b: str) -> bool:
        """Swap two existing names atomically; False where the backend cannot (nothing done)."""

    def sync(self, rel: str) -> None:
        """Make what was written under ``rel`` by others (DeepSpeed, transformers) durable: an
        fsync of the file or folder."""

    def remove(self, rel: str) -> None:
        """Remove a file or an empty folder; nothing when it is missing."""

    def free_bytes(self) -> int:
        """Space left for new files."""


class LocalStorage:
    """A POSIX folder: atomic renames, fsync of files and of the folders that name them."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def describe(self, rel: str = "") -> str:
        return self._p(rel)

    def local_path(self, rel: str = "") -> str:
        return self._p(rel)

    def stat(self, rel: str) -> Stat | None:
        try:
            st = os.lstat(self._p(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        is_dir = os.path.isdir(self._p(rel)) and not os.path.islink(self._p(rel))
        blocks = getattr(st, "st_blocks", None)
        return Stat(
            is_dir, 0 if is_dir else st.st_size, st.st_size if blocks is None else blocks * 512
        )

    def list(self, rel: str = "") -> list[Entry]:
        try:
            with os.scandir(self._p(rel)) as it:
                found = [Entry(e.name, e.is_dir()) for e in it]  # a linked folder counts
        except OSError:
            return []
        return sorted(found, key=lambda e: e.name)

    def walk(self, rel: str) -> Iterator[tuple[str, list[str], list[str]]]:
        for parent, dirs, files in os.walk(self._p(rel), topdown=False):
            yield os.path.relpath(parent, self.root), dirs, files

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            with open(self._p(rel), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        write_bytes_durably(self._p(rel), data)

    def replace_bytes(self, rel: str, data: bytes) -> None:
        replace_text(self._p(rel), data)

    def checksum(self, rel: str) -> tuple[int, str]:
        return hash_file(self._p(rel))

    def makedirs(self, rel: str) -> None:
        os.makedirs(self._p(rel), exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self._p(src), self._p(dst))
        self._sync_parents(src, dst)

    def exchange(self, a: str, b: str) -> bool:
        if not _exchange(self._p(a), self._p(b)):
            return False
        self._sync_parents(a, b)
        return True

    def _sync_parents(self, src: str, dst: str) -> None:
        # A rename is durable once the folders that lost and gained the name are.
        for parent in dict.fromkeys((os.path.dirname(dst), os.path.dirname(src))):
            fsync_path(self._p(parent))

    def sync(self, rel: str) -> None:
        fsync_path(self._p(rel))

    def remove(self, rel: str) -> None:
        path = self._p(rel)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass

    def free_bytes(self) -> int:
        path = self.root
        while not os.path.exists(path):
            path = os.path.dirname(path)
        return shutil.disk_usage(path).free


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
