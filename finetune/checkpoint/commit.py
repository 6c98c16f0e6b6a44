"""A leader's commit of a staged checkpoint: manifest into staging, then rename and ``latest``.

Each step is atomic; a crash between any two leaves ``latest`` naming a complete checkpoint (the
old one, or the new one once it is in place). The manager runs the two phases as separate agreed
steps so that node-local storage publishes only after every node prepared.
"""

from __future__ import annotations

import threading

from finetune.checkpoint.manifest import MANIFEST, build_manifest
from finetune.checkpoint.outdir import STAGING, OutputDir, step_of
from finetune.distributed import logger
from finetune.io.faults import fault_point


def commit_staged(
    storage: OutputDir,
    tag: str,
    files: dict[str, tuple[int, str]],
    world_size: int,
    versions: dict,
    ranks: list[int] | None = None,
    identity: dict | None = None,
) -> None:
    """A leader's commit of ``.staging/<tag>``. Each step is atomic; a crash between any two leaves
    ``latest`` naming a complete checkpoint (the old one, or the new one once it is in place).
    """
    prepare_staged(storage, tag, files, world_size, versions, ranks, identity)
    publish_staged(storage, tag)


def prepare_staged(
    storage: OutputDir,
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
    storage.write_json(f"{staged}/{MANIFEST}", manifest)
    storage.storage.sync(staged)  # the manifest's name in the folder is durable too


def publish_staged(storage: OutputDir, tag: str, given_up: threading.Event | None = None) -> None:
    """Rename the staged folder into place, then ``latest``. ``given_up``: set when the agreed step
    gave up waiting for this (a rename stuck on a hung mount past its deadline): a rename that
    completes later leaves ``latest`` alone (the commit order still finds the folder)."""
    # Never overwrite in place: a folder of the same step (an abandoned timeline's) is swapped out.
    fault_point("commit.rename", step_of(tag))
    if storage.exists(tag) and not storage.exists(f"{tag}/{MANIFEST}"):
        # Not committed by finetune (a plain DeepSpeed save, a copy by hand): kept, never replaced.
        where = storage.set_aside(tag, "no-manifest")
        logger.warning(
            "set aside %s, which has no %s (not committed by finetune), "
            "as %s before committing %s there",
            tag,
            MANIFEST,
            where,
            tag,
        )
    storage.replace_dir(f"{STAGING}/{tag}", tag)
    if given_up is not None and given_up.is_set():
        return
    fault_point("commit.latest", step_of(tag))
    storage.write_latest(tag)
    storage.finish_staging()
