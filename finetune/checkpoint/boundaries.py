"""When the Checkpointer saves and commits: the step boundaries the trainer reports.

``SaveBoundaries`` is the half of the Checkpointer (checkpointer.py) that decides *when*; the
other half does the save itself (``save``, its commit, ``retain``). At a step (``at_step``): the
periodic save every --save_steps. At a preemption (``at_preemption``): this step, partitioned only,
unless it is already saved. At the end (``at_end``): the final save, whose failure always makes
the run exit 1, then the bucket's copy drained. A failed save goes through --on_save_error
(``_failed``). Under --async_save a save's rank files are written on the writer's thread and the
save is committed at a later boundary: ``poll`` when every rank has written its files, ``wait``
when a save is due or training stops (``settle``); a due save that waited for it is said
(``_keep_pace``, cadence.py). The bucket's copy (--remote_output_dir) is
polled at every boundary; a copy given up (no progress within its deadline) stops the run with
exit 1. Every method is collective unless it says rank-local.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from finetune import distributed as dist
from finetune.checkpoint.bucket import BucketCopy
from finetune.checkpoint.cadence import Cadence
from finetune.checkpoint.contents import Pending
from finetune.checkpoint.retention import Lineage
from finetune.checkpoint.staging import SaveError, Staging
from finetune.checkpoint.writer import GuardedWriter
from finetune.checkpoint_format.outdir import tag_for
from finetune.config import CheckpointArgs
from finetune.distributed import logger


class SaveBoundaries(ABC):
    """The Checkpointer's public "when": at_step, at_preemption, at_end, settle, and
    --async_save's before_update, writing, poll, wait; abandon for a lost lease."""

    # Set by the Checkpointer (checkpointer.py).
    ckpt: CheckpointArgs
    out: Path
    writer: GuardedWriter
    staging: Staging
    lineage: Lineage
    remote: BucketCopy
    pending: Pending | None  # --async_save: written on the writer's thread, not yet committed
    committed_step: int | None  # the newest step committed (or resumed from)
    copy_wait_s: float  # --async_save: what optimizer steps waited for snapshot copies
    on_event: Callable[..., None]  # MetricsWriter.event: "checkpoint", "save_failed", …
    cadence: Cadence  # whether saves come faster than they are written

    @abstractmethod
    def save(
        self,
        step: int,
        final: bool = False,
        consolidated: bool | None = None,
        background: bool = False,
    ) -> Path | None:
        """Save and commit a checkpoint of ``step`` (checkpointer.py)."""

    @abstractmethod
    def _complete(self, pending: Pending) -> Path:
        """Agree on a written save, commit it, retain (checkpointer.py)."""

    @abstractmethod
    def retain(self) -> None:
        """--save_total_limit over this run's line (checkpointer.py)."""

    # --- at a step --------------------------------------------------------------------------

    def at_step(self, step: int, total: int, written: bool | None = None) -> int | None:
        """At a step boundary: commit a background save whose writes are done (waiting for it when
        a save is due), then start the periodic save if one is due. ``written``: whether every rank
        had written its part, agreed in the trainer's boundary all-reduce (None: ask, one more). A
        failure is reported under the step of the save that failed, and a failed background save
        never cancels the due one. A copy to the bucket given up (at a commit's offer) stops the
        run: its checkpoints stay committed in OUT. An exit code to stop with, or None.
        Collective."""
        ck = self.ckpt
        self.remote.poll(step)  # an all-reduce while a copy to --remote_output_dir is outstanding
        due = ck.save_checkpoint and ck.save_steps and step % ck.save_steps == 0 and step < total
        # still being written (agreed when ``written`` is given): a wait for a commit alone is not
        # the writer falling behind
        writing = self.writing() if written is None else not written
        since, in_flight = time.perf_counter(), self.pending is not None and writing
        code = self._settle_in_flight(block=bool(due), written=written)
        if due:
            self._keep_pace(step, since, in_flight)
        if code is None and due:
            try:
                self.save(step, background=ck.async_save)
            except SaveError as e:
                code = self._failed(step, e)
        if code is None and self.remote.failed is not None:  # agreed on every rank
            dist.log_main(
                logging.ERROR, "stopping: %s; OUT's checkpoints are kept", self.remote.failed
            )
            code = 1
        return code

    def _keep_pace(self, step: int, since: float, in_flight: bool) -> None:
        """The save of ``step`` is due; from ``since`` until now it waited for the one in flight
        (``in_flight``). When that wait shows saves come faster than they are written: said once,
        with the numbers, and an event each time (cadence.py)."""
        behind = self.cadence.started(step, since, in_flight)
        if behind is None:
            return
        if self.cadence.first():
            dist.log_main(logging.WARNING, "%s", behind.message())
        self.on_event("save_behind", step, **behind.event())

    def _failed(self, step: int, e: SaveError) -> int | None:
        """A save of ``step`` failed (every rank knows): the event, then --on_save_error."""
        self.on_event("save_failed", step, error=str(e))
        if self.ckpt.on_save_error == "abort":
            dist.log_main(logging.ERROR, "stopping: %s (--on_save_error abort)", e)
            return 1
        dist.log_main(logging.WARNING, "training on: %s (--on_save_error continue)", e)
        return None

    # --- at a preemption --------------------------------------------------------------------

    def at_preemption(self, step: int, signals: str) -> tuple[Path | None, str | None]:
        """Commit this step (partitioned only: fast) unless it is already saved; returns (the new
        checkpoint or None, the save's error or None). A save in flight is committed first: when
        it is of this step, that is the checkpoint. Collective."""
        if not self.ckpt.save_checkpoint:
            why = "not saving (no --save_checkpoint)"
            dist.log_main(logging.WARNING, "preempted (%s) at step %d: %s", signals, step, why)
            return None, None
        in_flight = self.pending.step if self.pending is not None else None
        self.settle()
        if in_flight == step and self.committed_step == step:
            return self.out / tag_for(step), None
        if self.committed_step == step or step == 0:
            dist.log_main(
                logging.WARNING, "preempted (%s) at step %d: nothing new to save", signals, step
            )
            return None, None
        try:
            return self.save(step, consolidated=False), None
        except SaveError as e:
            self.on_event("save_failed", step, error=str(e))
            dist.log_main(
                logging.ERROR, "preempted (%s) at step %d and the save failed: %s", signals, step, e
            )
            return None, str(e)

    # --- at the end -------------------------------------------------------------------------

    def at_end(self, step: int) -> int:
        """The final save: its failure always makes the run exit 1; so does a final checkpoint
        that did not reach --remote_output_dir (the copy's ``failed`` says why: its tries failed,
        or it made no progress within its deadline). A save in flight that failed goes through
        --on_save_error first: under abort the run stops there, as at any boundary, with no final
        save. Collective."""
        if not self.ckpt.save_checkpoint:
            return 0
        since, in_flight = time.perf_counter(), self.writing()
        if self._settle_in_flight(block=True) is not None:
            return 1
        if self.committed_step != step:
            self._keep_pace(step, since, in_flight)
        if self.committed_step == step:
            # Resumed at (or past) the last step: re-saving would swap a complete checkpoint for a
            # copy of itself. A crash after its rename may have left `latest`, retention undone.
            logger.info("step %d is already saved as %s", step, self.out / tag_for(step))
            self.lineage.finish_commit(step, self.staging.ensure_lease)
        else:
            try:
                logger.info("checkpoint saved to %s", self.save(step, final=True))
            except SaveError as e:
                self.on_event("save_failed", step, error=str(e))
                dist.log_main(logging.ERROR, "final save failed: %s", e)
                return 1
        copied = self.remote.drain(step)  # --remote_output_dir: the final copy too
        self.retain()  # then what waited for its copy can go
        self.lineage.finish_deletions()
        return 0 if copied else 1

    # --- --async_save: a save in flight, committed at a later boundary ----------------------

    def before_update(self) -> None:
        """Rank-local, before an optimizer step: wait for an --async_save snapshot's copy."""
        self.copy_wait_s += self.writer.wait_copied()

    def writing(self) -> bool:
        """Rank-local: whether this rank is still writing the save in flight."""
        return self.pending is not None and not self.writer.done()

    def poll(self, written: bool | None = None) -> None:
        """At a step boundary: commit the save in flight if every rank has written its files
        (``written``: agreed already; None: one all-reduce). Collective."""
        if self.pending is None:
            return
        if written is None:
            written = dist.all_reduce_sum([float(self.writing())])[0] == 0
        if written:
            self._complete(self.pending)

    def wait(self) -> Path | None:
        """Block until the save in flight is written, then commit it (its path; None when there was
        none). Polled: a writer thread that makes no progress for ``dist.io_deadline()`` fails the
        save. Raises SaveError on every rank if it failed. Collective."""
        if self.pending is None:
            return None
        tag = self.pending.tag
        out = dist.gather_outcomes(
            self.writer.join_progressing,
            step=f"writing {tag} in the background",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            self.writer.cancel()  # a writer that came back to life stops at its next piece
            self.pending = None
            freed = self.staging.drop(tag)
            raise SaveError(f"save of {tag} failed on {out.describe()}; latest is unchanged{freed}")
        return self._complete(self.pending)

    def _settle_in_flight(self, block: bool, written: bool | None = None) -> int | None:
        """Commit the background save if its writes are done (``block``: wait for them); its
        failure goes through the --on_save_error policy under its own step. Collective."""
        if self.pending is None:
            return None
        step = self.pending.step
        try:
            if block:
                self.wait()
            else:
                self.poll(written)
        except SaveError as e:
            return self._failed(step, e)
        return None

    def settle(self) -> None:
        """Commit the save in flight, if any (training stops here); its failure is logged under its
        own step, not raised. Collective."""
        if self.pending is None:
            return
        step = self.pending.step
        try:
            self.wait()
        except SaveError as e:
            self.on_event("save_failed", step, error=str(e))
            dist.log_main(logging.ERROR, "the save of step %d in flight failed: %s", step, e)

    def abandon(self) -> None:
        """Rank-local: this run lost its output dir's lease. A background write stops at its next
        piece and retention's deletions at their next file; nothing is committed or cleaned up."""
        self.writer.cancel()
        self.lineage.deleter.stop()
        self.pending = None
