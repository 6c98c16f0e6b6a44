"""Checkpointer: when to save, a crash-safe save and its commit, retention, and the resume.

Built once, after the engine, with the states a checkpoint holds besides the engine's
(``states={"progress": …, "sampler": …}``: a new state is a new key) and the resume plan chosen
before the engine existed (resume.py). The trainer reports step boundaries (``at_step``,
``at_preemption``, ``at_end``); the sections below follow a save from top to bottom:
  when     every --save_steps, at a preemption, at the end; --on_save_error; --async_save's save
           in flight committed at a later boundary (``poll``/``wait``);
  save     free space, then each rank's snapshot (RNG, log window; leaders trainer_state), then
           DeepSpeed's rank files through a writer that fsyncs and checksums each file as it is
           written and records a failure instead of raising (every rank still reaches
           DeepSpeed's barriers), the RNG file, the leaders' shared files (contents.py); then
           one all-gather of every rank's outcome;
  commit   leaders write manifest.json into the staged folder, agree, then rename it into place
           and replace ``latest`` (node-local storage: every node's leader, in two phases);
  retain   --save_total_limit over this run's line (retention.py);
  load     the engine, the states and each rank's RNG from the plan (contents.restore).
A crash at any instant leaves every committed checkpoint complete and ``latest`` naming one (or
absent); a consolidation failure drops only the safetensors. Every step one rank or leader does
alone before a collective is agreed (``dist.gather_outcomes``, staging.py): a failure there is
every rank's. No rank reads back what another rank wrote.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from finetune import distributed as dist
from finetune.checkpoint.contents import (
    RANK_WINDOW,
    Clock,
    Pending,
    SaveIO,
    Snapshot,
    describe,
    finished,
    fmt_bytes,
    is_consolidated,
    restore,
    trainer_state,
    versions,
    write_consolidated,
    write_shared,
)
from finetune.checkpoint.resume import ResumePlan
from finetune.checkpoint.retention import Lineage
from finetune.checkpoint.staging import Layout, SaveError, Staging
from finetune.checkpoint.writer import GuardedWriter
from finetune.checkpoint_format.best import eval_at
from finetune.checkpoint_format.outdir import STAGING, OutputDir, tag_for
from finetune.checkpoint_format.policy import space_needed
from finetune.checkpoint_format.state import rng_state
from finetune.config import CheckpointArgs
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.faults import fault_point
from finetune.remote.copy import NoRemoteCopy


class Checkpointer:
    def __init__(
        self,
        storage: OutputDir,
        ckpt: CheckpointArgs,
        layout: Layout,
        *,
        engine,
        states: dict,
        tokenizer,
        run_info: dict,
        run_id: str,
        plan: ResumePlan | None = None,
        consolidated_dtype: torch.dtype = torch.float32,
        still_ours=lambda: True,
        adapters: bool = False,
        remote=None,
        best=None,
    ):
        """``states``: objects with ``state_dict``/``load_state_dict`` saved in trainer_state.json,
        "progress" (a TrainingState: its keys at the top level, as checkpoints have always had
        them) and one key per other state ("sampler"). ``run_info``: what trainer_state.json
        records besides (zero stage, dtype, args); ``run_id``: the same on every rank (names this
        run's save ids); ``still_ours``: whether this run still holds OUT's lease (rank 0 asks
        before each commit); ``adapters`` (--use_peft): the engine's module is a peft model whose
        frozen base is left out of its checkpoints (weights/adapter.py); ``remote``: where each
        commit is copied (--remote_output_dir); ``best``: the BestPolicy of the best checkpoint."""
        from finetune.lora import trainable_parameters
        from finetune.modeling import count_parameters

        self.storage, self.ckpt, self.layout, self.out = storage, ckpt, layout, storage.root
        self.engine, self.states, self.progress = engine, states, states["progress"]
        self.tokenizer, self.run_info, self.run_id, self.plan = tokenizer, run_info, run_id, plan
        self.consolidated_dtype, self.adapters = consolidated_dtype, adapters
        self.remote = remote or NoRemoteCopy()
        self.adapter_summary: dict | None = None  # the consolidated adapter's, for the manifest
        self.leader = layout.leader
        # A save's size before there is a checkpoint to size it by: with adapters, only they are
        # saved (a 70B base would otherwise ask for ~1.2 TB free).
        self.parameters = (trainable_parameters if adapters else count_parameters)(engine.module)
        self.writer = GuardedWriter(engine.checkpoint_engine)
        engine.checkpoint_engine = self.writer
        if hasattr(engine, "_copy_recovery_script"):
            engine._copy_recovery_script = self.writer.guard(engine._copy_recovery_script)
        self.committed_step: int | None = plan.saved["global_step"] if plan else None
        self.consolidation_error: str | None = None
        self.pending: Pending | None = None  # --async_save: written, not yet committed
        self.copy_wait_s = 0.0  # --async_save: what optimizer steps waited for snapshot copies
        # Where commits and failed saves go (MetricsWriter.event); every rank calls it: no raising.
        self.on_event: Callable[..., None] = lambda kind, step, **fields: None
        head, seen = (plan.head, plan.max_seq) if plan else (None, 0)
        self.lineage = Lineage(storage, self.leader, head, seen, best)  # collective
        self.evaluated: dict | None = None  # the last eval row (the trainer's), for the manifest
        # this storage's share: the last checkpoint's size, or an estimate from the parameters
        need = lambda: space_needed(self.lineage.last_bytes, self.parameters, layout.share)
        self.staging = Staging(storage, self.leader, self.lineage.deleter, need, still_ours)

    # --- when: the trainer reports step boundaries; every method is collective ----------------

    def at_step(self, step: int, total: int, written: bool | None = None) -> int | None:
        """At a step boundary: commit a background save whose writes are done (waiting for it when
        a save is due), then start the periodic save if one is due. ``written``: whether every rank
        had written its part, agreed in the trainer's boundary all-reduce (None: ask, one more). A
        failure is reported under the step of the save that failed, and a failed background save
        never cancels the due one. An exit code to stop with, or None. Collective."""
        ck = self.ckpt
        self.remote.poll(step)  # an all-reduce while a copy to --remote_output_dir is outstanding
        due = ck.save_checkpoint and ck.save_steps and step % ck.save_steps == 0 and step < total
        code = self._settle_in_flight(block=bool(due), written=written)
        if code is None and due:
            try:
                self.save(step, background=ck.async_save)
            except SaveError as e:
                code = self._failed(step, e)
        return code

    def _settle_in_flight(self, block: bool, written: bool | None = None) -> int | None:
        """Commit the background save if its writes are done (``block``: wait for them); its
        failure goes through the --on_save_error policy under its own step. Collective."""
        if self.pending is None:
            return None
        step = self.pending.step
        try:
            self.wait() if block else self.poll(written)
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

    def at_end(self, step: int) -> int:
        """The final save: its failure always makes the run exit 1."""
        if not self.ckpt.save_checkpoint:
            return 0
        self.settle()
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

    # --- save: check → snapshot → write → agree, then commit ---------------------------------

    def save(
        self,
        step: int,
        final: bool = False,
        consolidated: bool | None = None,
        background: bool = False,
    ) -> Path | None:
        """Save and commit a checkpoint of this step; raises SaveError on every rank if any failed.

        ``consolidated`` overrides --save_consolidated (a preemption save skips the gather).
        ``background`` (--async_save): return once every rank has its snapshot in host memory, the
        rank files being written on a thread; ``poll``/``wait`` commit it later (returns None).
        """
        self.wait()  # at most one save in flight (at_step reports its failure first)
        tag, clock, io = tag_for(step), Clock(), SaveIO()
        self.staging.ensure_lease(f"saving {tag}", step)  # before its staging is touched
        consolidated = self.ckpt.save_consolidated if consolidated is None else consolidated
        self.staging.check_space(tag)
        clock.lap("check")
        snap = self.snapshot(step, background)
        clock.lap("snapshot")
        self.staging.clear(tag)
        self.write(tag, snap, consolidated)
        self.writer.start()
        clock.lap("write" if not background else "copy")
        evaluated = eval_at(self.evaluated, step)  # taken now: an --async_save commits later
        pending = Pending(step, tag, clock, io, consolidated, final, background, evaluated)
        if background:
            self.pending = pending
            held = fmt_bytes(self.writer.snapshot_bytes)
            logger.info(
                "Snapshot of %s in %.2f s (%s of host memory); copying and writing it in "
                "the background.",
                tag,
                clock.total,
                held,
            )
            return None
        return self._complete(pending)

    def before_update(self) -> None:
        """Rank-local, before an optimizer step: wait for an --async_save snapshot's copy."""
        self.copy_wait_s += self.writer.wait_copied()

    def writing(self) -> bool:
        return self.pending is not None and not self.writer.done()

    def poll(self, written: bool | None = None) -> None:
        """At a step boundary: commit the save in flight if every rank has written its files
        (``written``: agreed already; None: one all-reduce). Collective."""
        if self.pending is not None and (
            dist.all_reduce_sum([float(self.writing())])[0] == 0 if written is None else written
        ):
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

    def abandon(self) -> None:
        """This run lost its output dir's lease: a background write stops at its next piece and
        retention's deletions at their next file; nothing is committed or cleaned up."""
        self.writer.cancel(), self.lineage.deleter.stop()
        self.pending = None

    def _complete(self, pending: Pending) -> Path:
        """agree → commit → retain. Collective."""
        self.pending = None
        tag, clock = pending.tag, pending.clock
        if pending.background:
            clock.lap("background")
        files = self.agree(tag)
        clock.lap("agree")
        self.commit(tag, files, pending.consolidated and not self.consolidation_error, pending.eval)
        clock.lap("commit")
        self.retain()
        clock.lap("retain")
        head = self.lineage.head  # --remote_output_dir
        self.remote.offer(tag, self.writer.files, files, head.save_id if head else None)
        self.committed_step = pending.step
        total = sum(size for size, _ in files.values())
        self.on_event(
            "checkpoint",
            pending.step,
            tag=tag,
            bytes=total,
            seconds=round(clock.total, 3),
            consolidated=pending.consolidated and self.consolidation_error is None,
        )
        own = pending.io.finish(tag, self.writer.files, clock.total)
        logger.info("%s", finished(tag, clock, total, own, pending.final))
        return self.out / tag

    def snapshot(self, step: int, background: bool = False) -> Snapshot:
        """In memory; a failure is recorded for the agree step, never raised. Collective: one
        all-reduce of the log window, so trainer_state.json holds the world's sum (what another
        world size resumes from) while each rank's file keeps its own (what the same one does)."""
        snap = Snapshot(step)
        self.writer.reset(self.out / STAGING / tag_for(step), step, background)
        self.consolidation_error = self.adapter_summary = None
        window = self.progress.window
        # before anything that can fail on one rank
        totals = dist.all_reduce_sum(window.world_sums())
        # the same on every rank
        norm = getattr(self.engine, "get_global_grad_norm", lambda: None)()
        window.grad_norm = float(norm) if norm is not None else None
        try:
            fault_point("save.snapshot", step)
            snap.rng = {**rng_state(), RANK_WINDOW: window.state_dict()}
            if self.leader:
                snap.trainer_state = trainer_state(
                    self.states, window.summed(totals), self.run_info
                )
        except Exception as e:  # noqa: BLE001 — recorded; the agree step decides for all ranks
            self.writer.fail("the snapshot", e)
        return snap

    def write(self, tag: str, snap: Snapshot, consolidated: bool) -> None:
        """Every rank: DeepSpeed's files (collective), its RNG file, leaders the shared files.
        Failures are recorded in ``self.writer``/``self.consolidation_error``, not raised."""
        staging_root = self.out / STAGING
        folder = staging_root / tag
        try:
            # Collective: every rank must call it (a rank-0-only call hangs under ZeRO-3).
            # --use_peft: the frozen base is not saved (a resume loads it from where it came from).
            self.engine.save_checkpoint(
                str(staging_root),
                tag=tag,
                save_latest=False,
                **({"exclude_frozen_parameters": True} if self.adapters else {}),
            )
        except Exception as e:
            # Every write inside is guarded, so this is unexpected, and this rank may have skipped
            # one of DeepSpeed's collectives: agreeing now could hang. Fail the run loudly instead;
            # nothing was committed, so `latest` still names a complete checkpoint.
            raise RuntimeError(
                f"DeepSpeed's save_checkpoint raised on rank {dist.rank()}; stopping because "
                f"the ranks may be out of step: {type(e).__name__}: {e}"
            ) from e
        module, dtype = self.engine.module, self.consolidated_dtype
        if consolidated:  # collective: every rank gathers, even one whose writes failed
            shards = self.ckpt.max_shard_size
            files, self.adapter_summary, self.consolidation_error = write_consolidated(
                module, folder, dtype, shards, self.adapters
            )
            self.writer.files.update(files)

        whole = consolidated and self.consolidation_error is None  # config.json records its dtype
        args = (module, self.tokenizer, folder, snap, dtype if whole else None, self.adapters)
        rng_file, record = str(folder / f"rng_state_{dist.rank()}.pt"), self.writer.record
        # a leader's config, tokenizer and trainer_state.json
        shared = lambda: (
            write_shared(self.storage, *args, record.cancelled)
            if self.leader and record.error is None
            else {}
        )

        def own() -> dict[str, tuple[int, str]]:
            if snap.rng is not None:  # under --async_save, queued for the writer's thread
                self.writer.save(snap.rng, rng_file)
            return shared() if self.writer.queue is None else {}

        if self.writer.queue is not None:  # --async_save: the shared files on the thread too,
            own()
            self.writer.queue.then(folder, lambda: record.files.update(shared()))  # after the rest
            return
        # Rank-local I/O before the agree step's all-gather: polled, so a hung write fails the save.
        out = dist.gather_outcomes(
            own,
            step=f"writing {tag}'s RNG and shared files",
            deadline_s=dist.io_deadline(),
            cancel=record.cancelled,
        )
        if out.own is not None:  # recorded; the agree step decides for all ranks
            self.writer.fail(folder, out.own)
        self.writer.files.update(out.result or {})

    def agree(self, tag: str) -> dict[str, tuple[int, str]]:
        """Collective: every rank's outcome. On any failure, clean up and raise on every rank.
        Returns the files this storage holds (every rank's on shared storage)."""
        mine = (self.writer.error, self.writer.files, self.consolidation_error)
        outcomes = dist.gather_outcomes(lambda: mine, share=True, inline=True).results
        bad = {r: err for r, (err, _, _) in enumerate(outcomes) if err}
        if bad:
            freed = self.staging.drop(tag)
            raise SaveError(f"save of {tag} failed on {describe(bad)}; latest is unchanged{freed}")
        consolidation = {r: err for r, (_, _, err) in enumerate(outcomes) if err}
        files: dict[str, tuple[int, str]] = {}
        for r, (_, rank_files, _) in enumerate(outcomes):
            if r in self.layout.my_group:  # on shared storage, every rank
                files.update(rank_files)
        if consolidation:
            self.consolidation_error = describe(consolidation)
            files = {n: v for n, v in files.items() if not is_consolidated(n)}
            self.staging.drop_consolidated(tag, self.consolidation_error)
        return files

    def commit(self, tag: str, files: dict, consolidated: bool, evaluated: dict | None = None):
        """Leaders: manifests (``evaluated``: its step's eval row, best.py) into staging, agree,
        then rename and advance ``latest``. Collective."""
        identity = self.lineage.identity(tag, self.run_id, evaluated)
        identity["consolidated"] = consolidated
        # what `finetune verify` holds the adapter file to
        if consolidated and self.adapter_summary is not None:
            identity["adapter"] = self.adapter_summary
        ranks = self.layout.my_group if self.layout.node_local else None
        self.staging.ensure_lease_or_drop(f"committing {tag}", tag)

        def prepare():
            seams.pause(seams.SLOW_COMMIT)  # a moment for a test to fill the disk
            self.storage.prepare_commit(tag, files, dist.world_size(), versions(), ranks, identity)

        out = dist.gather_outcomes(
            prepare, on=self.leader, step=f"writing {tag}'s manifest", deadline_s=dist.io_deadline()
        )
        if not out.ok:
            freed = self.staging.drop(tag)
            raise SaveError(
                f"commit of {tag} failed on {out.describe()}; latest is unchanged{freed}"
            )
        self.staging.ensure_lease_or_drop(f"publishing {tag}", tag)
        given_up = threading.Event()
        out = dist.gather_outcomes(
            lambda: self.storage.publish(tag, given_up),
            on=self.leader,
            step=f"publishing {tag}",
            deadline_s=dist.io_deadline(),
            cancel=given_up,
        )
        if given_up.is_set() and not self.staging.in_place(tag, identity["save_id"]):
            # A rename stuck past its deadline may still complete when the filesystem recovers: its
            # staging is left alone (a purge racing the rename could put a half-deleted folder in
            # place). A complete folder that lands later is found by the commit order.
            raise SaveError(
                f"commit of {tag} failed on {out.describe()}; its staging is left "
                "in place, `latest` is unchanged"
            )
        if not out.ok and not self.staging.in_place(tag, identity["save_id"]):
            # Only a rename or the `latest` write failed, after every node had its files complete.
            self.staging.drop(tag, written=True)  # a no-op where the rename happened
            raise SaveError(
                f"commit of {tag} failed on {out.describe()}; `latest` may now differ between "
                "nodes (resume takes the newest checkpoint complete on all of them)"
            )
        if not out.ok:
            # Renamed into place everywhere: committed (the commit order, not `latest`, is the
            # truth). Counted in the line from here on, or retention would never delete it.
            dist.log_main(
                logging.WARNING,
                "committed %s, but `latest` was not updated (%s): it names an older "
                "complete checkpoint until the next commit; resume follows the commit order",
                tag,
                out.describe(),
            )
        self.lineage.extend(tag, identity, sum(size for size, _ in files.values()))

    # --- retain ----------------------------------------------------------------------------

    def retain(self) -> None:
        """--save_total_limit over this run's line, less what --remote_output_dir has not yet
        (retention.py). Collective."""
        keep = self.remote.unconfirmed()
        self.lineage.retain(self.ckpt.save_total_limit, self.staging.ensure_lease, keep)

    # --- load ----------------------------------------------------------------------------------

    def load(self) -> bool:
        """Restore the engine, the states and this rank's RNG from the plan (resume.restore);
        False when starting fresh. Collective."""
        if self.plan is None:
            return False
        restore(self.plan, self.engine, self.states, self.out, self.adapters)
        return True
