"""The filesystem questions the checkpoint policy asks, behind one small interface.

``LocalStorage`` is the real one; tests give the manager's policy functions a fake.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from pathlib import Path

TAG_RE = re.compile(r"^global_step(\d+)$")
LATEST = "latest"
STAGING = ".staging"


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int | None:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else None


class LocalStorage:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def tags(self) -> list[str]:
        """Checkpoint folder names under root, oldest step first (by step, never by mtime)."""
        if not self.root.is_dir():
            return []
        found = [p.name for p in self.root.iterdir() if p.is_dir() and step_of(p.name) is not None]
        return sorted(found, key=step_of)

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def read_latest(self) -> str | None:
        try:
            tag = (self.root / LATEST).read_text().strip()
        except OSError:
            return None
        return tag or None

    def write_latest(self, tag: str) -> None:
        replace_text(self.root / LATEST, tag + "\n")

    def rename(self, src: str, dst: str) -> None:
        os.rename(self.root / src, self.root / dst)
        fsync_path(self.root)

    def replace_dir(self, src: str, dst: str) -> None:
        """Put folder ``src`` at ``dst``. If ``dst`` exists, swap atomically where the OS can
        (so ``dst`` is always a complete folder), then delete the old one now at ``src``."""
        if not self.exists(dst):
            self.rename(src, dst)
            return
        if not _exchange(self.root / src, self.root / dst):
            self.rename(dst, f"{src}.replaced")  # fallback: a short window without ``dst``
            self.rename(src, dst)
            src = f"{src}.replaced"
        fsync_path(self.root)
        self.remove(src)

    def remove(self, rel: str) -> None:
        shutil.rmtree(self.root / rel, ignore_errors=True)

    def finish_staging(self) -> None:
        """Tidy ``.staging`` after a save: DeepSpeed copies its recovery scripts (zero_to_fp32.py,
        zero_to_torch.py) into the directory it saves under; they go where DeepSpeed users expect
        them, beside the checkpoints. The folder itself goes when empty."""
        staging = self.root / STAGING
        for script in staging.glob("zero_to_*.py"):
            os.replace(script, self.root / script.name)
        try:
            staging.rmdir()
        except OSError:
            pass  # not empty (another save's leftovers) or already gone: both fine

    def free_bytes(self) -> int:
        path = self.root
        while not path.exists():
            path = path.parent
        return shutil.disk_usage(path).free


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_text(path: Path, text: str) -> None:
    """Replace ``path`` atomically: temp file, fsync, rename over, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
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


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """A checkpoint folder as given, or an output dir's newest: the one its `latest` names, else
    the highest step. None when neither fits."""
    p = Path(path)
    if not p.is_dir():
        return None
    if step_of(p.name) is not None or (p / "manifest.json").exists():
        return p
    latest = LocalStorage(p).read_latest()
    if latest and (p / latest).is_dir():
        return p / latest
    tags = LocalStorage(p).tags()
    return p / tags[-1] if tags else p

