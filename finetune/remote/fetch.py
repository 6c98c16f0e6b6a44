"""Resume from object storage: before the resume plan, a remote checkpoint the run is to
resume from is brought into the local output dir and committed there, so the resume that follows
is the local one, with its verification, its world-size conversion and its commit order.

Which one: ``--resume_from_checkpoint s3://…/global_stepN`` (or an s3:// output dir: its newest
committed checkpoint), or, with ``auto`` and ``--remote_output_dir``, the newest remote checkpoint
when it is newer in the commit order than every local one (a new allocation, the local disks
gone). Rank 0 decides; every rank downloads its share of the files (every world-th file of the
manifest: no rank's work grows with the world size) into ``.staging/<tag>``, checked against the
manifest's sizes and checksums; then rank 0 writes the manifest, last, and renames the folder into
place, as a save commits. A download cut short leaves only staging, removed at the next start.
A bucket that does not answer when rank 0 looks is exit 2 on a first start; a restart waits for
it, then exits 75 (prefix.py's ``reach``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from finetune import distributed as dist
from finetune.checkpoint_format.manifest import MANIFEST, check_file, node_manifest, share_of
from finetune.checkpoint_format.outdir import STAGING, OutputDir, committed
from finetune.checkpoint_format.policy import newest_first, step_of
from finetune.config import CheckpointArgs, ConfigError
from finetune.distributed import logger
from finetune.io.durable import fsync_path, write_bytes_durably
from finetune.io.remote import RemoteError, S3Storage, is_remote
from finetune.remote.prefix import client_error, reach
from finetune.remote.verify import PARALLEL, locate


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


@dataclass(frozen=True)
class Chosen:
    """The remote checkpoint a resume fetches."""

    root: str  # the remote output dir that holds it
    tag: str
    save_id: str | None  # its commit's, from its manifest
    world_size: int | None  # the world size that saved it


def fetch_for_resume(ckpt: CheckpointArgs, out: OutputDir, layout: OutSharing) -> str | None:
    """The --resume_from_checkpoint spec the resume plan should use: a local folder for an s3://
    one, the same spec otherwise (None: no resume). Node-local storage: each node fetches its
    ranks' files and the shared ones into its own OUT (at another world size the whole
    checkpoint, converted on each node). Collective."""
    spec = ckpt.resume_from_checkpoint
    if spec is None or not (is_remote(spec) or (spec == "auto" and ckpt.remote_output_dir)):
        return spec
    explicit = is_remote(spec)
    where = spec if explicit else ckpt.remote_output_dir
    # Rank 0 looks; a restart that finds the bucket unreachable waits for it (prefix.reach).
    chosen: Chosen | None = reach(
        lambda: _choose(where, out, explicit),
        where,
        out.root,
        on=dist.rank() == 0,
        share=True,
        step=f"looking for checkpoints in {where}",
    )
    if chosen is None:
        return spec
    tag = chosen.tag
    # What each OUT needs: node-local at the same world size its node's cut; else (shared storage,
    # or node-local at another world size, which converts on each node) the whole checkpoint.
    same_world = chosen.world_size == dist.world_size()
    cut = layout.my_group if layout.node_local and same_world else None
    # Every OUT (each node's) already holds that very commit, as much of it as it needs?
    held = holds(out.read_manifest(tag) or {}, chosen.save_id, cut) if layout.leader else True
    if chosen.save_id is not None and not dist.any_rank(not held):
        logger.info("%s is already in %s", tag, out.root)
    else:
        try:
            _download(chosen.root, tag, out, layout, cut)
        except (ConfigError, dist.RankError) as e:
            if explicit:
                raise
            # auto: a remote copy that does not download intact is passed over, as a damaged
            # local checkpoint is; the resume goes on from what is local
            dist.log_main(
                logging.WARNING,
                "fetching %s from %s failed (%s); resuming from %s",
                tag,
                chosen.root,
                e,
                out.root,
            )
    return str(out.root / tag) if explicit else spec


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


def _choose(where: str, out: OutputDir, explicit: bool) -> Chosen | None:
    """The remote checkpoint to fetch, or None (nothing newer than what is local)."""
    try:
        found = _remote_choice(where, out, explicit)
        if found is None:
            return None
        root, tag = found
        data = S3Storage(root).read_bytes(f"{tag}/{MANIFEST}")
    except (ConfigError, RemoteError):
        raise
    except Exception as e:  # noqa: BLE001 — the client's (credentials, endpoint, bucket)
        flag = "--resume_from_checkpoint" if explicit else "--remote_output_dir"
        raise client_error(e, f"{flag} {where}: cannot read it") from None
    manifest = json.loads(data) if data is not None else {}
    return Chosen(root, tag, manifest.get("save_id"), manifest.get("world_size"))


def _remote_choice(where: str, out: OutputDir, explicit: bool) -> tuple[str, str] | None:
    """(the remote output dir, the checkpoint's tag) ``where`` names: itself when it is a
    checkpoint, else its newest committed one (with ``auto``, only when newer than every local
    one); None when there is none to fetch."""
    try:
        remote = S3Storage(where)
    except RemoteError as e:
        raise ConfigError(f"--resume_from_checkpoint {where}: {e}") from None
    name = remote.uri.prefix.rsplit("/", 1)[-1]
    marker = remote.stat(MANIFEST)
    if marker is not None or step_of(name) is not None:
        if marker is None:
            raise ConfigError(
                f"--resume_from_checkpoint {where}: no {MANIFEST}, so not a committed checkpoint"
            )
        parent = where.rstrip("/").rsplit("/", 1)[0]
        return parent, name
    found = newest_first(committed(OutputDir(remote)))
    if not found:
        if explicit:
            raise ConfigError(f"--resume_from_checkpoint {where}: no committed checkpoint there")
        return None
    if not explicit:
        local = newest_first(committed(out))
        if local and local[0].order_key >= found[0].order_key:
            return None  # the local one is as new: resume as usual
        logger.info(
            "the newest checkpoint is %s in %s (%s locally): fetching it",
            found[0].tag,
            where,
            local[0].tag if local else "none",
        )
    return where.rstrip("/"), found[0].tag


def _download(
    root: str, tag: str, out: OutputDir, layout: OutSharing, cut: list[int] | None
) -> None:
    """Every rank its share of what this OUT needs (``cut``'s ranks' files and the shared ones,
    or all), then each OUT's leader commits it. Any failure is a ConfigError on the rank that had
    it (RankError on the others): every rank falls back, or stops, alike."""
    staged = Path(out.root) / STAGING / tag
    group = layout.my_group  # the ranks sharing this OUT split its download

    def wanted(manifest: dict) -> dict:
        """The manifest of what this OUT holds: all, or (node-local) this node's cut."""
        return node_manifest(manifest, cut) if cut is not None else manifest

    def one_line(work: Callable[[], None]) -> Callable[[], None]:
        """``work`` with any failure but a ConfigError made one, naming the rank."""

        def run() -> None:
            try:
                work()
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 — the client's, the disk's: one line, every rank
                raise ConfigError(
                    f"--resume_from_checkpoint: fetching {tag} from {root} failed on rank "
                    f"{dist.rank()} ({type(e).__name__}: {e})"
                ) from None

        return run

    def mine() -> None:
        remote = S3Storage(root)
        listed = wanted(json.loads(remote.read_bytes(f"{tag}/{MANIFEST}")))["files"]
        staged.mkdir(parents=True, exist_ok=True)
        for name in share_of(listed, group.index(dist.rank()), len(group)):
            problem = fetch_file(remote, f"{tag}/{name}", staged / name, name, listed[name])
            if problem:
                raise ConfigError(f"--resume_from_checkpoint: {problem}")
            fsync_path(staged / name)

    def commit() -> None:
        data = S3Storage(root).read_bytes(f"{tag}/{MANIFEST}")
        if cut is not None:
            data = (json.dumps(wanted(json.loads(data)), indent=2) + "\n").encode()
        write_bytes_durably(staged / MANIFEST, data)  # last: the folder is complete
        fsync_path(staged)
        out.publish(tag)

    # an earlier download cut short
    dist.run_agreed(lambda: out.remove(f"{STAGING}/{tag}"), on=layout.leader)
    logger.info("downloading %s from %s (every rank its share)", tag, root)
    dist.run_agreed(one_line(mine), step=f"downloading {tag}", deadline_s=None)
    # every node's leader, once every rank's download is complete (two phases)
    dist.run_agreed(one_line(commit), on=layout.leader, step=f"committing {tag} locally")
    dist.log_main(logging.INFO, "fetched %s from %s into %s", tag, root, out.root)


def download_checkpoint(uri: str, into: Path) -> Path:
    """One process (``finetune export s3://…``): the committed checkpoint ``uri`` names (or an
    s3:// output dir's newest) downloaded into ``into/<tag>``, every file checked against the
    manifest's size and checksum, the manifest written last. ConfigError, one line, when it is not
    a committed checkpoint or a file does not download intact."""
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
    except Exception as e:  # noqa: BLE001 — the client's (endpoint, credentials, bucket): one line
        raise ConfigError(f"{uri}: cannot download it ({type(e).__name__}: {e})") from None
