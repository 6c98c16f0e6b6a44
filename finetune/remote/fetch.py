"""Resume from object storage: the bucket offers the resume plan (checkpoint/resume.py) the
commits it holds, and fetches one into the local output dir, committed there, when an OUT lacks it
or holds it damaged; the resume that follows is the local one, with its world-size conversion and
its commit order.

Which commits: ``--resume_from_checkpoint s3://…/global_stepN`` (or an s3:// output dir: its newest
committed checkpoint) offers that one; ``auto`` with ``--remote_output_dir`` offers every commit of
the prefix (one lineage, remote/lineage.py), and the plan takes the newest commit, local or in the
bucket, that verifies wherever it is: a copy missing or damaged on any node is fetched, never
passed over for an older local one. Rank 0 reads the bucket; every rank of an OUT that needs the
commit stages its share of the files (every world-th file of the manifest: no rank's work grows
with the world size) in ``.staging/<tag>``: a file the copy already there holds intact (the same
save, the manifest's size and checksum) is hard-linked, any other downloaded and checked against
the manifest's size and checksum; only what that OUT lacks or holds damaged crosses the network;
then that OUT's leader sets aside the damaged copy (``.abandoned/<tag>-unverified-…``), writes the
manifest, last, and renames the folder into place, as a save commits. A download cut short leaves
only staging, removed at the next start. A bucket that does not answer when rank 0 looks is exit 2
on a first start; a restart waits for it, then exits 75 (prefix.py's ``reach``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

from finetune import distributed as dist
from finetune.checkpoint_format.manifest import (
    MANIFEST,
    check_file,
    node_manifest,
    read_manifest,
    share_of,
)
from finetune.checkpoint_format.outdir import STAGING, OutputDir
from finetune.checkpoint_format.policy import Committed, newest_first, step_of
from finetune.config import CheckpointArgs, ConfigError
from finetune.distributed import logger
from finetune.io.durable import fsync_path, write_bytes_durably
from finetune.io.remote import RemoteError, S3Storage, is_remote
from finetune.remote.lineage import read_history
from finetune.remote.prefix import client_error, reach
from finetune.remote.verify import PARALLEL, locate

T = TypeVar("T")


# Why writing a download here failed, when it is the local disk's doing (full, over quota, failing,
# read-only): not bad input.
LOCAL_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


class OutSharing(Protocol):
    """Which ranks share this rank's OUT: what a fetch needs of the run's layout (the online
    component's ``Layout`` is one)."""

    @property
    def node_local(self) -> bool:
        """Each node has its own OUT (node-local checkpoints)."""

    @property
    def my_group(self) -> list[int]:
        """The ranks that share this rank's OUT."""

    @property
    def leader(self) -> bool:
        """This rank does rank 0's part for its OUT."""


class BucketSource:
    """The commits a bucket offers a resume, the same on every rank, and their fetch into OUT (the
    resume plan's ``Source``)."""

    def __init__(
        self,
        root: str,
        offered: list[Committed],
        out: OutputDir,
        layout: OutSharing,
        left: set[str] | None = None,
    ):
        self.root = root  # the remote output dir that holds them
        self.offered = offered
        self.out = out
        self.layout = layout
        self.left = left or set()  # the save ids of the commits the prefix set aside

    def commits(self) -> list[Committed]:
        """The commits this resume may take from the bucket, newest first."""
        return list(self.offered)

    def left_behind(self) -> set[str]:
        """The save ids of the commits the bucket set aside (a rollback's)."""
        return set(self.left)

    def fetch(self, commit: Committed, need: bool) -> None:
        """Bring ``commit`` into every OUT where ``need`` (the same on the ranks sharing an OUT):
        node-local at the world size that saved it, that node's cut; else the whole checkpoint
        (another world size converts on each node). A copy already there is set aside first.
        ConfigError or RankError on every rank when a download fails. Collective."""
        same_world = commit.world_size == dist.world_size()
        cut = self.layout.my_group if self.layout.node_local and same_world else None
        _download(self.root, commit.tag, self.out, self.layout, cut, need)


def fetch_for_resume(
    ckpt: CheckpointArgs, out: OutputDir, layout: OutSharing
) -> tuple[str | None, BucketSource | None]:
    """The --resume_from_checkpoint spec the resume plan should use (a folder in OUT for an s3://
    checkpoint, the same spec otherwise; None: no resume) and the bucket it may fetch from (None
    without one). Rank 0 reads the bucket; nothing is downloaded here: the plan fetches what an OUT
    lacks or holds damaged. Collective."""
    spec = ckpt.resume_from_checkpoint
    if spec is None or not (is_remote(spec) or (spec == "auto" and ckpt.remote_output_dir)):
        return spec, None
    explicit = is_remote(spec)
    where = spec if explicit else ckpt.remote_output_dir
    # Rank 0 looks; a restart that finds the bucket unreachable waits for it (prefix.reach).
    root, offered, left = reach(
        lambda: _offered(where, explicit),
        where,
        out.root,
        on=dist.rank() == 0,
        share=True,
        step=f"looking for checkpoints in {where}",
    )
    source = BucketSource(root, offered, out, layout, left)
    if not explicit:
        return spec, source
    return str(out.root / offered[0].tag), source


def holds(local: dict, save_id: str | None, cut: list[int] | None) -> bool:
    """Whether a local manifest is of commit ``save_id`` and holds ``cut``'s ranks (None: all)."""
    ranks = local.get("ranks")  # absent: the whole checkpoint
    return local.get("save_id") == save_id and (ranks is None or ranks == cut)


def fetch_file(remote: S3Storage, key: str, path: Path, name: str, want: dict) -> str | None:
    """Download object ``key`` to ``path`` and check it against its manifest entry ``want``: the
    first problem, or None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remote.download_file(key, path)
    problems = check_file(path, name, want, checksums=True)
    return f"{remote.describe(key)} downloaded: {problems[0]}" if problems else None


def _reuse_file(local: Path, path: Path, name: str, want: dict) -> bool:
    """Whether the file ``local`` matches its manifest entry ``want`` (size and checksum), and
    is now at ``path`` too: hard-linked (its data already durable), or copied where a link cannot
    be made (another device, a filesystem without links)."""
    if check_file(local, name, want, checksums=True):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(local, path)
    except OSError:
        shutil.copyfile(local, path)
    fsync_path(path)
    return True


def _offered(where: str, explicit: bool) -> tuple[str, list[Committed], set[str]]:
    """(the remote output dir, the commits ``where`` offers, newest first: the checkpoint it
    names, or its newest (explicit), or every committed one (auto); the save ids of the commits
    it set aside)."""
    try:
        return _listed(where, explicit)
    except (ConfigError, RemoteError):
        raise
    except ValueError as e:  # a manifest that does not parse
        raise ConfigError(f"{where}: cannot read its checkpoints ({e})") from None
    except Exception as e:  # noqa: BLE001 — the client's (credentials, endpoint, bucket)
        flag = "--resume_from_checkpoint" if explicit else "--remote_output_dir"
        raise client_error(e, f"{flag} {where}: cannot read it") from None


def _listed(where: str, explicit: bool) -> tuple[str, list[Committed], set[str]]:
    try:
        remote = S3Storage(where)
    except RemoteError as e:
        raise ConfigError(f"--resume_from_checkpoint {where}: {e}") from None
    name = remote.uri.prefix.rsplit("/", 1)[-1]
    data = remote.read_bytes(MANIFEST)
    if data is not None or step_of(name) is not None:
        if data is None:
            raise ConfigError(
                f"--resume_from_checkpoint {where}: no {MANIFEST}, so not a committed checkpoint"
            )
        parent = where.rstrip("/").rsplit("/", 1)[0]
        return parent, [Committed.from_manifest(name, json.loads(data))], set()
    history = read_history(remote)
    found = newest_first(history.found)
    if not found and explicit:
        raise ConfigError(f"--resume_from_checkpoint {where}: no committed checkpoint there")
    return where.rstrip("/"), found[:1] if explicit else found, history.set_aside_ids()


def _download(
    root: str, tag: str, out: OutputDir, layout: OutSharing, cut: list[int] | None, need: bool
) -> None:
    """In every OUT where ``need``: every rank stages its share of what that OUT needs (``cut``'s
    ranks' files and the shared ones, or all), linking those the copy there holds intact and
    downloading the rest; then its leader sets aside the copy there, commits the staged folder and
    logs how many files came down. Any failure is a ConfigError on the rank that had it (RankError
    on the others): every rank falls back, or stops, alike. Collective."""
    staged = Path(out.root) / STAGING / tag
    group = layout.my_group  # the ranks sharing this OUT split its download

    def wanted(manifest: dict) -> dict:
        """The manifest of what this OUT holds: all, or (node-local) this node's cut."""
        return node_manifest(manifest, cut) if cut is not None else manifest

    def one_line(work: Callable[[], T]) -> Callable[[], T]:
        """``work`` with any failure but a ConfigError made one, naming the rank."""

        def run() -> T:
            try:
                return work()
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 — the client's, the disk's: one line, every rank
                raise ConfigError(
                    f"--resume_from_checkpoint: fetching {tag} from {root} failed on rank "
                    f"{dist.rank()} ({type(e).__name__}: {e})"
                ) from None

        return run

    def mine() -> tuple[int, int]:
        """This rank's share, staged: (files downloaded, files reused from the copy here)."""
        remote = S3Storage(root)
        manifest = json.loads(remote.read_bytes(f"{tag}/{MANIFEST}"))
        listed = wanted(manifest)["files"]
        # Only a copy of this very save may lend its files: another save's never are this one's,
        # whatever their checksums say. Any cut of it will do (each file is checked).
        here = read_manifest(Path(out.root) / tag) or {}
        same = manifest.get("save_id") is not None and here.get("save_id") == manifest["save_id"]
        staged.mkdir(parents=True, exist_ok=True)
        downloaded = reused = 0
        for name in share_of(listed, group.index(dist.rank()), len(group)):
            if same and _reuse_file(Path(out.root) / tag / name, staged / name, name, listed[name]):
                reused += 1
                continue
            problem = fetch_file(remote, f"{tag}/{name}", staged / name, name, listed[name])
            if problem:
                raise ConfigError(f"--resume_from_checkpoint: {problem}")
            fsync_path(staged / name)
            downloaded += 1
        return downloaded, reused

    def commit() -> None:
        data = S3Storage(root).read_bytes(f"{tag}/{MANIFEST}")
        if cut is not None:
            data = (json.dumps(wanted(json.loads(data)), indent=2) + "\n").encode()
        write_bytes_durably(staged / MANIFEST, data)  # last: the folder is complete
        fsync_path(staged)
        if out.exists(tag):  # missing files or damaged ones: kept, as the resume plan keeps them
            where = out.set_aside(tag, f"unverified-{time.strftime('%Y%m%d-%H%M%S')}")
            logger.warning(
                "set aside %s (does not verify): now %s in %s; not deleted, not counted",
                tag,
                where,
                out.root,
            )
        out.publish(tag)

    # an earlier download cut short
    dist.run_agreed(lambda: out.remove(f"{STAGING}/{tag}"), on=layout.leader and need)
    if need:
        logger.info(
            "fetching %s from %s (every rank its share of what is not intact here)", tag, root
        )
    shares = dist.gather_outcomes(
        one_line(mine), on=need, share=True, step=f"downloading {tag}", deadline_s=None
    )
    shares.raise_any()
    # every such OUT's leader, once every rank's download is complete (two phases)
    dist.run_agreed(one_line(commit), on=layout.leader and need, step=f"committing {tag} locally")
    if layout.leader and need:
        downloaded = sum(shares.results[r][0] for r in group)
        reused = sum(shares.results[r][1] for r in group)
        logger.info(
            "fetched %s from %s into %s: %d of %d files downloaded, %d already intact here",
            tag,
            root,
            out.root,
            downloaded,
            downloaded + reused,
            reused,
        )


def download_checkpoint(uri: str, into: Path) -> Path:
    """One process (``finetune export s3://…``): the committed checkpoint ``uri`` names (or an
    s3:// output dir's newest) downloaded into ``into/<tag>``, every file checked against the
    manifest's size and checksum, the manifest written last. ConfigError, one line, when it is not
    a committed checkpoint or a file does not download intact; the OSError of a local disk that
    fails the writes (``LOCAL_WRITE_ERRORS``)."""
    try:
        root, rel = locate(uri)
        prefix = f"{rel}/" if rel else ""
        data = root.read_bytes(prefix + MANIFEST)
        if data is None:
            raise ConfigError(f"{root.describe(rel)}: no {MANIFEST}, so not a committed checkpoint")
        listed = json.loads(data)["files"]
        tag = rel or root.uri.prefix.rsplit("/", 1)[-1]
        folder = Path(into) / tag
        folder.mkdir(parents=True, exist_ok=True)
        total = sum(int(m["size"]) for m in listed.values())
        logger.info(
            "downloading %s (%d files, %.1f MB)", root.describe(rel), len(listed), total / 1e6
        )

        def one(name: str) -> str | None:
            return fetch_file(root, prefix + name, folder / name, name, listed[name])

        with ThreadPoolExecutor(PARALLEL) as pool:
            problems = [p for p in pool.map(one, sorted(listed)) if p]
        if problems:
            raise ConfigError(problems[0])
        write_bytes_durably(folder / MANIFEST, data)
        return folder
    except (ConfigError, RemoteError) as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        if e.errno in LOCAL_WRITE_ERRORS:  # this machine's disk, not the bucket: export's exit 1
            raise
        raise ConfigError(f"{uri}: cannot download it ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 — the client's (endpoint, credentials, bucket): one line
        raise ConfigError(f"{uri}: cannot download it ({type(e).__name__}: {e})") from None
