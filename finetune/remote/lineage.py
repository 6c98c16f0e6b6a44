"""The bucket's history: one lineage per prefix, as OUT holds one line.

A lineage is the history a fresh start begins (its id is that run's) and every resume of it carries
on: each manifest records it (``lineage``), and its commit numbers rise across every run of it,
since each run numbers its commits above the highest the prefix and OUT hold. Commit order is
comparable only within one lineage, so the bucket keeps to one:

  a fresh start   on a prefix that holds committed checkpoints is refused (exit 2, naming the
                  prefix): they are another run's, and a new run needs a prefix of its own (OUT,
                  by contrast, sets an earlier run's checkpoints aside: a local folder can be
                  renamed, an object cannot);
  another history a run that continues a checkpoint of another lineage than the prefix's is
                  refused the same way, before anything is fetched from or written to the prefix;
  a rollback      a resume from a named checkpoint sets aside the lineage's later commits in the
                  bucket, so that no requeue (``auto``) returns to them: each one's manifest moves
                  to ``.abandoned/<tag>-<save id>/`` (an object store has no rename: only the small
                  manifest moves, never the data), which un-commits it in place. Its data objects
                  stay, uncounted and never deleted by retention, until this lineage saves that
                  step again.

Checkpoints saved before lineages were recorded (no ``lineage`` in their manifest) belong to any
lineage that continues them. Rank 0 reads and decides; the callers agree on the outcome.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from finetune import distributed as dist
from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import ABANDONED, LATEST, OutputDir, committed
from finetune.checkpoint_format.policy import Committed, newest_first
from finetune.config import ConfigError
from finetune.distributed import logger
from finetune.io.remote import S3Storage, is_remote
from finetune.remote.prefix import client_error, reach


@dataclass(frozen=True)
class History:
    """What a prefix holds: its committed checkpoints, and the tags whose commits were set aside
    (a rollback's), by ``.abandoned`` entry name (``<tag>-<save id>``)."""

    found: list[Committed]
    set_aside: list[str]

    @property
    def max_seq(self) -> int:
        """The highest commit number the prefix holds, set-aside commits included."""
        return max((c.seq or 0 for c in self.found), default=0)

    def lineages(self) -> set[str]:
        """The lineages of its commits (those saved before lineages were recorded aside)."""
        return {c.lineage for c in self.found if c.lineage is not None}

    def set_aside_ids(self) -> set[str]:
        """The save ids of the set-aside commits."""
        return {name.split("-", 1)[1] for name in self.set_aside if "-" in name}

    def is_set_aside(self, tag: str) -> bool:
        """Whether ``tag``'s folder holds the data of a set-aside commit."""
        return any(name.startswith(f"{tag}-") for name in self.set_aside)


def read_history(remote: S3Storage) -> History:
    """The prefix's committed checkpoints (one manifest read each) and its set-aside ones."""
    aside = [e.name for e in remote.list(ABANDONED) if e.is_dir]
    return History(committed(OutputDir(remote)), aside)


def lineage_of(out: OutputDir, spec: str | None) -> tuple[bool, Committed | None]:
    """(whether the run starts fresh, the checkpoint it will continue as far as OUT shows it) for
    --resume_from_checkpoint ``spec``: None or an ``auto`` with nothing committed in OUT starts
    fresh (``auto`` then takes the prefix's newest: not fresh); ``auto`` continues OUT's newest; a
    local folder continues it; an s3:// checkpoint its manifest's."""
    if spec is None:
        return True, None
    if spec == "auto":
        local = newest_first(committed(out))
        return False, local[0] if local else None
    folder = OutputDir(S3Storage(spec) if is_remote(spec) else spec)
    data = folder.storage.read_bytes(MANIFEST)
    if data is None:  # an output dir: its newest committed checkpoint
        found = newest_first(committed(folder))
        return False, found[0] if found else None
    name = spec.rstrip("/").rsplit("/", 1)[-1]
    return False, Committed.from_manifest(name, json.loads(data))


def check_prefix(history: History, fresh: bool, head: Committed | None, where: str) -> None:
    """ConfigError (exit 2, naming the prefix) when this run must not write to ``where``: a fresh
    start where checkpoints are committed, or a continued checkpoint (``head``) of another lineage
    than the prefix's."""
    if not history.found:
        return
    newest = newest_first(history.found)[0]
    if fresh:
        raise ConfigError(
            f"--remote_output_dir {where} holds another run's checkpoints (newest {newest.tag}): "
            f"a new run needs a prefix of its own; to continue them, add "
            f"--resume_from_checkpoint auto"
        )
    mine = head.lineage if head is not None else None
    others = sorted(history.lineages() - {mine}) if mine is not None else []
    if others:
        theirs = next(c for c in newest_first(history.found) if c.lineage in others)
        raise ConfigError(
            f"--remote_output_dir {where} holds the checkpoints of another run's history "
            f"(newest {theirs.tag}, lineage {theirs.lineage}) than the one this run continues "
            f"({head.tag if head else 'none'}, lineage {mine}): give a prefix of its own"
        )


def later_commits(history: History, point: Committed) -> list[Committed]:
    """The prefix's commits of ``point``'s lineage after it in commit order: the timeline a resume
    from ``point`` abandons (oldest first)."""
    same = [
        c
        for c in history.found
        if c.lineage in (point.lineage, None) and c.save_id != point.save_id
    ]
    return sorted((c for c in same if c.order_key > point.order_key), key=lambda c: c.order_key)


def set_aside(remote: S3Storage, commits: list[Committed]) -> list[str]:
    """Each commit's manifest copied to ``.abandoned/<tag>-<save id>/``, then deleted from its
    folder only while it is still that very manifest (its ETag): un-committed, its data in place;
    then ``latest`` names the newest commit left. Returns the entries written. Rank 0; raises the
    client's errors."""
    done = []
    for c in commits:
        found = remote.read_tagged(f"{c.tag}/{MANIFEST}")
        if found is None:
            continue
        data, etag = found
        entry = f"{c.tag}-{c.save_id or 'unknown'}"
        remote.write_bytes(f"{ABANDONED}/{entry}/{MANIFEST}", data)
        if remote.delete_if(f"{c.tag}/{MANIFEST}", etag):
            done.append(entry)
    if done:  # `latest` names the newest commit left, as after a commit (not a set-aside one)
        remaining = newest_first(committed(OutputDir(remote)))
        if remaining:
            remote.replace_bytes(LATEST, f"{remaining[0].tag}\n".encode())
        else:
            remote.remove(LATEST)
    if done:
        logger.log(
            logging.INFO,
            "set aside in %s, a timeline this resume leaves: %s (not deleted, not counted; see "
            "`finetune ls %s`)",
            remote.describe(),
            ", ".join(done),
            remote.describe(),
        )
    return done


# --- at a run's start, every rank -------------------------------------------------------------


def check_at_start(
    remote: S3Storage, out: OutputDir, spec: str | None
) -> tuple[int, Committed | None, list[Committed]]:
    """Before anything is fetched from or written to the prefix: whether this run may write there
    (``check_prefix``: ConfigError on every rank if not). Returns the highest commit number the
    prefix holds (this run numbers its commits above it), the checkpoint the run continues as far
    as OUT and the spec show it, and (a named checkpoint: a rollback) the prefix's commits after
    it, for ``leave_later`` once the resume is planned. Rank 0 reads the prefix once. Collective."""

    where = remote.describe()
    named = spec not in (None, "auto")

    def decide() -> tuple[int, Committed | None, list[Committed]]:
        try:
            history = read_history(remote)
            fresh, head = lineage_of(out, spec)
        except ConfigError:
            raise
        except ValueError as e:  # a manifest that does not parse
            raise ConfigError(
                f"--remote_output_dir {where}: cannot read its history ({e})"
            ) from None
        except Exception as e:  # noqa: BLE001 — the client's: an outage is waited for on a restart
            raise client_error(e, f"--remote_output_dir {where}: cannot read its history") from None
        check_prefix(history, fresh, head, where)
        later = later_commits(history, head) if named and head is not None else []
        return history.max_seq, head, later

    # a restart that finds the bucket unreachable waits for it (prefix.reach)
    return reach(decide, where, out.root, on=dist.is_main(), share=True, step=f"reading {where}")


def leave_later(remote: S3Storage, point: Committed, later: list[Committed]) -> None:
    """A resume from a named checkpoint (``point``): the prefix's ``later`` commits of its
    lineage (``check_at_start``'s) are set aside. A failure is a warning (a later ``auto`` could
    then return to them; the run itself resumes from ``point``). Rank 0. Collective."""

    def move() -> list[str]:
        return set_aside(remote, later)

    out = dist.gather_outcomes(
        move, on=dist.is_main(), step=f"setting aside in {remote.describe()}"
    )
    if not out.ok:
        dist.log_main(
            logging.WARNING,
            "could not set aside the commits after %s in %s: %s",
            point.tag,
            remote.describe(),
            out.describe(),
        )
