"""Checkpoint policy as pure functions of what the manifests say: no processes, no collectives.

Commit order is the truth. Every manifest records a commit sequence number (one higher than any
checkpoint the output dir or the bucket held when the run started, then +1 per commit), its save
id, the checkpoint its run continued from (parent tag + parent save id) and its lineage (the run
that started the history: a fresh start begins one, a resume carries it on). From these:

  resume order   newest commit first (never what ``latest`` names, nor the highest step):
                 a stale ``latest`` (a crash between the rename and its update) cannot hide a newer
                 complete checkpoint; checkpoints from before sequence numbers existed come after,
                 newest step first; folders without a readable manifest come last (they will fail
                 verification, and they still count as "checkpoints exist");
  the line       the checkpoint a run continues from and its descendants, found by following parent
                 links whose save ids match: retention counts only this line, so checkpoints of an
                 abandoned timeline never push out the one a run resumed from;
  abandoned      committed checkpoints newer than the resume point: set aside, never counted.

Used by the online component (checkpoint/: resume order, the line, retention, the space a save
needs), by the bucket's copy, fetch and verify (remote/) and by ``finetune verify``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TAG_RE = re.compile(r"^global_step(\d+)$")


def tag_for(step: int) -> str:
    """A checkpoint's folder name (DeepSpeed's tag) for an optimizer step."""
    return f"global_step{step}"


def step_of(tag: str) -> int | None:
    """The step a checkpoint folder name stands for; None for any other name."""
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Committed:
    """What one complete checkpoint's manifest says about its place in the commit order."""

    tag: str
    seq: int | None = None  # None: saved before commit sequence numbers existed
    save_id: str | None = None
    parent: str | None = None
    parent_save_id: str | None = None
    total_bytes: int = 0
    world_size: int | None = None  # the ranks that saved it
    # the evaluation of its step, and the best checkpoint of its line when it was committed
    eval: dict | None = field(default=None, compare=False)
    best: str | None = None
    # the run that started its history (a fresh start); its resumes carry it on. None: saved
    # before lineages were recorded
    lineage: str | None = None

    # The manifest fields this reads (resume shares only these with every rank, not the file list).
    MANIFEST_KEYS = (
        "commit_seq",
        "save_id",
        "parent",
        "parent_save_id",
        "total_bytes",
        "world_size",
        "eval",
        "best",
        "lineage",
    )

    @classmethod
    def from_manifest(cls, tag: str, manifest: dict) -> Committed:
        seq = manifest.get("commit_seq")
        world = manifest.get("world_size")
        evaluated = manifest.get("eval")
        best = manifest.get("best")
        return cls(
            tag,
            int(seq) if seq is not None else None,
            manifest.get("save_id"),
            manifest.get("parent"),
            manifest.get("parent_save_id"),
            int(manifest.get("total_bytes", 0)),
            int(world) if world is not None else None,
            dict(evaluated) if isinstance(evaluated, dict) else None,
            best.get("tag") if isinstance(best, dict) else None,
            manifest.get("lineage"),
        )

    @property
    def order_key(self) -> tuple:
        return (
            self.seq is not None,
            self.seq if self.seq is not None else -1,
            step_of(self.tag) or 0,
        )


def newest_first(committed: list[Committed]) -> list[Committed]:
    return sorted(committed, key=lambda c: c.order_key, reverse=True)


def resume_order(tags: list[str], committed: list[Committed]) -> list[str]:
    """Tags to try when resuming, best first: committed newest first, then the unreadable ones."""
    known = {c.tag for c in committed}
    rest = sorted((t for t in tags if t not in known), key=lambda t: step_of(t) or 0, reverse=True)
    return [c.tag for c in newest_first(committed)] + rest


def line_of(head: Committed | None, committed: list[Committed]) -> list[Committed]:
    """``head`` and its ancestors on disk, oldest first: follow parent links while the parent's
    save id matches (a same-tag folder of another save is not an ancestor)."""
    if head is None:
        return []
    by_tag = {c.tag: c for c in committed}
    line = [head]
    seen = {head.tag}
    node = head
    while node.parent and node.parent in by_tag and node.parent not in seen:
        parent = by_tag[node.parent]
        if node.parent_save_id is not None and parent.save_id != node.parent_save_id:
            break
        line.append(parent)
        seen.add(parent.tag)
        node = parent
    return line[::-1]


def newer_than(point: Committed, committed: list[Committed]) -> list[Committed]:
    """Committed checkpoints after ``point`` in commit order: the timeline a resume from ``point``
    abandons."""
    return [c for c in committed if c.tag != point.tag and c.order_key > point.order_key]


def passed_over(
    local: list[Committed], bucket: list[Committed], set_aside: set[str] | None = None
) -> set[str]:
    """The tags of OUT's commits that the bucket's history went on without: not committed there,
    and either the bucket holds a commit on another branch of their line (neither their ancestor
    nor their descendant, with an ancestor in common: a run on another disk resumed from before
    them, never having seen them), or they are, or descend from, a commit the bucket set aside
    (``set_aside``: save ids; a rollback's) after the last one it still holds. A resume never
    takes one: they are the timeline the bucket left. Lines are traced by the manifests' parent
    links (OUT's and the bucket's); a commit whose line they do not trace is not one."""
    there = {c.save_id for c in bucket}
    aside = set_aside or set()
    by_id = {c.save_id: c for c in [*local, *bucket] if c.save_id is not None}
    lines = {c.save_id: set(_ancestors(c, by_id)) for c in bucket}
    left = set()
    for c in local:
        if c.save_id is None or c.save_id in there:
            continue
        line = [c.save_id, *_ancestors(c, by_id)]
        base = next((i for i, sid in enumerate(line) if sid in there), len(line))
        mine = set(line)
        if aside.intersection(line[:base]) or any(
            sid not in mine and c.save_id not in other and other & mine
            for sid, other in lines.items()
        ):
            left.add(c.tag)
    return left


def _ancestors(commit: Committed, by_id: dict[str, Committed]) -> list[str]:
    """The save ids of ``commit``'s ancestors, parent first, as far as ``by_id`` traces them."""
    line: list[str] = []
    sid = commit.parent_save_id
    while sid is not None and sid not in line:
        line.append(sid)
        parent = by_id.get(sid)
        sid = parent.parent_save_id if parent is not None else None
    return line


def select_for_deletion(
    line: list[str], limit: int, protected: set, best: str | None = None
) -> list[str]:
    """The oldest of ``line`` (oldest first) beyond ``limit``, never a protected one; the ``best``
    checkpoint is kept besides the ``limit`` newest (not counted, never deleted)."""
    if best not in line[max(len(line) - limit, 0) :]:  # among the newest it counts as one of them
        line = [t for t in line if t != best]
    excess = len(line) - limit
    return [t for t in line if t not in protected][: max(excess, 0)]


# Adam keeps fp32 master weights + two moments (12 B/param); the module states add a copy.
BYTES_PER_PARAM_ESTIMATE = 16
SPACE_MARGIN = 1.10


def space_needed(
    previous_bytes: int | None,
    parameters: int,
    share: float,
    bytes_per_param: int = BYTES_PER_PARAM_ESTIMATE,
    margin: float = SPACE_MARGIN,
) -> int:
    """Bytes a save needs on one storage: the previous checkpoint's size there, else an estimate
    for Adam under ZeRO scaled to the storage's share of the ranks (node-local: its node's)."""
    if previous_bytes:
        return int(previous_bytes * margin)
    return int(parameters * bytes_per_param * share * margin)
