"""A ``Storage`` in memory, with failures on cue: the checkpoint component's unit tests run their
commit, retention and tidy-up on it without touching a disk, and make any one operation fail
(``fail``) to see what the component leaves behind."""

from __future__ import annotations

import errno
import fnmatch
import os
import posixpath

import xxhash

from finetune.io.storage import Entry, Stat


class MemoryStorage:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {""}
        self.failures: list[tuple[str, str, OSError]] = []  # (operation, path glob, error)
        # (operation, path): what the component did, in order
        self.calls: list[tuple[str, str]] = []
        self.free = 1 << 40

    # --- failures on cue ---------------------------------------------------------------------

    def fail(self, operation: str, pattern: str = "*", err: int = errno.EIO) -> None:
        """Every later ``operation`` on a path matching ``pattern`` raises OSError(``err``)."""
        self.failures.append((operation, pattern, OSError(err, os.strerror(err))))

    def _check(self, operation: str, rel: str) -> None:
        self.calls.append((operation, rel))
        for op, pattern, error in self.failures:
            if op == operation and fnmatch.fnmatchcase(rel, pattern):
                raise error

    def _parent_exists(self, rel: str) -> None:
        if posixpath.dirname(rel) not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", rel)

    # --- the protocol ------------------------------------------------------------------------

    def describe(self, rel: str = "") -> str:
        return f"memory://{rel}"

    def local_path(self, rel: str = "") -> None:
        return None

    def stat(self, rel: str) -> Stat | None:
        if rel in self.dirs:
            return Stat(True, 0, 0)
        if rel in self.files:
            return Stat(False, len(self.files[rel]), len(self.files[rel]))
        return None

    def list(self, rel: str = "") -> list[Entry]:
        if rel not in self.dirs:
            return []
        names = {p: False for p in self.files if posixpath.dirname(p) == rel}
        names.update({d: True for d in self.dirs if d and posixpath.dirname(d) == rel})
        return sorted(
            (Entry(posixpath.basename(p), d) for p, d in names.items()), key=lambda e: e.name
        )

    def walk(self, rel: str):
        subdirs = sorted(
            (d for d in self.dirs if d.startswith(rel + "/")), key=lambda d: -d.count("/")
        )
        for folder in [*subdirs, rel]:
            entries = self.list(folder)
            yield (
                folder,
                [e.name for e in entries if e.is_dir],
                [e.name for e in entries if not e.is_dir],
            )

    def read_bytes(self, rel: str) -> bytes | None:
        self._check("read_bytes", rel)
        return self.files.get(rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._check("write_bytes", rel)
        self._parent_exists(rel)
        if len(data) > self.free:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.files[rel] = bytes(data)

    def replace_bytes(self, rel: str, data: bytes) -> None:
        self._check("replace_bytes", rel)
        self.write_bytes(rel, data)

    def checksum(self, rel: str) -> tuple[int, str]:
        self._check("checksum", rel)
        data = self.files[rel]
        return len(data), xxhash.xxh3_128_hexdigest(data)

    def makedirs(self, rel: str) -> None:
        self._check("makedirs", rel)
        while rel and rel not in self.dirs:
            self.dirs.add(rel)
            rel = posixpath.dirname(rel)

    def rename(self, src: str, dst: str) -> None:
        self._check("rename", src)
        self._parent_exists(dst)
        if src in self.files:
            if dst in self.dirs:
                raise IsADirectoryError(errno.EISDIR, "Is a directory", dst)
            self.files[dst] = self.files.pop(src)
            return
        if src not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", src)
        if dst in self.dirs or dst in self.files:
            raise FileExistsError(errno.EEXIST, "File exists", dst)
        moved = {d for d in self.dirs if d == src or d.startswith(src + "/")}
        self.dirs -= moved
        self.dirs |= {dst + d[len(src) :] for d in moved}
        for p in [p for p in self.files if p.startswith(src + "/")]:
            self.files[dst + p[len(src) :]] = self.files.pop(p)

    def exchange(self, a: str, b: str) -> bool:
        return False  # like a filesystem without renameat2: the caller's fallback runs

    def sync(self, rel: str) -> None:
        self._check("sync", rel)

    def remove(self, rel: str) -> None:
        self._check("remove", rel)
        if rel in self.files:
            del self.files[rel]
        elif rel in self.dirs:
            if self.list(rel):
                raise OSError(errno.ENOTEMPTY, "Directory not empty", rel)
            self.dirs.discard(rel)

    def free_bytes(self) -> int:
        return self.free

    # --- for the tests -----------------------------------------------------------------------

    def put(self, rel: str, data: bytes = b"x") -> None:
        """A file as some earlier run left it (no failure checks)."""
        self.makedirs(posixpath.dirname(rel))
        self.files[rel] = data

    def tree(self) -> set[str]:
        return set(self.files)
