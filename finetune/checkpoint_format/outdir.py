"""The output dir as the checkpoint code sees it (``OutputDir``): checkpoint folders, ``latest``,
staging, trash and what crashes leave, every operation through a ``Storage`` (io/storage.py), so
the policy is tested on an in-memory storage that fails on cue (tests/memory_storage.py).

Names under OUT that are not checkpoints, all of them out of the tag namespace:
  .staging/<tag>          a save in progress (``<tag>.replaced``: the old folder of a same-tag swap)
  .trash-<tag>-<nonce>    a checkpoint being deleted by retention (renamed first, then removed)
  .abandoned/<tag>-<id>   a checkpoint set aside, never deleted by us: a timeline a resume left
  .latest.tmp             ``latest`` being replaced
Everything but ``.abandoned`` is a crashed save's leftover once no run holds OUT's lease:
``housekeeping`` removes it at start.

Used by every reader and writer of OUT: the online component (checkpoint/: staging, commit,
retention, resume), the bucket (remote/, over an S3Storage), the exports and ``finetune verify``,
``finetune ls`` and ``finetune plot``, and the flag checks that find a checkpoint to resume.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import posixpath
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import xxhash

from finetune.checkpoint_format.manifest import MANIFEST, build_manifest
from finetune.checkpoint_format.policy import (
    TAG_RE,  # noqa: F401
    Committed,
    resume_order,
    step_of,
    tag_for,  # noqa: F401
)
from finetune.io.faults import fault_point
from finetune.io.progress import progress
from finetune.io.storage import LocalStorage, Storage

LATEST = "latest"
STAGING = ".staging"
TRASH = ".trash-"
ABANDONED = ".abandoned"
# an interrupted universal conversion's pieces (weights/universal.py): kept
UNIVERSAL_TMP = "universal.tmp"

logger = logging.getLogger("finetune")


class OutputDir:
    """OUT as the checkpoint code sees it: checkpoint folders, ``latest``, staging, trash, what a
    crash leaves; every operation through a ``Storage`` (``io/storage.py``).

    Built from a Storage, or from a local folder (a ``LocalStorage`` of it).
    """

    def __init__(self, root: str | os.PathLike | Storage):
        self.storage: Storage = root if isinstance(root, Storage) else LocalStorage(root)
        local = self.storage.local_path()
        # The local folder DeepSpeed and transformers write in, and messages name.
        self.root = Path(local) if local is not None else Path(self.storage.describe())

    def tags(self) -> list[str]:
        """Checkpoint folder names under root, oldest step first (by step, never by mtime)."""
        found = [e.name for e in self.storage.list() if e.is_dir and step_of(e.name) is not None]
        return sorted(found, key=step_of)

    def exists(self, rel: str) -> bool:
        return self.storage.stat(rel) is not None

    def is_file(self, rel: str) -> bool:
        st = self.storage.stat(rel)
        return st is not None and not st.is_dir

    def read_latest(self) -> str | None:
        try:
            data = self.storage.read_bytes(LATEST)
        except OSError:
            return None
        tag = data.decode(errors="replace").strip() if data is not None else ""
        return tag or None

    def write_latest(self, tag: str) -> None:
        self.storage.replace_bytes(LATEST, f"{tag}\n".encode())

    def rename(self, src: str, dst: str) -> None:
        self.storage.rename(src, dst)

    def replace_dir(self, src: str, dst: str) -> None:
        """Put folder ``src`` at ``dst``. If ``dst`` exists, swap atomically where the storage can
        (so ``dst`` is always a complete folder), then delete the old one now at ``src``."""
        if not self.exists(dst):
            self.rename(src, dst)
            return
        if not self.storage.exchange(src, dst):
            self.rename(dst, f"{src}.replaced")  # fallback: a short window without ``dst``
            self.rename(src, dst)
            src = f"{src}.replaced"
        self.remove(src)

    def remove(self, rel: str) -> int:
        """Delete a folder: renamed out of the tag namespace first (one atomic step, so a crash
        midway never leaves a half-deleted folder under a checkpoint's name), then removed. A
        failure to remove is logged: the trash is tidied at the next start. Returns the bytes of
        disk space it freed (allocated blocks, what ``du`` counts)."""
        if not self.exists(rel):
            return 0
        return self.purge(self.retire(rel) if not rel.startswith(f"{STAGING}/") else rel)

    def retire(self, rel: str) -> str:
        """Rename a folder under a tag name out of the tag namespace (``.trash-<tag>-<nonce>``), the
        one atomic step of a deletion; its path relative to root. Raises: the
        caller keeps the tag."""
        trash = f"{TRASH}{posixpath.basename(rel)}-{uuid.uuid4().hex[:8]}"
        self.rename(rel, trash)
        return trash

    def purge(
        self,
        rel: str,
        stop: threading.Event | None = None,
        on_file: Callable[[], None] | None = None,
    ) -> int:
        """Remove a folder already out of the tag namespace, file by file, until ``stop`` is set;
        the bytes freed. ``on_file`` is called after each file (default: ``progress.progress``,
        so a polled step's deadline counts from the last file removed). Failures are logged: what
        is left is tidied at the next start."""
        on_file = on_file or progress
        st = self.storage.stat(rel)
        if st is None:
            return 0
        freed = 0
        failures: list[str] = []
        if not st.is_dir:
            failures += self._remove_one(rel)
            freed = 0 if failures else st.allocated
        else:
            for parent, dirs, files in self.storage.walk(rel):
                for name in files:
                    if stop is not None and stop.is_set():
                        return freed
                    path = posixpath.join(parent, name)
                    size = self.usage(path)
                    failed = self._remove_one(path)
                    freed += 0 if failed else size
                    failures += failed
                    on_file()
                for name in dirs:
                    failures += self._remove_one(posixpath.join(parent, name))
            failures += self._remove_one(rel)
        if failures:
            logger.warning(
                "could not delete %s completely (%d error(s), first: %s); "
                "it is retried at the next start",
                rel,
                len(failures),
                failures[0],
            )
        return freed

    def _remove_one(self, rel: str) -> list[str]:
        try:
            self.storage.remove(rel)
        except OSError as e:
            return [f"{self.storage.describe(rel)}: {e}"]
        return []

    def usage(self, rel: str, allocated: bool = True) -> int:
        """Disk space a file or folder takes (``allocated``: blocks, as ``du``; else the files'
        sizes); 0 for what is gone."""
        st = self.storage.stat(rel)
        if st is None:
            return 0
        if not st.is_dir:
            return st.allocated if allocated else st.size
        total = 0
        for parent, _, files in self.storage.walk(rel):
            for name in files:
                one = self.storage.stat(posixpath.join(parent, name))
                if one is not None:
                    total += one.allocated if allocated else one.size
        return total

    def remove_matching(self, rel: str, patterns: tuple[str, ...]) -> list[str]:
        """Delete the files of folder ``rel`` that match any glob of ``patterns``; their names."""
        removed = []
        for pattern in patterns:
            for entry in self.storage.list(rel):
                if not entry.is_dir and fnmatch.fnmatchcase(entry.name, pattern):
                    self.storage.remove(f"{rel}/{entry.name}")
                    removed.append(entry.name)
        return removed

    def write_json(self, rel: str, obj: object) -> tuple[int, str]:
        """A JSON file written durably (sorted keys, indented); its (size, xxh3-128)."""
        data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
        self.storage.write_bytes(rel, data)
        return len(data), xxhash.xxh3_128_hexdigest(data)

    def read_manifest(self, tag: str) -> dict | None:
        try:
            data = self.storage.read_bytes(f"{tag}/{MANIFEST}")
            return json.loads(data) if data is not None else None
        except (OSError, ValueError):
            return None

    def set_aside(self, tag: str, label: str) -> str:
        """Move a checkpoint out of the tag namespace into ``.abandoned`` (kept, not counted);
        returns where it went, relative to root."""
        self.storage.makedirs(ABANDONED)
        dst = f"{ABANDONED}/{posixpath.basename(tag)}-{label}"
        if self.exists(dst):
            dst = f"{dst}-{uuid.uuid4().hex[:6]}"
        self.rename(tag, dst)
        return dst

    def leftovers(self) -> list[str]:
        """What crashed saves leave behind (relative paths): staging, trash, temp files."""
        found = [f"{STAGING}/{e.name}" for e in self.storage.list(STAGING)]
        found += [
            e.name
            for e in self.storage.list()
            if e.name.startswith((TRASH, ".storage-probe-"))
            or e.name in (f".{LATEST}.tmp", "metrics.jsonl.tmp", ".exit_status.json.tmp")
        ]
        # <tag>/universal.tmp is kept: an interrupted conversion's pieces (weights/universal.py).
        found += [
            f"{t}/{e.name}"
            for t in self.tags()
            for e in self.storage.list(t)
            if e.name.endswith(".tmp") and e.name != UNIVERSAL_TMP
        ]
        return sorted(found)

    def housekeeping(self) -> list[tuple[str, int]]:
        """Remove every leftover of a crashed save: [(relative path, bytes freed)]. Only safe while
        this run holds OUT's lease (no other save can be in flight)."""
        removed = []
        self._rescue_committed()
        for rel in self.leftovers():
            size = self.usage(rel, allocated=False)
            self.purge(rel)  # file by file: each one is progress for the start-up step's deadline
            removed.append((rel, size))
        if self.exists(STAGING) and not self.storage.list(STAGING):
            self.storage.remove(STAGING)
        return removed

    def _rescue_committed(self) -> None:
        """Complete checkpoints that a crash left inside ``.staging`` are never deleted: the old
        folder of a same-tag swap (``<tag>.replaced``) goes back under its name when the new one
        never arrived; a staged folder with its manifest (committed on this storage, then the
        rename never happened, perhaps not on every node) is set aside under ``.abandoned``."""
        for entry in self.storage.list(STAGING):
            manifest = self.storage.stat(f"{STAGING}/{entry.name}/{MANIFEST}")
            if manifest is None or manifest.is_dir:
                continue
            if entry.name.endswith(".replaced"):
                tag = entry.name.removesuffix(".replaced")
                if step_of(tag) is not None and not self.exists(tag):
                    self.rename(f"{STAGING}/{entry.name}", tag)
                    logger.warning("restored %s: a crash interrupted a same-tag swap", tag)
                    continue
            if step_of(entry.name) is not None:
                where = self.set_aside(f"{STAGING}/{entry.name}", "staged")
                logger.warning(
                    "set aside %s/%s, complete but never published (a crash during its commit): "
                    "now %s",
                    STAGING,
                    entry.name,
                    where,
                )

    def finish_staging(self, saved: bool = True) -> int:
        """Tidy ``.staging`` after a save: DeepSpeed copies its recovery scripts (zero_to_fp32.py,
        zero_to_torch.py) into the directory it saves under; after a save that committed they go
        where DeepSpeed users expect them, beside the checkpoints. After a failed one (``saved``
        false) they may be truncated (a full disk): deleted, never moved over the good ones. The
        folder itself goes when empty. Returns the bytes freed (deleted scripts)."""
        freed = 0
        try:
            for entry in self.storage.list(STAGING):
                if entry.is_dir or not fnmatch.fnmatchcase(entry.name, "zero_to_*.py"):
                    continue
                if saved:
                    self.rename(f"{STAGING}/{entry.name}", entry.name)  # over the older copy
                else:
                    size = self.usage(f"{STAGING}/{entry.name}")
                    self.storage.remove(f"{STAGING}/{entry.name}")
                    freed += size
            self.storage.remove(STAGING)
        except OSError:
            pass  # not empty, or a script that would not move: tidied at the next start
        return freed

    def free_bytes(self) -> int:
        return self.storage.free_bytes()

    # --- a leader's commit: the manifest into staging, then the rename and `latest` ----------
    # Each step is atomic; a crash between any two leaves `latest` naming a complete checkpoint
    # (the old one, or the new one once in place). The Checkpointer runs the two phases as separate
    # agreed steps so that node-local storage publishes only after every node prepared.

    def commit(
        self,
        tag: str,
        files: dict[str, tuple[int, str]],
        world_size: int,
        versions: dict,
        ranks: list[int] | None = None,
        identity: dict | None = None,
    ) -> None:
        """Both phases, for one storage: ``prepare_commit`` then ``publish``."""
        self.prepare_commit(tag, files, world_size, versions, ranks, identity)
        self.publish(tag)

    def prepare_commit(
        self,
        tag: str,
        files: dict[str, tuple[int, str]],
        world_size: int,
        versions: dict,
        ranks: list[int] | None = None,
        identity: dict | None = None,
    ) -> None:
        """The manifest, written *inside* the staged folder before the rename, so the folder never
        appears under its final name without the file that marks it complete. ``ranks``: the ranks
        whose files this storage holds (node-local storage); None = all of them. ``identity``: the
        commit sequence number, save id and parent."""
        staged = f"{STAGING}/{tag}"
        fault_point("commit.manifest", step_of(tag))
        manifest = build_manifest(tag, files, world_size, versions, ranks, identity)
        try:
            self.write_json(f"{staged}/{MANIFEST}", manifest)
        except OSError as e:
            if e.filename is None and e.errno is not None:  # a failed write names no file: name it
                path = self.storage.describe(f"{staged}/{MANIFEST}")
                raise OSError(e.errno, e.strerror, path) from e
            raise
        self.storage.sync(staged)  # the manifest's name in the folder is durable too

    def publish(self, tag: str, given_up: threading.Event | None = None) -> None:
        """Rename the staged folder into place, then ``latest``. ``given_up``: set when the agreed
        step gave up waiting for this (a rename stuck on a hung mount past its deadline): a rename
        that completes later leaves ``latest`` alone (the commit order still finds the folder)."""
        # Never overwrite in place: a folder of the same step (an abandoned timeline's) is swapped.
        fault_point("commit.rename", step_of(tag))
        if self.exists(tag) and not self.exists(f"{tag}/{MANIFEST}"):
            # Not committed by finetune (a plain DeepSpeed save, a hand copy): kept, not replaced.
            where = self.set_aside(tag, "no-manifest")
            logger.warning(
                "set aside %s, which has no %s (not committed by finetune), "
                "as %s before committing %s there",
                tag,
                MANIFEST,
                where,
                tag,
            )
        self.replace_dir(f"{STAGING}/{tag}", tag)
        if given_up is not None and given_up.is_set():
            return
        fault_point("commit.latest", step_of(tag))
        self.write_latest(tag)
        self.finish_staging()


def committed(storage: OutputDir) -> list[Committed]:
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


def uncommitted(storage: OutputDir, found: list[Committed]) -> list[str]:
    """The checkpoint folders of ``storage`` that are not among ``found`` (``committed``'s): no
    readable manifest."""
    names = {c.tag for c in found}
    return [t for t in storage.tags() if t not in names]


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """A checkpoint folder as given, or an output dir's newest committed checkpoint (commit order,
    not `latest` or names), else its highest step. None when ``path`` is not a folder."""
    p = Path(path)
    if not p.is_dir():
        return None
    if step_of(p.name) is not None or (p / MANIFEST).exists():
        return p
    storage = OutputDir(p)
    order = resume_order(storage.tags(), committed(storage))
    return p / order[0] if order else p


class Deleter:
    """Retention's deletions, off the critical path: a leader's thread removes folders already
    renamed out of the tag namespace (``OutputDir.retire``), one at a time, while training goes
    on. ``pending_bytes``: what the queued deletions will free (the next free-space check counts
    on it); ``wait`` blocks until they are done; ``stop`` ends them at the next file (a run that
    lost its output dir's lease touches nothing more). A crash leaves ``.trash-*`` folders, which
    the next start removes."""

    def __init__(self, storage: OutputDir):
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
                self.thread = threading.Thread(
                    target=self._run, name="finetune-retention", daemon=True
                )
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
            except Exception as e:  # noqa: BLE001
                # a thread of its own: logged, tidied at the next start
                logger.warning(
                    "could not delete %s (%s: %s); it is retried at the next start",
                    trash,
                    type(e).__name__,
                    e,
                )
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
