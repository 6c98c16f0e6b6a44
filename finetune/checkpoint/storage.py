"""The filesystem behind one interface: every file operation of the checkpoint manager and the
resume planner goes through ``LocalStorage`` (tests give the policy a fake that fails on cue).

Names under OUT that are not checkpoints, all of them out of the tag namespace:
  .staging/<tag>          a save in progress (``<tag>.replaced``: the old folder of a same-tag swap)
  .trash-<tag>-<nonce>    a checkpoint being deleted by retention (renamed first, then removed)
  .abandoned/<tag>-<id>   a checkpoint set aside, never deleted by us: a timeline a resume left
  .latest.tmp             ``latest`` being replaced
Everything but ``.abandoned`` is a crashed save's leftover once no run holds OUT's lease:
``housekeeping`` removes it at start.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from finetune.checkpoint.durable import fsync_path, replace_text

TAG_RE = re.compile(r"^global_step(\d+)$")
LATEST = "latest"
STAGING = ".staging"
TRASH = ".trash-"
ABANDONED = ".abandoned"
MANIFEST = "manifest.json"

logger = logging.getLogger("finetune")


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

    def remove(self, rel: str) -> int:
        """Delete a folder: renamed out of the tag namespace first (one atomic step, so a crash
        midway never leaves a half-deleted folder under a checkpoint's name), then removed. A
        failure to remove is logged: the trash is tidied at the next start. Returns the bytes of
        disk space it freed (allocated blocks, what ``du`` counts)."""
        path = self.root / rel
        if not path.exists():
            return 0
        trash = path
        if not rel.startswith(f"{STAGING}/"):  # under a tag name: never half-deleted in place
            trash = self.root / f"{TRASH}{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)  # raises: the caller keeps the tag and retries
        used = _tree_usage(trash)
        failures: list[str] = []
        shutil.rmtree(trash, onerror=lambda fn, p, exc: failures.append(f"{p}: {exc[1]}"))
        if failures:
            logger.warning("could not delete %s completely (%d error(s), first: %s); it is retried at the next "
                           "start", rel, len(failures), failures[0])
            return used - _tree_usage(trash)
        return used

    def remove_matching(self, rel: str, patterns: tuple[str, ...]) -> list[str]:
        """Delete the files of folder ``rel`` that match any glob of ``patterns``; their names."""
        removed = []
        for pattern in patterns:
            for path in (self.root / rel).glob(pattern):
                path.unlink()
                removed.append(path.name)
        return removed

    def read_manifest(self, tag: str) -> dict | None:
        import json

        try:
            return json.loads((self.root / tag / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def set_aside(self, tag: str, label: str) -> str:
        """Move a checkpoint out of the tag namespace into ``.abandoned`` (kept, not counted);
        returns where it went, relative to root."""
        (self.root / ABANDONED).mkdir(exist_ok=True)
        dst = f"{ABANDONED}/{Path(tag).name}-{label}"
        if self.exists(dst):
            dst = f"{dst}-{uuid.uuid4().hex[:6]}"
        self.rename(tag, dst)
        return dst

    def leftovers(self) -> list[str]:
        """What crashed saves leave behind (relative paths): staging, trash, temp files."""
        if not self.root.is_dir():
            return []
        found = [f"{STAGING}/{p.name}" for p in _children(self.root / STAGING)]
        found += [p.name for p in _children(self.root) if p.name.startswith((TRASH, ".storage-probe-"))
                  or p.name in (f".{LATEST}.tmp", "metrics.jsonl.tmp", ".exit_status.json.tmp")]
        found += [f"{t}/{p.name}" for t in self.tags() for p in _children(self.root / t) if p.name.endswith(".tmp")]
        return sorted(found)

    def housekeeping(self) -> list[tuple[str, int]]:
        """Remove every leftover of a crashed save: [(relative path, bytes freed)]. Only safe while
        this run holds OUT's lease (no other save can be in flight)."""
        removed = []
        self._rescue_committed()
        for rel in self.leftovers():
            size = _tree_bytes(self.root / rel)
            path = self.root / rel
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append((rel, size))
        staging = self.root / STAGING
        if staging.is_dir() and not any(staging.iterdir()):
            staging.rmdir()
        return removed

    def _rescue_committed(self) -> None:
        """Complete checkpoints that a crash left inside ``.staging`` are never deleted: the old
        folder of a same-tag swap (``<tag>.replaced``) goes back under its name when the new one
        never arrived; a staged folder with its manifest (committed on this storage, then the
        rename never happened, perhaps not on every node) is set aside under ``.abandoned``."""
        for path in _children(self.root / STAGING):
            if not (path / MANIFEST).is_file():
                continue
            if path.name.endswith(".replaced"):
                tag = path.name.removesuffix(".replaced")
                if step_of(tag) is not None and not self.exists(tag):
                    self.rename(f"{STAGING}/{path.name}", tag)
                    logger.warning("restored %s: a crash interrupted a same-tag swap", tag)
                    continue
            if step_of(path.name) is not None:
                where = self.set_aside(f"{STAGING}/{path.name}", "staged")
                logger.warning("set aside %s/%s, complete but never published (a crash during its commit): now %s",
                               STAGING, path.name, where)

    def finish_staging(self, saved: bool = True) -> int:
        """Tidy ``.staging`` after a save: DeepSpeed copies its recovery scripts (zero_to_fp32.py,
        zero_to_torch.py) into the directory it saves under; after a save that committed they go
        where DeepSpeed users expect them, beside the checkpoints. After a failed one (``saved``
        false) they may be truncated (a full disk): deleted, never moved over the good ones. The
        folder itself goes when empty. Returns the bytes freed (deleted scripts)."""
        staging, freed = self.root / STAGING, 0
        try:
            for script in staging.glob("zero_to_*.py"):
                if saved:
                    os.replace(script, self.root / script.name)
                else:
                    size = _tree_usage(script)
                    script.unlink()
                    freed += size
            staging.rmdir()
        except OSError:
            pass  # not empty, already gone, or a script that would not move: tidied at the next start
        return freed

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


def _children(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _tree_usage(path: Path) -> int:
    """Disk space a file or folder takes (allocated blocks, as ``du``; sizes where the filesystem
    reports no blocks); 0 for what is gone."""
    def usage(p: str) -> int:
        st = os.lstat(p)
        blocks = getattr(st, "st_blocks", None)
        return blocks * 512 if blocks is not None else st.st_size

    try:
        if not path.is_dir() or path.is_symlink():
            return usage(str(path))
    except OSError:
        return 0
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                total += usage(os.path.join(parent, name))
            except OSError:
                pass
    return total


def _tree_bytes(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass
    return total


def committed(storage: LocalStorage):
    """Every checkpoint of ``storage`` whose manifest reads, with its place in the commit order."""
    from finetune.checkpoint.policy import Committed

    out = []
    for tag in storage.tags():
        manifest = storage.read_manifest(tag)
        try:
            if manifest is not None:
                out.append(Committed.from_manifest(tag, manifest))
        except (TypeError, ValueError, AttributeError):
            pass  # a hand-edited manifest: unreadable, like a missing one
    return out


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """A checkpoint folder as given, or an output dir's newest committed checkpoint (commit order,
    not `latest` or names), else its highest step. None when ``path`` is not a folder."""
    from finetune.checkpoint.policy import resume_order

    p = Path(path)
    if not p.is_dir():
        return None
    if step_of(p.name) is not None or (p / MANIFEST).exists():
        return p
    storage = LocalStorage(p)
    order = resume_order(storage.tags(), committed(storage))
    return p / order[0] if order else p

