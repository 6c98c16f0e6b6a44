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
import shutil
import threading
import uuid
from pathlib import Path

from finetune.checkpoint.policy import TAG_RE, Committed, resume_order, step_of, tag_for  # noqa: F401
from finetune.io.durable import fsync_path, replace_text
from finetune.io.progress import progress

LATEST = "latest"
STAGING = ".staging"
TRASH = ".trash-"
ABANDONED = ".abandoned"
MANIFEST = "manifest.json"
UNIVERSAL_TMP = "universal.tmp"  # an interrupted universal conversion's pieces (universal.py): kept

logger = logging.getLogger("finetune")


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
        return self.purge(self.retire(rel) if not rel.startswith(f"{STAGING}/") else rel)

    def retire(self, rel: str) -> str:
        """Rename a folder under a tag name out of the tag namespace (``.trash-<tag>-<nonce>``), the
        one atomic step of a deletion; its path relative to root. Raises: the caller keeps the tag."""
        trash = f"{TRASH}{Path(rel).name}-{uuid.uuid4().hex[:8]}"
        os.rename(self.root / rel, self.root / trash)
        return trash

    def purge(self, rel: str, stop: threading.Event | None = None, on_file=None) -> int:
        """Remove a folder already out of the tag namespace, file by file, until ``stop`` is set;
        the bytes freed. ``on_file`` is called after each file (default: ``progress.progress``,
        so a polled step's deadline counts from the last file removed). Failures are logged: what
        is left is tidied at the next start."""
        on_file = on_file or progress

        root = self.root / rel
        freed, failures = 0, []
        if not root.is_dir() or root.is_symlink():
            freed = _tree_usage(root)
            try:
                root.unlink(missing_ok=True)
            except OSError as e:
                failures.append(f"{root}: {e}")
                freed = 0
        else:
            for parent, dirs, files in os.walk(root, topdown=False):
                for name in files:
                    if stop is not None and stop.is_set():
                        return freed
                    path = os.path.join(parent, name)
                    size = _tree_usage(Path(path))
                    try:
                        os.unlink(path)
                        freed += size
                    except OSError as e:
                        failures.append(f"{path}: {e}")
                    on_file()
                for name in dirs:
                    try:
                        os.rmdir(os.path.join(parent, name))
                    except OSError as e:
                        failures.append(f"{os.path.join(parent, name)}: {e}")
            try:
                os.rmdir(root)
            except OSError as e:
                failures.append(f"{root}: {e}")
        if failures:
            logger.warning("could not delete %s completely (%d error(s), first: %s); it is retried at the next "
                           "start", rel, len(failures), failures[0])
        return freed

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
        # <tag>/universal.tmp is kept: an interrupted conversion's finished pieces (universal.py).
        found += [f"{t}/{p.name}" for t in self.tags() for p in _children(self.root / t)
                  if p.name.endswith(".tmp") and p.name != UNIVERSAL_TMP]
        return sorted(found)

    def housekeeping(self) -> list[tuple[str, int]]:
        """Remove every leftover of a crashed save: [(relative path, bytes freed)]. Only safe while
        this run holds OUT's lease (no other save can be in flight)."""
        removed = []
        self._rescue_committed()
        for rel in self.leftovers():
            size = _tree_bytes(self.root / rel)
            self.purge(rel)  # file by file: each one is progress for the start-up step's deadline
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
    p = Path(path)
    if not p.is_dir():
        return None
    if step_of(p.name) is not None or (p / MANIFEST).exists():
        return p
    storage = LocalStorage(p)
    order = resume_order(storage.tags(), committed(storage))
    return p / order[0] if order else p



class Deleter:
    """Retention's deletions, off the critical path: a leader's thread removes folders already
    renamed out of the tag namespace (``LocalStorage.retire``), one at a time, while training goes
    on. ``pending_bytes``: what the queued deletions will free (the next free-space check counts
    on it); ``wait`` blocks until they are done; ``stop`` ends them at the next file (a run that
    lost its output dir's lease touches nothing more). A crash leaves ``.trash-*`` folders, which
    the next start removes."""

    def __init__(self, storage: LocalStorage):
        self.storage = storage
        self.queue: list[tuple[str, int, str]] = []  # (trash path, bytes it holds, tag it was)
        self.lock = threading.Lock()
        self.idle = threading.Event()
        self.idle.set()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.files_deleted = 0  # progress, for ``drain``

    @property
    def pending_bytes(self) -> int:
        with self.lock:
            return sum(n for _, n, _ in self.queue)

    def add(self, trash: str, nbytes: int, tag: str) -> None:
        with self.lock:
            self.queue.append((trash, nbytes, tag))
            self.idle.clear()
            if self.thread is None:  # (a thread that ran out of work cleared it, under this lock)
                self.thread = threading.Thread(target=self._run, name="finetune-retention", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                if not self.queue:
                    self.idle.set()
                    self.thread = None  # the next add() starts another
                    return
                trash, _, tag = self.queue[0]
            try:
                freed = self.storage.purge(trash, self.stopped, on_file=self._deleted_one)
            except Exception as e:  # noqa: BLE001 — a thread of its own: logged, tidied at the next start
                logger.warning("could not delete %s (%s: %s); it is retried at the next start", trash,
                               type(e).__name__, e)
                freed = 0
            with self.lock:
                self.queue.pop(0)
            if not self.stopped.is_set():
                logger.info("save_total_limit: deleted %s (%.2f MB freed)", tag, freed / 1e6)
        self.idle.set()

    def _deleted_one(self) -> None:
        self.files_deleted += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued deletion is done (True) or ``timeout`` passed (False)."""
        return self.idle.wait(timeout)

    def drain(self) -> None:
        """Inside an agreed step: wait until the queued deletions are done, each file deleted
        counting as the step's progress (a hung mount makes none: the step's deadline ends it)."""
        seen = self.files_deleted
        while not self.idle.wait(0.5):
            if self.files_deleted != seen:
                seen = self.files_deleted
                progress()

    def stop(self) -> None:
        self.stopped.set()
