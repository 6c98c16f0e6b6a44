"""Resume from object storage (issue 24): before the resume plan, a remote checkpoint the run is to
resume from is brought into the local output dir and committed there, so the resume that follows
is the local one, with its verification, its world-size conversion and its commit order.

Which one: ``--resume_from_checkpoint s3://…/global_stepN`` (or an s3:// output dir: its newest
committed checkpoint), or, with ``auto`` and ``--remote_output_dir``, the newest remote checkpoint
when it is newer in the commit order than every local one (a new allocation, the local disks
gone). Rank 0 decides; every rank downloads its share of the files (every world-th file of the
manifest: no rank's work grows with the world size) into ``.staging/<tag>``, checked against the
manifest's sizes and checksums; then rank 0 writes the manifest, last, and renames the folder into
place, as a save commits. A download cut short leaves only staging, removed at the next start.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from finetune import distributed as dist
from finetune.checkpoint.manifest import MANIFEST, check_file, share_of
from finetune.checkpoint.outdir import STAGING, OutputDir, committed
from finetune.checkpoint.policy import newest_first, step_of
from finetune.config import CheckpointArgs, ConfigError
from finetune.distributed import logger
from finetune.io.durable import fsync_path, write_bytes_durably
from finetune.io.remote import RemoteError, S3Storage, is_remote


def fetch_for_resume(ckpt: CheckpointArgs, out: OutputDir, node_local: bool) -> str | None:
    """The --resume_from_checkpoint spec the resume plan should use: a local folder for an s3://
    one, the same spec otherwise (None: no resume). Collective."""
    spec = ckpt.resume_from_checkpoint
    if spec is None or not (is_remote(spec) or (spec == "auto" and ckpt.remote_output_dir)):
        return spec
    if node_local:
        raise ConfigError(
            f"--resume_from_checkpoint {spec} from object storage into a node-local "
            "--output_dir is not supported yet: give a shared --output_dir"
        )
    where = spec if is_remote(spec) else ckpt.remote_output_dir
    chosen = dist.share_from(0, lambda: _choose(where, out, explicit=is_remote(spec)),
                             step=f"looking for checkpoints in {where}")  # fmt: skip
    if chosen is None:
        return spec
    root, tag, here = chosen
    if here:
        logger.info("%s is already in %s", tag, out.root)
    else:
        try:
            _download(root, tag, out)
        except (ConfigError, dist.RankError) as e:
            if is_remote(spec):
                raise
            # auto: a remote copy that does not download intact is passed over, as a damaged
            # local checkpoint is; the resume goes on from what is local
            dist.log_main(logging.WARNING, "fetching %s from %s failed (%s); resuming from %s",
                          tag, root, e, out.root)  # fmt: skip
    return str(out.root / tag) if is_remote(spec) else spec


def _choose(where: str, out: OutputDir, explicit: bool) -> tuple[str, str, bool] | None:
    """(the remote root, the checkpoint to fetch, whether OUT already holds that very commit) or
    None (nothing newer than what is local)."""
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
        raise ConfigError(f"{flag} {where}: cannot read it ({type(e).__name__}: {e})") from None
    here = data is not None and out.read_manifest(tag) == json.loads(data)
    return root, tag, here


def _remote_choice(where: str, out: OutputDir, explicit: bool) -> tuple[str, str] | None:
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
            found[0].tag, where, local[0].tag if local else "none",
        )  # fmt: skip
    return where.rstrip("/"), found[0].tag


def _download(root: str, tag: str, out: OutputDir) -> None:
    staged = Path(out.root) / STAGING / tag

    def mine() -> None:
        remote = S3Storage(root)
        listed = json.loads(remote.read_bytes(f"{tag}/{MANIFEST}"))["files"]
        staged.mkdir(parents=True, exist_ok=True)
        for name in share_of(listed, dist.rank(), dist.world_size()):
            path = staged / name
            path.parent.mkdir(parents=True, exist_ok=True)
            remote.download_file(f"{tag}/{name}", path)
            problems = check_file(path, name, listed[name], checksums=True)
            if problems:
                where = remote.describe(tag)
                raise ConfigError(f"--resume_from_checkpoint: {where} downloaded: {problems[0]}")
            fsync_path(path)

    # an earlier download cut short
    dist.run_agreed(lambda: out.remove(f"{STAGING}/{tag}"), on=dist.is_main())
    logger.info("downloading %s from %s (every rank its share)", tag, root)
    dist.run_agreed(mine, step=f"downloading {tag}", deadline_s=None)

    def commit() -> None:
        data = S3Storage(root).read_bytes(f"{tag}/{MANIFEST}")
        write_bytes_durably(staged / MANIFEST, data)  # last: the folder is complete
        fsync_path(staged)
        out.publish(tag)

    dist.run_agreed(commit, on=dist.is_main(), step=f"committing {tag} locally")
    dist.log_main(logging.INFO, "fetched %s from %s into %s", tag, root, out.root)
