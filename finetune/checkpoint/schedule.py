"""When to save: the step-boundary, preemption and end-of-training decisions of CheckpointManager,
and the --on_save_error policy, apart from how a save is made (manager.py).

A mixin of CheckpointManager: it uses the manager's ``save``, ``wait``, ``poll``, ``retain``,
``ensure_lease``, ``finish_deletions`` and its state (``ckpt``, ``pending``, ``committed_step``,
``head``, ``storage``, ``leader``, ``out``). Every method is collective: every rank calls it at the
same boundary, with the same arguments.
"""

from __future__ import annotations

import logging
from pathlib import Path

from finetune import distributed as dist
from finetune.checkpoint.outdir import tag_for
from finetune.distributed import logger
from finetune.io.faults import fault_point


class SaveError(RuntimeError):
    """A save failed on at least one rank; every rank raises it, nothing was committed."""


class SaveSchedule:
    def at_step(self, step: int, total: int) -> int | None:
        """At a step boundary: commit a background save whose writes are done (waiting for it when
        a save is due), then start the periodic save if one is due. A failure is reported under the
        step of the save that failed, and a failed background save never cancels the due one. An
        exit code to stop with, or None. Collective."""
        ck = self.ckpt
        due = ck.save_checkpoint and ck.save_steps and step % ck.save_steps == 0 and step < total
        code = self._settle_in_flight(block=bool(due))
        if code is None and due:
            try:
                self.save(step, background=ck.async_save)
            except SaveError as e:
                code = self._failed(step, e)
        return code

    def _settle_in_flight(self, block: bool) -> int | None:
        """Commit the background save if its writes are done (``block``: wait for them); its
        failure goes through the --on_save_error policy under its own step. Collective."""
        if self.pending is None:
            return None
        step = self.pending.step
        try:
            self.wait() if block else self.poll()
        except SaveError as e:
            return self._failed(step, e)
        return None

    def _failed(self, step: int, e: SaveError) -> int | None:
        """A save of ``step`` failed (every rank knows): the event, then --on_save_error."""
        self.on_event("save_failed", step, error=str(e))
        if self.ckpt.on_save_error == "abort":
            dist.log_main(logging.ERROR, "stopping: %s (--on_save_error abort)", e)
            return 1
        dist.log_main(logging.WARNING, "training on: %s (--on_save_error continue)", e)
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

    def at_preemption(self, step: int, signals: str) -> tuple[Path | None, str | None]:
        """Commit this step (partitioned only: fast) unless it is already saved; returns (the new
        checkpoint or None, the save's error or None). A save in flight is committed first: when
        it is of this step, that is the checkpoint."""
        if not self.ckpt.save_checkpoint:
            dist.log_main(
                logging.WARNING,
                "preempted (%s) at step %d: not saving (no --save_checkpoint)",
                signals,
                step,
            )
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

    def at_end(self, step: int) -> int:
        """The final save: its failure always makes the run exit 1."""
        if not self.ckpt.save_checkpoint:
            return 0
        self.settle()
        if self.committed_step == step:
            # Resumed at (or past) the last step: re-saving the same step would only swap a
            # complete checkpoint for a copy of itself.
            logger.info("step %d is already saved as %s", step, self.out / tag_for(step))
            self._finish_commit(step)
            self.finish_deletions()
            return 0
        try:
            path = self.save(step, final=True)
        except SaveError as e:
            self.on_event("save_failed", step, error=str(e))
            dist.log_main(logging.ERROR, "final save failed: %s", e)
            return 1
        logger.info("checkpoint saved to %s", path)
        self.finish_deletions()
        return 0

    def _finish_commit(self, step: int) -> None:
        """Resumed at its last step, already saved: what a crash after that checkpoint's rename may
        have left undone, `latest` and retention, is done now; no later commit would do it, so
        `latest` would name an older checkpoint, and --save_total_limit be exceeded, for good.
        Leaders, agreed. Collective."""
        if self.head is None or self.head.tag != tag_for(step):
            return  # resumed from a checkpoint outside OUT: nothing of this output dir to finish
        tag = self.head.tag

        def point_latest():
            fault_point("resume.finish_commit", step)
            if self.storage.read_latest() != tag:
                self.storage.write_latest(tag)

        try:
            self.ensure_lease(f"pointing `latest` at {tag}", step)
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
        self.retain()
