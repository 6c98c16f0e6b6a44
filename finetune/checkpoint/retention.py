"""The commit history a run continues and extends, and --save_total_limit over it.

``Lineage`` is read once at start (rank 0's view of OUT's committed checkpoints, shared with
every rank): the line the run continues (the checkpoint it resumed from and its ancestors), the
next commit sequence number (above any on any storage), this storage's checkpoint sizes. Each
commit's identity (sequence number, save id, parent) comes from it and each commit extends it.
Retention keeps the K newest of the line and nothing else is counted or deleted: a leader renames
the doomed folders out of the tag namespace (agreed, polled), a background thread purges them.
The line's best checkpoint (best.py: the best evaluation among its commits, found from the
manifests read here at start, then from each commit) is kept besides the K newest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from finetune import distributed as dist
from finetune.checkpoint.staging import SaveError
from finetune.checkpoint_format.best import BestPolicy, after_commit, best_of_line, protected
from finetune.checkpoint_format.outdir import Deleter, OutputDir, committed, step_of, tag_for
from finetune.checkpoint_format.policy import Committed, line_of, select_for_deletion
from finetune.io.faults import fault_point


class Lineage:
    """The line of commits this run continues and extends, and the retention over it."""

    def __init__(
        self,
        storage: OutputDir,
        leader: bool,
        head: Committed | None,
        seen_seq: int,
        policy: BestPolicy | None = None,
    ):
        """Collective: the leaders read their storage's commit history; rank 0's view is shared.
        ``policy``: which evaluation makes a checkpoint the best (default: the lowest eval_loss)."""
        self.storage = storage
        self.leader = leader
        self.head = head  # the newest commit of the line (None: nothing committed yet)
        # the history this run extends: the head's, else (a fresh start, or a head saved before
        # lineages were recorded) this run's id, from its first commit on
        self.id: str | None = head.lineage if head else None
        self.policy = policy or BestPolicy()
        self.deleter = Deleter(storage)  # retention's deletions, in the background (leaders)

        def mine() -> tuple[list[str], int, int | None, dict[str, int], dict[str, object] | None]:
            fault_point("retention.history")
            found = committed(storage)
            line = line_of(head, found) if head else []
            mine_head = next(
                (c for c in found if head and c.tag == head.tag and c.save_id == head.save_id), None
            )
            # the best, kept out of the count, breaks the parent links retention left: the head's
            # manifest names it (and a newer best makes it one of the line again, to delete); only
            # when the head is this storage's (a checkpoint elsewhere names no folder here)
            best = next((c for c in found if mine_head and c.tag == mine_head.best), None)
            line = ([best] if best is not None and best not in line else []) + line
            return (
                [c.tag for c in line],
                max((c.seq or 0 for c in found), default=0),
                mine_head.total_bytes if mine_head else None,
                {c.tag: c.total_bytes or 0 for c in found},
                best_of_line(self.policy, [(c.tag, c.eval) for c in line]),
            )

        out = dist.gather_outcomes(
            mine,
            on=leader,
            share=True,
            step="reading the commit history",
            deadline_s=dist.io_deadline(),
        )
        out.raise_any()
        views = [v for v in out.results if v is not None]
        self.line: list[str] = views[0][0]  # tags, oldest first; what retention counts
        self.next_seq = 1 + max([seen_seq] + [v[1] for v in views])  # above every storage's
        self.last_bytes: int | None = out.result[2] if out.result else None
        # this storage's, by tag: what deleting frees
        self.sizes: dict[str, int] = out.result[3] if out.result else {}
        # the manifests' ``best`` record: never deleted
        self.best: dict[str, object] | None = views[0][4]

    def identity(
        self, tag: str, run_id: str, evaluated: dict[str, float] | None = None
    ) -> dict[str, object]:
        """The next commit's sequence number, save id and parent; ``evaluated``: its step's eval
        row, recorded with the best checkpoint once it is committed (best.py). The number is
        consumed even if the commit fails: a save id is never reused."""
        seq = self.next_seq
        self.next_seq += 1
        self.id = self.id or run_id
        parent = self.head
        if parent is not None and parent.tag == tag:  # a same-tag re-commit replaces its parent
            parent = (
                Committed(parent.parent, save_id=parent.parent_save_id) if parent.parent else None
            )
        best = after_commit(self.policy, self.best, tag, evaluated)
        return {
            "commit_seq": seq,
            "save_id": f"{run_id}-{seq}",
            "parent": parent.tag if parent else None,
            "parent_save_id": parent.save_id if parent else None,
            "lineage": self.id,
            **({"eval": evaluated} if evaluated is not None else {}),
            **({"best": best} if best is not None else {}),
        }

    def extend(self, tag: str, identity: dict[str, object], total_bytes: int) -> None:
        """``tag`` is committed (renamed into place everywhere): the new head of the line."""
        self.head = Committed(
            tag,
            identity["commit_seq"],
            identity["save_id"],
            identity["parent"],
            identity["parent_save_id"],
            total_bytes,
            lineage=identity["lineage"],
        )
        self.best = identity.get("best")
        self.line = [t for t in self.line if t != tag] + [tag]
        self.last_bytes = total_bytes
        self.sizes[tag] = total_bytes

    def retain(
        self,
        limit: int | None,
        ensure_lease: Callable[[str, int | None], None],
        keep: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """--save_total_limit K: keep the K newest of the line, and ``keep`` (not yet copied to
        --remote_output_dir). Decided from facts every rank shares; leaders rename the rest to
        trash (polled), a thread purges it. ``ensure_lease`` raises (alike on every rank) when
        OUT is no longer this run's (an unreadable lease: logged, retried after the next save).
        Collective."""
        try:
            self._retain(limit, ensure_lease, keep)
        except SaveError as e:  # the lease unreadable: the save is committed all the same
            dist.log_main(logging.WARNING, "save_total_limit %d: %s", limit, e)

    def _retain(
        self,
        limit: int | None,
        ensure_lease: Callable[[str, int | None], None],
        keep: set[str] | frozenset[str],
    ) -> None:
        best = protected(self.best)  # kept besides the K newest
        doomed = (
            select_for_deletion(self.line, limit, {self.head.tag} | keep, best) if limit else []
        )
        if not doomed:
            return
        ensure_lease("deleting older checkpoints", step_of(self.head.tag))
        # (tag, its trash): what this leader renamed, even if a later one failed
        moved: list[tuple[str, str]] = []

        def retire() -> None:
            fault_point("retention.delete", step_of(self.head.tag))
            # The one atomic step: out of the tag namespace. The files go in the background.
            for tag in doomed:
                if self.storage.exists(tag):
                    moved.append((tag, self.storage.retire(tag)))

        given_up = threading.Event()
        out = dist.gather_outcomes(
            retire, on=self.leader, step="retention", deadline_s=dist.io_deadline(), cancel=given_up
        )
        if not given_up.is_set():  # a rename given up on may land later: tidied at the next start
            for tag, trash in moved:
                self.deleter.add(trash, self.sizes.pop(tag, 0), tag)
        names = ", ".join(doomed)
        if out.ok:
            self.line = [t for t in self.line if t not in doomed]
            dist.log_main(
                logging.INFO, "save_total_limit %d: deleting %s in the background", limit, names
            )
        else:  # kept in the line: retried after the next save
            dist.log_main(
                logging.WARNING,
                "save_total_limit %d: could not delete %s (%s); retrying after the next save",
                limit,
                names,
                out.describe(),
            )

    def finish_commit(self, step: int, ensure_lease: Callable[[str, int | None], None]) -> None:
        """Resumed at its last step, already saved: what a crash after that checkpoint's rename may
        have left undone is done now (`latest` here; retention by the caller): no later commit
        would do it. Leaders, agreed. Collective."""
        if self.head is None or self.head.tag != tag_for(step):
            return  # resumed from a checkpoint outside OUT: nothing of this output dir to finish
        tag = self.head.tag

        def point_latest() -> None:
            fault_point("resume.finish_commit", step)
            if self.storage.read_latest() != tag:
                self.storage.write_latest(tag)

        try:
            ensure_lease(f"pointing `latest` at {tag}", step)
        except SaveError as e:
            dist.log_main(logging.WARNING, "%s; resume follows the commit order", e)
            return
        out = dist.gather_outcomes(
            point_latest,
            on=self.leader,
            step=f"pointing `latest` at {tag}",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            dist.log_main(
                logging.WARNING,
                "could not point `latest` at %s (%s); resume follows the commit order",
                tag,
                out.describe(),
            )

    def finish_deletions(self) -> None:
        """At the end of training: leaders wait for retention's background deletions (polled; one
        that makes no progress is left for the next start to tidy, with a warning). Collective."""
        out = dist.gather_outcomes(
            self.deleter.drain,
            on=self.leader,
            step="deleting older checkpoints",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            self.deleter.stop()
            dist.log_main(
                logging.WARNING,
                "older checkpoints not deleted completely (%s); what is left under .trash-* is "
                "removed at the next start",
                out.describe(),
            )
