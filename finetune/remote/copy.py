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
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from finetune import distributed as dist
from finetune.checkpoint_format.manifest import (
    merge_node_manifests,
    rank_of_file,
    share_of,
    stored_ranks,
)
from finetune.checkpoint_format.outdir import LATEST, MANIFEST, OutputDir, committed, uncommitted
from finetune.checkpoint_format.policy import newest_first, select_for_deletion, step_of
from finetune.config import ConfigError
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.durable import hash_file
from finetune.io.faults import fault_point
from finetune.io.remote import CHECKSUM_KEY, RemoteError, S3Storage
from finetune.lease import describe
from finetune.remote.lease import RemoteLease, RemoteLeaseLost, held_by, holder
from finetune.remote.lease import acquire as acquire_remote_lease

FILES = dict[str, tuple[int, str]]  # name → (size, xxh3)
SAVE_ID_KEY = "saveid"  # a remote manifest's metadata: the commit's save id (x-amz-meta-saveid)
# A failed copy (every try is already the client's own retries) is tried again while it is the
# newest, after RETRY_S, doubling up to MAX_RETRY_S; the final checkpoint's copy is tried this often
# before the run exits 1: 2+4+8+16+32 s between 6 tries, an outage of about a minute at the end.
FINAL_TRIES = 6
RETRY_S = 2.0
MAX_RETRY_S = 60.0


@dataclass
class Prefix:
    """``--remote_output_dir`` opened: its storage, and (rank 0) this run's lease on it."""

    storage: S3Storage
    run_id: str
    lease: RemoteLease | None = None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


def open_remote(uri: str, run_id: str) -> Prefix:
    """The remote storage, after every rank wrote, read back and deleted a probe object under it
    (a wrong bucket, endpoint or credential is exit 2 naming the flag, before training), and rank
    0 took the prefix's lease (another live run there is exit 2 naming it). Agreed: every rank
    probes (each uploads its own files), all fail alike. Collective."""

    def probe() -> S3Storage:
        try:
            remote = S3Storage(uri)
            rel = f".probe-{run_id}-{dist.rank()}"
            remote.write_bytes(rel, b"finetune probe\n")
            if remote.read_bytes(rel) != b"finetune probe\n":
                raise RemoteError("a probe object read back different bytes")
            remote.remove(rel)
            return remote
        except RemoteError as e:
            raise ConfigError(f"--remote_output_dir {uri}: {e}") from None
        except Exception as e:  # noqa: BLE001 — the client's errors (credentials, endpoint, bucket)
            raise ConfigError(
                f"--remote_output_dir {uri}: cannot write there ({_why(e)})"
            ) from None

    storage = dist.run_agreed(probe, step="checking --remote_output_dir")

    def take() -> RemoteLease:
        try:
            return acquire_remote_lease(storage, run_id)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 — the client's errors
            raise ConfigError(
                f"--remote_output_dir {uri}: cannot take its lease ({_why(e)})"
            ) from None

    lease = dist.run_agreed(take, on=dist.is_main(), step="taking --remote_output_dir's lease")
    return Prefix(storage, run_id, lease)


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class NoRemoteCopy:
    """No --remote_output_dir: nothing to copy, nothing kept for it."""

    def offer(self, tag: str, written: FILES, committed: FILES, save_id: str | None = None) -> None:
        pass

    def unconfirmed(self) -> set[str]:
        return set()

    def poll(self, step: int = 0) -> None:
        pass

    def drain(self, step: int = 0) -> bool:
        return True


def node_manifest_name(node: list[int]) -> str:
    """Node-local storage: the object under which a node's own manifest is uploaded."""
    return f"manifest.node-{node[0]}.json"


class RemoteCopy:
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
        self.remote, self.out, self.leader, self.limit = prefix.storage, out, leader, limit
        self.groups = groups
        self.node = next((g for g in groups if dist.rank() in g), None) if groups else None
        self.run_id, self.lease = prefix.run_id, prefix.lease
        self._foreign = False  # this rank found another run's lease on the prefix
        self._save_ids: dict[str, str | None] = {}  # tag → the local commit's save id
        self._retry_at: dict[str, float] = {}  # failed newest → when this rank tries it again
        self.outstanding: list[str] = []  # committed locally, not remotely; the same on every rank
        self._files: dict[str, FILES] = {}  # outstanding tag → what this rank uploads of it
        self.failures: dict[str, int] = {}  # outstanding tag → failed tries (every rank alike)
        self.remote_head: str | None = None  # the newest remotely committed, every rank alike
        self.on_event: Callable[..., None] = lambda kind, step, **fields: None
        self._lock = threading.Condition()
        self._waiting: tuple[str, FILES] | None = None  # the newest offered, not started
        self._uploaded: dict[str, str | None] = {}  # tag → None (done) or the error
        self._commit: str | None = None  # leader: the tag whose manifest to upload next
        self._publishing: str | None = None  # leader: the tag whose manifest is uploading now
        self._committed: dict[str, str | None] = {}  # leader: tag → None (done) or the error
        self._thread = threading.Thread(target=self._run, name="remote-copy", daemon=True)
        self._thread.start()

    # --- the trainer's side: every method is called on every rank ---------------------------

    def offer(self, tag: str, written: FILES, committed: FILES, save_id: str | None = None) -> None:
        """``tag`` was committed locally: this rank uploads what it wrote of the ``committed``
        files (a consolidation dropped at the agree step is not among them). Node-local storage:
        the shared files only from rank 0 (every node's leader wrote them), and each node's
        leader its node's manifest too."""
        files = {n: v for n, v in written.items() if n in committed}
        if self.node is not None and not self.leader:
            files = {n: v for n, v in files.items() if rank_of_file(n) is not None}
        self._offer(tag, files, save_id)

    def _offer(self, tag: str, files: FILES, save_id: str | None) -> None:
        self._save_ids[tag] = save_id
        if self.node is not None and dist.rank() == self.node[0]:
            files = {**files, node_manifest_name(self.node): hash_file(self.out / tag / MANIFEST)}
        self.outstanding = [t for t in self.outstanding if t != tag] + [tag]
        self._files[tag] = files
        self._queue(tag)

    def _queue(self, tag: str) -> None:
        with self._lock:
            self._uploaded.pop(tag, None)
            self._waiting = (tag, self._files[tag])  # a newer offer replaces one not started
            self._lock.notify_all()

    def catch_up(self, out: OutputDir) -> None:
        """At start: OUT's newest committed checkpoint, when the bucket holds no commit as new (a
        run stopped while copying it), is copied now; objects already there with their checksum
        are not uploaded again. Decided from both sides, not from memory. Collective."""

        def newest() -> str | None:
            local = newest_first(committed(out))
            if not local:
                return None
            there = newest_first(committed(OutputDir(self.remote)))
            if there and there[0].order_key >= local[0].order_key:
                return None
            return local[0].tag

        tag = dist.share_from(0, newest, step=f"comparing OUT with {self.remote.describe()}")
        if tag is None:
            return

        def share() -> tuple[FILES, str | None]:
            try:
                return split(out.read_manifest(tag))
            except RemoteError:
                raise
            except Exception as e:  # noqa: BLE001 — a missing or odd manifest: every rank skips
                raise RemoteError(f"{tag}'s manifest: {type(e).__name__}: {e}") from None

        def split(manifest: dict) -> tuple[FILES, str | None]:
            listed = manifest["files"]
            if self.node is None:  # the manifest may be another world size's: split it anew
                names = share_of(listed, dist.rank(), dist.world_size())
            else:  # this node's files (the shared ones from rank 0's node), split in the node
                if (manifest.get("world_size"), stored_ranks(manifest)) != (
                    dist.world_size(),
                    self.node,
                ):
                    raise RemoteError(f"{tag} was saved by another layout of ranks")
                wanted = [n for n in listed if rank_of_file(n) is not None or 0 in self.node]
                names = share_of(wanted, self.node.index(dist.rank()), len(self.node))
            files = {n: (listed[n]["size"], listed[n]["checksum"]) for n in names}
            return files, manifest.get("save_id")

        try:
            files, save_id = dist.run_agreed(share, step=f"reading {tag}'s manifest")
        except (RemoteError, dist.RankError) as e:  # the rank that failed, the others
            dist.log_main(
                logging.WARNING, "not copying %s to %s: %s", tag, self.remote.describe(), e
            )
            return
        dist.log_main(
            logging.INFO, "%s is not yet committed in %s: copying it", tag, self.remote.describe()
        )
        self._offer(tag, files, save_id)

    def unconfirmed(self) -> set[str]:
        """Local checkpoints retention must keep: committed here, newer than the newest remote
        commit, not yet committed there."""
        return set(self.outstanding)

    def poll(self, step: int = 0) -> None:
        """At step boundary ``step``: one all-reduce while anything is outstanding. Collective."""
        if not self.outstanding:
            return
        tags = list(self.outstanding)
        with self._lock:
            mine = [
                (
                    1.0 if t in self._uploaded and self._uploaded[t] is None else 0.0,
                    1.0 if self._uploaded.get(t) else 0.0,
                    1.0 if self.leader and t in self._committed and not self._committed[t] else 0.0,
                    1.0 if self.leader and self._committed.get(t) else 0.0,
                )
                for t in tags
            ]
            lost = self._foreign or (self.lease is not None and self.lease.lost)
        sums = dist.all_reduce_sum([1.0 if lost else 0.0] + [x for row in mine for x in row])
        if sums[0]:  # every rank alike: stop, as for a lost OUT lease (exit 3)
            raise RemoteLeaseLost(self._lost_why())
        world = dist.world_size()
        rows = [sums[1 + 4 * i : 5 + 4 * i] for i in range(len(tags))]
        done = [t for t, r in zip(tags, rows) if r[2] > 0]
        if done:
            self._confirmed(done[-1], tags, step)
        for t, (ok, failed, _, commit_failed) in zip(tags, rows):
            if t not in self.outstanding:
                continue
            if failed or commit_failed:
                # Kept locally (retention keeps what is not copied) and tried again while it is
                # the newest; an older one is given up once a newer one is copied.
                self.failures[t] = self.failures.get(t, 0) + 1
                self.on_event("remote_upload_failed", _step(t), tag=t, tries=self.failures[t])
                dist.log_main(
                    logging.WARNING,
                    "copying %s to %s failed on %d rank(s); kept locally, trying again",
                    t,
                    self.remote.describe(),
                    int(failed + commit_failed),
                )
                with self._lock:
                    self._committed.pop(t, None)
                    self._uploaded.pop(t, None)
                if t == self.outstanding[-1]:  # tried again after a wait (the next boundaries)
                    first = seams.number(seams.REMOTE_RETRY_S, RETRY_S)
                    wait = min(first * 2 ** (self.failures[t] - 1), MAX_RETRY_S)
                    self._retry_at[t] = time.monotonic() + wait
            elif ok == world and self.leader:
                with self._lock:
                    if t not in self._committed and t not in (self._commit, self._publishing):
                        self._commit = t  # the newest complete wins
                        self._lock.notify_all()
        for t, when in list(self._retry_at.items()):
            if not self.outstanding or t != self.outstanding[-1]:  # copied, or a newer one came
                del self._retry_at[t]
            elif time.monotonic() >= when:  # rank-local: each rank re-uploads on its own clock
                del self._retry_at[t]
                self._queue(t)

    def drain(self, step: int = 0, tries: int = FINAL_TRIES) -> bool:
        """At the end of training: poll until the newest checkpoint is copied, or its copy failed
        ``tries`` times (each try is the client's own retries with backoff); False then.
        Collective."""
        newest = self.outstanding[-1] if self.outstanding else None
        said = time.monotonic()
        while self.outstanding and self.failures.get(newest, 0) < tries:
            self.poll(step)
            if not self.outstanding or self.failures.get(newest, 0) >= tries:
                break
            if time.monotonic() - said > 30:
                said = time.monotonic()
                dist.log_main(
                    logging.INFO, "waiting for %s to reach %s", newest, self.remote.describe()
                )
            time.sleep(0.2)
        if newest is None or self.remote_head == newest:
            return True
        dist.log_main(
            logging.ERROR,
            "the final checkpoint %s did not reach %s",
            newest,
            self.remote.describe(),
        )
        return False

    def _lost_why(self) -> str:
        try:
            other = holder(self.remote) if dist.is_main() else None
        except Exception:  # noqa: BLE001 — only for the message
            other = None
        return (
            f"another run took over {self.remote.describe()}'s lease "
            f"({describe(other) if other else 'holder unknown'}); nothing more is copied there"
        )

    def _confirmed(self, tag: str, tags: list[str], step: int) -> None:
        i = tags.index(tag)
        skipped = [t for t in tags[:i] if t in self.outstanding]
        for t in skipped:
            self.on_event("remote_skipped", _step(t), tag=t, newer=tag)
        self.outstanding = [t for t in self.outstanding if t not in tags[: i + 1]]
        self._files = {t: f for t, f in self._files.items() if t in self.outstanding}
        self.failures = {t: n for t, n in self.failures.items() if t in self.outstanding}
        self.remote_head = tag
        self.on_event(
            "remote_checkpoint", _step(tag), tag=tag, uri=self.remote.describe(tag), seen_at=step
        )
        dist.log_main(logging.INFO, "%s committed to %s", tag, self.remote.describe(tag))
        with self._lock:
            for t in tags[: i + 1]:
                self._uploaded.pop(t, None)
                self._committed.pop(t, None)

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._waiting is None and self._commit is None:
                    self._lock.wait()
                if self._commit is not None:  # a manifest first: it is small and completes a copy
                    job, self._commit = ("commit", self._commit), None
                    self._publishing = job[1]
                else:
                    job, self._waiting = ("upload", self._waiting), None
            if job[0] == "commit":
                error = self._guarded(self._publish, job[1])
                with self._lock:
                    self._committed[job[1]], self._publishing = error, None
            else:
                tag, files = job[1]
                error = self._guarded(self._upload, tag, files)
                with self._lock:
                    self._uploaded[tag] = error

    def _guarded(self, work, *args) -> str | None:
        try:
            work(*args)
            return None
        except Exception as e:  # noqa: BLE001 — reported through poll's all-reduce
            logger.warning("remote copy: %s: %s", type(e).__name__, e)
            return f"{type(e).__name__}: {e}"

    def _upload(self, tag: str, files: FILES) -> None:
        if not held_by(self.remote, self.run_id):  # never over another run's objects
            self._foreign = True
            raise RemoteError(f"{self.remote.describe()}'s lease belongs to another run")
        self._uncommit_other(tag)
        for name, (size, digest) in sorted(files.items()):
            rel = f"{tag}/{name}"
            head = self.remote.head(rel)
            if head is not None and head["ContentLength"] == size:
                if head.get("Metadata", {}).get(CHECKSUM_KEY) == digest:
                    continue  # already there (a copy resumed after an interruption)
            seams.pause(seams.SLOW_UPLOAD)
            fault_point("remote.upload", _step(tag))
            local = (
                MANIFEST if self.node is not None and name.startswith("manifest.node-") else name
            )
            self.remote.upload_file(self.out / tag / local, rel, digest)

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
            try:
                theirs = json.loads(self.remote.read_bytes(f"{tag}/{MANIFEST}") or b"{}")
                theirs = theirs.get("save_id")
            except (ValueError, AttributeError):
                theirs = None
        if theirs != save_id and self.remote.delete_if(f"{tag}/{MANIFEST}", head["ETag"]):
            logger.warning(
                "%s in %s was another commit of that step (save %s); un-committed it before "
                "copying this run's",
                tag,
                self.remote.describe(),
                theirs,
            )

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
        meta = {SAVE_ID_KEY: save_id} if save_id else None
        self.remote.write_bytes(f"{tag}/{MANIFEST}", data, metadata=meta)
        self.remote.replace_bytes(LATEST, f"{tag}\n".encode())
        try:
            self._ensure_lease("deleting older checkpoints")
            self._retain(tag)
        except Exception as e:  # noqa: BLE001 — the copy is committed; retried after the next
            logger.warning("retention in %s: %s: %s", self.remote.describe(), type(e).__name__, e)

    def _merged(self, tag: str) -> bytes:
        """Node-local storage: the nodes' manifests (uploaded by their leaders, rank 0's node
        first) merged into the whole checkpoint's, which commits it (two phases, as a
        node-local save commits: no node's files count until every node's are there)."""
        manifests = []
        for node in self.groups:
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

    def _retain(self, head_tag: str) -> None:
        """After a remote commit: --save_total_limit over the bucket's commits up to the one just
        committed, in commit order (not parent links: the copies skipped in between break them),
        never it; and the folders older than it that hold no manifest (copies skipped or cut
        off). A checkpoint goes manifest first, so it is never a committed checkpoint with files
        missing."""
        found = committed(OutputDir(self.remote))
        head = next((c for c in found if c.tag == head_tag), None)
        line = [
            c.tag
            for c in sorted(found, key=lambda c: c.order_key)
            if head and c.order_key <= head.order_key
        ]
        best = head.best if head else None  # its line's best checkpoint: kept besides the limit
        doomed = select_for_deletion(line, self.limit, {head_tag}, best) if self.limit else []
        at = step_of(head_tag) or 0
        partial = [t for t in uncommitted(OutputDir(self.remote), found) if step_of(t) < at]
        for tag in doomed:
            self.remote.remove(f"{tag}/{MANIFEST}")
        for tag in doomed + partial:
            self.remote.remove_tree(tag)
        if doomed or partial:
            logger.info(
                "save_total_limit %s in %s: deleted %s",
                self.limit,
                self.remote.describe(),
                ", ".join(doomed + partial),
            )


def _step(tag: str) -> int:
    return int(tag.removeprefix("global_step")) if tag.startswith("global_step") else 0
