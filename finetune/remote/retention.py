"""Retention in the bucket, after each remote commit of the running job's copy (copy.py), over
what the prefix's lineage wrote only (lineage.py)."""

from __future__ import annotations

from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import ABANDONED, OutputDir, committed, uncommitted
from finetune.checkpoint_format.policy import select_for_deletion, step_of
from finetune.distributed import logger
from finetune.io.remote import S3Storage

# every uploaded object's metadata: the lineage that wrote it, so that retention deletes only its
# own cut-off copies (x-amz-meta-lineage)
LINEAGE_KEY = "lineage"


def retain(remote: S3Storage, head_tag: str, limit: int | None) -> None:
    """After the remote commit of ``head_tag``, over what its lineage wrote only (another run's
    or a person's folders are left alone; `ls` names them): --save_total_limit over the
    lineage's commits up to the one just committed, in commit order (not parent links: the
    copies skipped in between break them), never it; and its own folders older than it that
    hold no manifest (copies skipped or cut off, known by the lineage in their objects'
    metadata), except the data of a set-aside commit. A checkpoint goes manifest first, so it is
    never a committed checkpoint with files missing."""
    found = committed(OutputDir(remote))
    head = next((c for c in found if c.tag == head_tag), None)
    mine = head.lineage if head else None
    line = [
        c.tag
        for c in sorted(found, key=lambda c: c.order_key)
        if head and c.order_key <= head.order_key and c.lineage in (mine, None)
    ]
    best = head.best if head else None  # its line's best checkpoint: kept besides the limit
    doomed = select_for_deletion(line, limit, {head_tag}, best) if limit else []
    at = step_of(head_tag) or 0
    aside = [e.name for e in remote.list(ABANDONED) if e.is_dir]
    partial = [
        t
        for t in uncommitted(OutputDir(remote), found)
        if step_of(t) < at and _cut_off_copy(remote, t, mine, aside)
    ]
    for tag in doomed:
        remote.remove(f"{tag}/{MANIFEST}")
    for tag in doomed + partial:
        remote.remove_tree(tag)
    if doomed or partial:
        logger.info(
            "save_total_limit %s in %s: deleted %s",
            limit,
            remote.describe(),
            ", ".join(doomed + partial),
        )


def _cut_off_copy(remote: S3Storage, tag: str, lineage: str | None, aside: list[str]) -> bool:
    """Whether the manifest-less folder ``tag`` is a copy ``lineage`` left unfinished: its
    first object carries that lineage, and it holds no set-aside commit's data."""
    if lineage is None or any(name.startswith(f"{tag}-") for name in aside):
        return False
    first = next((e.name for e in remote.list(tag) if not e.is_dir), None)
    head = remote.head(f"{tag}/{first}") if first is not None else None
    return head is not None and head.get("Metadata", {}).get(LINEAGE_KEY) == lineage
