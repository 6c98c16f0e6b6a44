"""--remote_output_dir: every checkpoint committed in OUT copied to object storage in the
background, committed there by its manifest uploaded last, then a remote ``latest``.

Each rank uploads the files it wrote (``Checkpointer``'s writer files: its rank files and RNG; the
leader also the shared files), one checkpoint at a time, on a thread: training never waits for the
network. Offered a newer checkpoint while one uploads, a rank keeps only the newest waiting (the
one in between is skipped there, and so never complete remotely). At step boundaries, while any
upload is outstanding, one all-reduce tells every rank which checkpoints every rank has uploaded;
for the newest of those the global leader uploads ``manifest.json`` (the remote commit marker: an
object store has no rename) and then ``latest``, on its thread. A remote checkpoint without its
manifest does not exist. The same all-reduce carries the leader's "committed" back, so every rank
holds the same view: which local checkpoints are not yet confirmed remotely (retention keeps them)
and which were skipped (an event says so).

Every object carries its xxh3 in its metadata (the manifest's checksum), so the remote copy is
verified from sizes and metadata without a download. At the end of training the run waits for the
final checkpoint's remote commit (exit 1 if it failed, like a failed final save).

Every wait has a deadline: a thread without progress for --ddp_timeout on any rank gives the copy
up on every rank (``failed``: the run exits 1); the stuck thread, a daemon, is left behind.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from finetune import distributed as dist
from finetune.checkpoint_format.manifest import (
    merge_node_manifests,
    rank_of_file,
    share_of,
    stored_ranks,
)
from finetune.checkpoint_format.outdir import LATEST, MANIFEST, OutputDir, committed
from finetune.checkpoint_format.policy import newest_first
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.durable import hash_file
from finetune.io.faults import fault_point
from finetune.io.remote import CHECKSUM_KEY, RemoteError
from finetune.lease import describe
from finetune.remote.lease import RemoteLeaseLost, held_by, holder
from finetune.remote.prefix import Prefix
from finetune.remote.retention import LINEAGE_KEY, retain
from finetune.remote.tally import PollTally, TagTally

Files: TypeAlias = dict[str, tuple[int, str]]  # name → (size, xxh3)
SAVE_ID_KEY = "saveid"  # a remote manifest's metadata: the commit's save id (x-amz-meta-saveid)
NODE_MANIFEST = "manifest.node-"  # node-local storage: each node's own manifest, by first rank
# A failed copy (every try is already the client's own retries) is tried again while it is the
# newest, after RETRY_S, doubling up to MAX_RETRY_S; the final checkpoint's copy is tried this often
# before the run exits 1: 2+4+8+16+32 s between 6 tries, an outage of about a minute at the end.
FINAL_TRIES = 6
RETRY_S = 2.0
MAX_RETRY_S = 60.0
WAITING_NOTE_S = 30.0  # drain: how often it says which checkpoint it still waits for
SLOWEST_UPLOAD = float(1 << 20)  # bytes/s: a transfer's size at this rate adds to its deadline


def node_manifest_name(node: list[int]) -> str:
    """Node-local storage: the object under which a node's own manifest is uploaded."""
    return f"{NODE_MANIFEST}{node[0]}.json"


# --- the copy -------------------------------------------------------------------------------------


class RemoteCopy:
    """The running job's copy to the bucket: the trainer's side (offer, poll, drain, catch_up,
    unconfirmed; every rank calls each) and a thread per rank that uploads and, on the leader,
    commits. What the thread did reaches the trainer's side through the poll's all-reduce."""

    def __init__(
        self,
        prefix: Prefix,
        out: Path,
        leader: bool,
        limit: int | None = None,
        groups: list[list[int]] | None = None,
    ):
        """``out``: the local output dir whose committed folders are copied; ``leader``: uploads
        the manifest and ``latest`` (rank 0: on shared storage the manifest lists every rank's
        files), then applies ``limit`` (--save_total_limit) to the bucket. ``groups``: node-local
        storage's nodes (the ranks sharing each OUT); None for one shared OUT."""
        self.remote = prefix.storage
        self.out = out
        self.leader = leader
        self.limit = limit
        self.groups = groups
        self.node = next((g for g in groups if dist.rank() in g), None) if groups else None
        self.run_id = prefix.run_id
        self.lease = prefix.lease
        self.on_event: Callable[..., None] = lambda kind, step, **details: None
        self.deadline_s = dist.io_deadline()  # a copy without progress this long is given up
        # The trainer's side, the same on every rank: only calls every rank makes change it.
        self.failed: str | None = None  # why the copy was given up: the run stops, exit 1
        self.outstanding: list[str] = []  # committed locally, not remotely, oldest first
        self.failures: dict[str, int] = {}  # outstanding tag → failed tries
        self.remote_head: str | None = None  # the newest remotely committed
        # The trainer's side, this rank's own.
        self._save_ids: dict[str, str | None] = {}  # tag → its commit's save id (the thread's too)
        self._lineages: dict[str, str | None] = {}  # tag → its commit's lineage (the thread's too)
        self._files: dict[str, Files] = {}  # outstanding tag → what this rank uploads of it
        self._retry_at: dict[str, float] = {}  # failed newest → when this rank tries it again
        # Shared with the thread, under the lock.
        self._lock = threading.Condition()
        self._foreign = False  # this rank found another run's lease on the prefix
        self._waiting: tuple[str, Files] | None = None  # the newest offered, not started
        self._uploaded: dict[str, str | None] = {}  # tag → None (done) or the error
        self._commit: str | None = None  # leader: the tag whose manifest to upload next
        self._publishing: str | None = None  # leader: the tag whose manifest is uploading now
        self._committed: dict[str, str | None] = {}  # leader: tag → None (done) or the error
        # The thread's own: what it is doing (None: idle), its last sign of life, its last error.
        self._doing: str | None = None
        self._alive_at = time.monotonic()
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="remote-copy", daemon=True)
        self._thread.start()

    # --- the trainer's side: every method is called on every rank ---------------------------

    def offer(
        self,
        tag: str,
        written: Files,
        committed: Files,
        save_id: str | None = None,
        lineage: str | None = None,
    ) -> None:
        """``tag`` was committed locally: this rank uploads what it wrote of the ``committed``
        files (a consolidation dropped at the agree step is not among them). Node-local storage:
        the shared files only from rank 0 (every node's leader wrote them), and each node's
        leader its node's manifest too. A copy stuck on any rank is given up first (``failed``).
        Collective."""
        files = {name: entry for name, entry in written.items() if name in committed}
        if self.node is not None and not self.leader:
            files = {name: entry for name, entry in files.items() if rank_of_file(name) is not None}
        if self.failed is None:
            self._stalled(self.outstanding[-1] if self.outstanding else tag)
        self._offer(tag, files, save_id, lineage)

    def catch_up(self, out: OutputDir) -> None:
        """At start: OUT's newest committed checkpoint, when the bucket holds no commit as new (a
        run stopped while copying it), is copied now; objects already there with their checksum
        are not uploaded again. Decided from both sides, not from memory. Collective."""
        step = f"comparing OUT with {self.remote.describe()}"
        tag = dist.share_from(
            0, lambda: self._not_yet_copied(out), step=step, deadline_s=self.deadline_s
        )
        if tag is None:
            return

        def my_share() -> tuple[Files, str | None, str | None]:
            try:
                return self._share_of(tag, out.read_manifest(tag))
            except RemoteError:
                raise
            except Exception as e:  # noqa: BLE001 — a missing or odd manifest: every rank skips
                raise RemoteError(f"{tag}'s manifest: {type(e).__name__}: {e}") from None

        try:
            files, save_id, lineage = dist.run_agreed(my_share, step=f"reading {tag}'s manifest")
        except (RemoteError, dist.RankError) as e:  # the rank that failed, the others
            dist.log_main(
                logging.WARNING, "not copying %s to %s: %s", tag, self.remote.describe(), e
            )
            return
        dist.log_main(
            logging.INFO, "%s is not yet committed in %s: copying it", tag, self.remote.describe()
        )
        self._offer(tag, files, save_id, lineage)

    def unconfirmed(self) -> set[str]:
        """Local checkpoints retention must keep: committed here, newer than the newest remote
        commit, not yet committed there."""
        return set(self.outstanding)

    def poll(self, step: int = 0) -> None:
        """At step boundary ``step``, while anything is outstanding: one all-reduce of what every
        rank's thread did. A lost prefix stops the run (RemoteLeaseLost, exit 3); the newest
        checkpoint committed remotely is confirmed (older ones with it); a failed copy is counted
        and tried again; a checkpoint every rank uploaded is the leader's to commit. Collective."""
        if not self.outstanding:
            return
        tags = list(self.outstanding)
        seen = self._tally(tags).summed()
        if seen.lost:  # every rank alike: stop, as for a lost OUT lease (exit 3)
            raise RemoteLeaseLost(self._lost_why())
        done = [tag for tag, tally in zip(tags, seen.tags) if tally.committed]
        if done:
            self._confirmed(done[-1], tags, step)
        for tag, tally in zip(tags, seen.tags):
            if tag not in self.outstanding:
                continue  # confirmed with a newer one
            if tally.failed:
                self._failed(tag, tally.failed)
            elif tally.uploaded == dist.world_size() and self.leader:
                self._commit_next(tag)
        self._retry_due()

    def drain(self, step: int = 0, tries: int = FINAL_TRIES) -> bool:
        """At the end of training: poll until the newest checkpoint is copied, its copy failed
        ``tries`` times (each try is the client's own retries with backoff), or a rank's copy
        made no progress for ``deadline_s``: False then, and ``failed`` says why. Collective."""
        if not self.outstanding:
            return True
        newest = self.outstanding[-1]

        def waiting() -> bool:
            return bool(self.outstanding) and self.failures.get(newest, 0) < tries

        said = time.monotonic()
        while not self.failed and waiting():
            self.poll(step)
            if not waiting() or self._stalled(newest):
                break
            if time.monotonic() - said > WAITING_NOTE_S:
                said = time.monotonic()
                dist.log_main(
                    logging.INFO, "waiting for %s to reach %s", newest, self.remote.describe()
                )
            time.sleep(0.2)
        if self.remote_head == newest:
            return True
        if self.failed is None:  # its tries are spent
            self._give_up(newest, f"{tries} tries failed", dist.all_gather_object(self._last_error))
        dist.log_main(
            logging.ERROR,
            "the final checkpoint %s did not reach %s: %s",
            newest,
            self.remote.describe(),
            self.failed,
        )
        return False

    def _stalled(self, tag: str) -> bool:
        """Whether a rank's thread went ``deadline_s`` without progress: then the copy of ``tag``
        is given up on every rank alike, from what each says it is stuck on. Collective."""
        stuck = time.monotonic() - self._alive_at >= self.deadline_s
        views = dist.all_gather_object(self._doing if stuck else None)
        if not any(views):
            return False
        self._give_up(tag, f"no progress for {self.deadline_s:g} s", views)
        return True

    def _give_up(self, tag: str, why: str, views: list[str | None]) -> None:
        """``failed``, the same on every rank: ``tag``, ``why`` and each rank's view of it."""
        said = "; ".join(f"rank {r}: {view}" for r, view in enumerate(views) if view)
        self.failed = f"remote copy of {tag} did not finish: {why}" + (f" ({said})" if said else "")

    # --- what offer and catch_up hand the thread ---------------------------------------------

    def _offer(self, tag: str, files: Files, save_id: str | None, lineage: str | None) -> None:
        self._save_ids[tag] = save_id
        self._lineages[tag] = lineage
        if self.node is not None and dist.rank() == self.node[0]:
            node_manifest = hash_file(self.out / tag / MANIFEST)
            files = {**files, node_manifest_name(self.node): node_manifest}
        self.outstanding = [t for t in self.outstanding if t != tag] + [tag]
        self._files[tag] = files
        self._queue(tag)

    def _queue(self, tag: str) -> None:
        with self._lock:
            self._uploaded.pop(tag, None)
            self._waiting = (tag, self._files[tag])  # a newer offer replaces one not started
            self._lock.notify_all()

    def _not_yet_copied(self, out: OutputDir) -> str | None:
        """OUT's newest committed checkpoint, when the bucket holds no commit as new; else None."""
        local = newest_first(committed(out))
        if not local:
            return None
        there = newest_first(committed(OutputDir(self.remote)))
        if there and there[0].order_key >= local[0].order_key:
            return None
        return local[0].tag

    def _share_of(self, tag: str, manifest: dict) -> tuple[Files, str | None, str | None]:
        """What this rank uploads of the committed checkpoint ``tag`` (its ``manifest``), and the
        commit's save id and lineage."""
        listed = manifest["files"]
        if self.node is None:  # the manifest may be another world size's: split it anew
            names = share_of(listed, dist.rank(), dist.world_size())
        else:  # this node's files (the shared ones from rank 0's node), split in the node
            saved_by = (manifest.get("world_size"), stored_ranks(manifest))
            if saved_by != (dist.world_size(), self.node):
                raise RemoteError(f"{tag} was saved by another layout of ranks")
            wanted = [n for n in listed if rank_of_file(n) is not None or 0 in self.node]
            names = share_of(wanted, self.node.index(dist.rank()), len(self.node))
        files = {name: (listed[name]["size"], listed[name]["checksum"]) for name in names}
        return files, manifest.get("save_id"), manifest.get("lineage")

    # --- the poll's steps ----------------------------------------------------------------------

    def _tally(self, tags: list[str]) -> PollTally:
        """What this rank's thread has done of ``tags``, read under its lock."""
        with self._lock:
            lost = self._foreign or (self.lease is not None and self.lease.lost)
            return PollTally(int(lost), [self._tag_tally(tag) for tag in tags])

    def _tag_tally(self, tag: str) -> TagTally:
        """Called under the lock. Only the leader commits, so only it counts commits."""
        upload_error = self._uploaded.get(tag)
        commit_error = self._committed.get(tag) if self.leader else None
        return TagTally(
            uploaded=int(tag in self._uploaded and upload_error is None),
            upload_failed=int(bool(upload_error)),
            committed=int(self.leader and tag in self._committed and not commit_error),
            commit_failed=int(bool(commit_error)),
        )

    def _confirmed(self, tag: str, tags: list[str], step: int) -> None:
        """``tag`` is committed remotely: it and every older one of ``tags`` stop being
        outstanding (the older ones still outstanding were skipped: an event says so)."""
        i = tags.index(tag)
        for older in tags[:i]:
            if older in self.outstanding:
                self.on_event("remote_skipped", _step(older), tag=older, newer=tag)
        settled = tags[: i + 1]
        self.outstanding = [t for t in self.outstanding if t not in settled]
        self._files = {t: files for t, files in self._files.items() if t in self.outstanding}
        self.failures = {t: n for t, n in self.failures.items() if t in self.outstanding}
        self.remote_head = tag
        self.on_event(
            "remote_checkpoint", _step(tag), tag=tag, uri=self.remote.describe(tag), seen_at=step
        )
        dist.log_main(logging.INFO, "%s committed to %s", tag, self.remote.describe(tag))
        with self._lock:
            for t in settled:
                self._uploaded.pop(t, None)
                self._committed.pop(t, None)

    def _failed(self, tag: str, ranks: int) -> None:
        """The copy of ``tag`` failed on ``ranks`` ranks: kept locally (retention keeps what is
        not copied) and tried again while it is the newest; an older one is given up once a newer
        one is copied."""
        self.failures[tag] = self.failures.get(tag, 0) + 1
        self.on_event("remote_upload_failed", _step(tag), tag=tag, tries=self.failures[tag])
        dist.log_main(
            logging.WARNING,
            "copying %s to %s failed on %d rank(s); kept locally, trying again",
            tag,
            self.remote.describe(),
            ranks,
        )
        with self._lock:
            self._committed.pop(tag, None)
            self._uploaded.pop(tag, None)
        if tag == self.outstanding[-1]:  # tried again after a wait (the next boundaries)
            first = seams.number(seams.REMOTE_RETRY_S, RETRY_S)
            wait = min(first * 2 ** (self.failures[tag] - 1), MAX_RETRY_S)
            self._retry_at[tag] = time.monotonic() + wait

    def _commit_next(self, tag: str) -> None:
        """Leader: every rank uploaded ``tag``; its thread commits it next, unless it has or
        is doing so already."""
        with self._lock:
            if tag not in self._committed and tag not in (self._commit, self._publishing):
                self._commit = tag  # the newest complete wins
                self._lock.notify_all()

    def _retry_due(self) -> None:
        """A failed newest checkpoint whose wait is over is offered to the thread again."""
        for tag, when in list(self._retry_at.items()):
            if not self.outstanding or tag != self.outstanding[-1]:  # copied, or a newer one came
                del self._retry_at[tag]
            elif time.monotonic() >= when:  # rank-local: each rank re-uploads on its own clock
                del self._retry_at[tag]
                self._queue(tag)

    def _lost_why(self) -> str:
        try:
            other = holder(self.remote) if dist.is_main() else None
        except Exception:  # noqa: BLE001 — only for the message
            other = None
        return (
            f"another run took over {self.remote.describe()}'s lease "
            f"({describe(other) if other else 'holder unknown'}); nothing more is copied there"
        )

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            commit, upload = self._next_job()
            if commit is not None:
                self._moving(f"committing {commit}")
                error = self._guarded(self._publish, commit)
                with self._lock:
                    self._committed[commit] = error
                    self._publishing = None
            elif upload is not None:
                tag, files = upload
                self._moving(f"uploading {tag}")
                error = self._guarded(self._upload, tag, files)
                with self._lock:
                    self._uploaded[tag] = error
            self._moving(None)

    def _moving(self, doing: str | None, allow: float = 0.0) -> None:
        """The thread is alive, doing ``doing`` (None: idle), which may take ``allow`` s more."""
        self._alive_at = time.monotonic() + allow
        self._doing = doing

    def _next_job(self) -> tuple[str | None, tuple[str, Files] | None]:
        """Waits for work: (a tag to commit, None), else (None, the newest upload offered). A
        commit goes first: a manifest is small and completes a copy."""
        with self._lock:
            while self._waiting is None and self._commit is None:
                self._lock.wait()
            if self._commit is not None:
                commit = self._commit
                self._commit = None
                self._publishing = commit
                return commit, None
            upload = self._waiting
            self._waiting = None
            return None, upload

    def _guarded(self, work: Callable[..., None], *args: object) -> str | None:
        """``work(*args)``: None when it succeeded, else its error in one line."""
        try:
            work(*args)
            return None
        except Exception as e:  # noqa: BLE001 — reported through poll's all-reduce
            logger.warning("remote copy: %s: %s", type(e).__name__, e)
            self._last_error = dist.describe_error(e)
            return f"{type(e).__name__}: {e}"

    def _upload(self, tag: str, files: Files) -> None:
        if not held_by(self.remote, self.run_id):  # never over another run's objects
            self._foreign = True
            raise RemoteError(f"{self.remote.describe()}'s lease belongs to another run")
        self._uncommit_other(tag)
        for name, (size, digest) in sorted(files.items()):
            rel = f"{tag}/{name}"
            self._moving(f"uploading {rel}")
            head = self.remote.head(rel)
            if head is not None and head["ContentLength"] == size:
                if head.get("Metadata", {}).get(CHECKSUM_KEY) == digest:
                    continue  # already there (a copy resumed after an interruption)
            seams.pause(seams.SLOW_UPLOAD)
            fault_point("remote.upload", _step(tag))
            if self.node is not None and name.startswith(NODE_MANIFEST):
                local = MANIFEST  # this node's manifest, uploaded under the node's own name
            else:
                local = name
            self._moving(f"uploading {rel}", allow=size / SLOWEST_UPLOAD)  # no bytes reported
            self.remote.upload_file(self.out / tag / local, rel, digest, self._metadata(tag))

    def _metadata(self, tag: str) -> dict[str, str]:
        """What each uploaded object of ``tag`` carries besides its checksum: its commit's save id
        and lineage."""
        found = {SAVE_ID_KEY: self._save_ids.get(tag), LINEAGE_KEY: self._lineages.get(tag)}
        return {key: value for key, value in found.items() if value is not None}

    def _uncommit_other(self, tag: str) -> None:
        """Another commit of ``tag`` in the bucket (an earlier timeline's: this run resumed from an
        older checkpoint and saved this step again) is un-committed, its manifest deleted, before
        any of its objects is overwritten: a manifest never lists objects that do not match it.
        Every rank checks with one HEAD (the manifest carries its save id in its metadata: no
        rank reads the manifest, whose size grows with the world size); the delete is conditional
        on that very manifest's ETag."""
        save_id = self._save_ids.get(tag)
        head = self.remote.head(f"{tag}/{MANIFEST}") if save_id is not None else None
        if head is None:
            return
        theirs = head.get("Metadata", {}).get(SAVE_ID_KEY)
        if theirs is None:  # a manifest uploaded without it (before this key existed)
            theirs = self._save_id_inside(tag)
        if theirs != save_id and self.remote.delete_if(f"{tag}/{MANIFEST}", head["ETag"]):
            logger.warning(
                "%s in %s was another commit of that step (save %s); un-committed it before "
                "copying this run's",
                tag,
                self.remote.describe(),
                theirs,
            )

    def _save_id_inside(self, tag: str) -> str | None:
        """The save id written in ``tag``'s remote manifest (None: none, or unreadable)."""
        try:
            manifest = json.loads(self.remote.read_bytes(f"{tag}/{MANIFEST}") or b"{}")
            return manifest.get("save_id")
        except (ValueError, AttributeError):
            return None

    def _publish(self, tag: str) -> None:
        """The remote commit: the manifest, uploaded last (every file it lists is there), then
        ``latest``, then retention in the bucket."""
        if self.groups is None:
            data = (self.out / tag / MANIFEST).read_bytes()
        else:  # node-local: every node's manifest is there; the one manifest of the checkpoint
            data = self._merged(tag)
        self._ensure_lease(f"committing {tag}")
        fault_point("remote.commit", _step(tag))  # every data object of the copy has landed
        save_id = json.loads(data).get("save_id")
        metadata = {SAVE_ID_KEY: save_id} if save_id else None
        self.remote.write_bytes(f"{tag}/{MANIFEST}", data, metadata=metadata)
        self.remote.replace_bytes(LATEST, f"{tag}\n".encode())
        self._moving(f"deleting older checkpoints in {self.remote.describe()}")
        try:
            self._ensure_lease("deleting older checkpoints")
            retain(self.remote, tag, self.limit)
        except Exception as e:  # noqa: BLE001 — the copy is committed; retried after the next
            logger.warning("retention in %s: %s: %s", self.remote.describe(), type(e).__name__, e)

    def _merged(self, tag: str) -> bytes:
        """Node-local storage: the nodes' manifests (uploaded by their leaders, rank 0's node
        first) merged into the whole checkpoint's, which commits it (two phases, as a
        node-local save commits: no node's files count until every node's are there)."""
        manifests = []
        for node in self.groups or []:
            data = self.remote.read_bytes(f"{tag}/{node_manifest_name(node)}")
            if data is None:
                raise RemoteError(f"{tag}: the manifest of ranks {node} is not in the bucket")
            manifests.append(json.loads(data))
        try:
            merged = merge_node_manifests(manifests)
        except ValueError as e:
            raise RemoteError(f"{tag}: {e}") from None
        return (json.dumps(merged, indent=2) + "\n").encode()

    def _ensure_lease(self, before: str) -> None:
        """The leader re-reads the prefix's lease right before a remote commit or retention."""
        if self.lease is not None and not self.lease.check():
            raise RemoteError(
                f"{self.remote.describe()}'s lease belongs to another run; not {before}"
            )


def _step(tag: str) -> int:
    return int(tag.removeprefix("global_step")) if tag.startswith("global_step") else 0
