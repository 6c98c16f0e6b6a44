"""Checkpointer: when to save, a crash-safe save and its commit, retention, and the resume.

Built once, after the engine, with the states a checkpoint holds besides the engine's
(``states={"progress": …, "sampler": …}``: a new state is a new key), the resume plan chosen
before the engine existed (resume.py) and the bucket's copy (--remote_output_dir; a BucketCopy,
bucket.py), which catches up here with what a stopped run left uncopied. The trainer reports
step boundaries (``at_step``, ``at_preemption``, ``at_end``); the sections below follow a save
from top to bottom:
  when     (boundaries.py) every --save_steps, at a preemption, at the end; --on_save_error;
           --async_save's save in flight committed at a later boundary (``poll``/``wait``),
           and a due save that had to wait for it said (cadence.py);
  save     free space, then each rank's snapshot (RNG, log window; leaders trainer_state), then
           DeepSpeed's rank files through a writer that fsyncs and checksums each file as it is
           written and records a failure instead of raising (every rank still reaches
           DeepSpeed's barriers; writer.py), the RNG file, the leaders' shared files
           (contents.py), then --save_consolidated's weights, last (an optional file never
           takes the space a mandatory one needs); then one all-gather of every rank's outcome;
  commit   leaders write manifest.json into the staged folder, agree, then rename it into place
           and replace ``latest`` (node-local storage: every node's leader, in two phases;
           checkpoint_format/outdir.py);
  retain   --save_total_limit over this run's line, less what the bucket's copy has not yet
           committed (retention.py);
  copy     each commit offered to the bucket's copy, which uploads it in the background; the
           copy is polled at each step boundary and drained at the end (boundaries.py);
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
from typing import TYPE_CHECKING

import torch

from finetune import distributed as dist
from finetune.checkpoint.boundaries import SaveBoundaries
from finetune.checkpoint.bucket import BucketCopy, NoRemoteCopy
from finetune.checkpoint.cadence import Cadence
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
from finetune.checkpoint.writer import Files, GuardedWriter
from finetune.checkpoint_format.best import BestPolicy, eval_at
from finetune.checkpoint_format.outdir import STAGING, OutputDir, tag_for
from finetune.checkpoint_format.policy import space_needed
from finetune.checkpoint_format.state import TrainingState, rng_state
from finetune.config import CheckpointArgs
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.faults import fault_point
from finetune.reference import REFERENCE_KEY

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.distributed.checkpoint.stateful import Stateful
    from transformers import PreTrainedTokenizerBase


def _no_event(kind: str, step: int, **fields: object) -> None:
    """Where events go until the trainer's metrics take them."""


class Checkpointer(SaveBoundaries):
    """The online component: when to save (boundaries.py), the save, its commit, retention and
    the resume's load, for one run over one OUT."""

    def __init__(
        self,
        storage: OutputDir,
        ckpt: CheckpointArgs,
        layout: Layout,
        *,
        engine: DeepSpeedEngine,
        states: dict[str, Stateful],
        tokenizer: PreTrainedTokenizerBase,
        run_info: dict[str, object],
        run_id: str,
        plan: ResumePlan | None = None,
        seen_seq: int = 0,
        consolidated_dtype: torch.dtype = torch.float32,
        still_ours: Callable[[], bool] = lambda: True,
        adapters: bool = False,
        remote: BucketCopy | None = None,
        best: BestPolicy | None = None,
    ):
        """``states``: objects with ``state_dict``/``load_state_dict`` saved in trainer_state.json,
        "progress" (a TrainingState: its keys at the top level, as checkpoints have always had
        them) and one key per other state ("sampler"). ``run_info``: what trainer_state.json
        records besides (zero stage, dtype, args); ``run_id``: the same on every rank (names this
        run's save ids); ``seen_seq``: the highest commit number the bucket holds (this run's go
        above it and above OUT's); ``still_ours``: whether this run still holds OUT's lease (rank
        0 asks before each commit); ``adapters`` (--use_peft): the engine's module is a peft
        model whose frozen base is left out of its checkpoints (weights/adapter.py); ``remote``:
        where each commit is copied (--remote_output_dir; None: nowhere); ``best``: the
        BestPolicy of the best checkpoint. Collective: the copy catches up, the leaders read the
        commit history."""
        from finetune.lora import trainable_parameters
        from finetune.modeling import count_parameters

        self.storage = storage
        self.ckpt = ckpt
        self.layout = layout
        self.leader = layout.leader
        self.out = storage.root
        self.engine = engine
        self.states = states
        self.progress: TrainingState = states["progress"]
        self.tokenizer = tokenizer
        self.run_info = run_info
        self.run_id = run_id
        self.plan = plan
        self.consolidated_dtype = consolidated_dtype
        self.adapters = adapters
        # A save's size before there is a checkpoint to size it by: with adapters, only they are
        # saved (a 70B base would otherwise ask for ~1.2 TB free).
        self.parameters = (trainable_parameters if adapters else count_parameters)(engine.module)
        self.writer = GuardedWriter(engine.checkpoint_engine)
        engine.checkpoint_engine = self.writer
        if hasattr(engine, "_copy_recovery_script"):
            engine._copy_recovery_script = self.writer.guard(engine._copy_recovery_script)
        self.committed_step: int | None = plan.saved["global_step"] if plan else None
        self.pending: Pending | None = None  # --async_save: written, not yet committed
        self.copy_wait_s = 0.0  # --async_save: what optimizer steps waited for snapshot copies
        # the last save's: its consolidation's error, the consolidated adapter's summary
        self.consolidation_error: str | None = None
        self.adapter_summary: dict[str, object] | None = None  # for the manifest
        self.evaluated: dict[str, float] | None = None  # the last eval row (the trainer's)
        # Where commits and failed saves go (MetricsWriter.event); every rank calls it: no raising.
        self.on_event: Callable[..., None] = _no_event
        self.cadence = Cadence()  # whether saves come faster than they are written
        self.remote = remote if remote is not None else NoRemoteCopy()
        self.remote.catch_up(storage)  # a copy a stopped run left unfinished
        head = plan.head if plan else None
        seen_seq = max(seen_seq, plan.max_seq if plan else 0)
        self.lineage = Lineage(storage, self.leader, head, seen_seq, best)
        self.staging = Staging(
            storage, self.leader, self.lineage.deleter, self._space_needed, still_ours
        )

    def _space_needed(self) -> int:
        """This storage's share of a save: the last checkpoint's size, or an estimate from the
        parameters."""
        return space_needed(self.lineage.last_bytes, self.parameters, self.layout.share)

    # --- save: check → snapshot → write -----------------------------------------------------

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
        tag = tag_for(step)
        clock = Clock()
        io = SaveIO()
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

    def snapshot(self, step: int, background: bool = False) -> Snapshot:
        """In memory; a failure is recorded for the agree step, never raised. Collective: one
        all-reduce of the log window, so trainer_state.json holds the world's sum (what another
        world size resumes from) while each rank's file keeps its own (what the same one does)."""
        snap = Snapshot(step)
        self.writer.reset(self.out / STAGING / tag_for(step), step, background)
        self.consolidation_error = None
        self.adapter_summary = None
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
        module = self.engine.module
        dtype = self.consolidated_dtype
        record = self.writer.record
        rng_file = str(folder / f"rng_state_{dist.rank()}.pt")

        def shared() -> Files:
            """A leader's config, tokenizer and trainer_state.json. config.json records the
            dtype of the consolidated weights to be written beside it (a consolidation that
            fails drops only them: export rebuilds them from the rank files in any dtype)."""
            if not self.leader or record.error is not None:
                return {}
            return write_shared(
                self.storage,
                module,
                self.tokenizer,
                folder,
                snap,
                dtype if consolidated else None,
                self.adapters,
                record.cancelled,
            )

        def own() -> Files:
            if snap.rng is not None:  # under --async_save, queued for the writer's thread
                self.writer.save(snap.rng, rng_file)
            return shared() if self.writer.queue is None else {}

        if self.writer.queue is not None:  # --async_save: the shared files on the thread too,
            own()
            self.writer.queue.then(folder, lambda: record.files.update(shared()))  # after the rest
        else:
            # Rank-local I/O before the agree step's all-gather: polled, so a hung write fails
            # the save.
            out = dist.gather_outcomes(
                own,
                step=f"writing {tag}'s RNG and shared files",
                deadline_s=dist.io_deadline(),
                cancel=record.cancelled,
            )
            if out.own is not None:  # recorded; the agree step decides for all ranks
                self.writer.fail(folder, out.own)
            self.writer.files.update(out.result or {})
        if consolidated:
            self.write_consolidated(folder, module)

    def write_consolidated(self, folder: Path, module: torch.nn.Module) -> None:
        """The optional consolidated weights, last: every rank's partitioned files, RNG and the
        shared files are on disk first (the gather is collective, so every rank is past its own
        writes), so they never lose the space they need to a file the checkpoint can do
        without. Under --async_save the background writes go on meanwhile: there they share the
        free space. Every rank gathers, even one whose writes failed. Collective."""
        files, self.adapter_summary, self.consolidation_error = write_consolidated(
            module, folder, self.consolidated_dtype, self.ckpt.max_shard_size, self.adapters
        )
        self.writer.files.update(files)

    # --- commit: agree → commit → retain → copy -----------------------------------------------

    def _complete(self, pending: Pending) -> Path:
        """A written save: agree, commit, retain, offer it to the bucket's copy. Collective."""
        self.pending = None
        tag = pending.tag
        clock = pending.clock
        if pending.background:
            clock.lap("background")
        files = self.agree(tag)
        clock.lap("agree")
        self.commit(tag, files, pending.consolidated and not self.consolidation_error, pending.eval)
        clock.lap("commit")
        self.retain()
        clock.lap("retain")
        head = self.lineage.head  # --remote_output_dir
        self.remote.offer(
            tag,
            self.writer.files,
            files,
            head.save_id if head else None,
            head.lineage if head else None,
        )
        self.committed_step = pending.step
        total = sum(size for size, _ in files.values())
        self.on_event(
            "checkpoint",
            pending.step,
            tag=tag,
            bytes=total,
            seconds=round(clock.total, 3),
            consolidated=pending.consolidated and self.consolidation_error is None,
            # each phase's seconds: --async_save's writer time is "copy" and "background"
            phases={name: round(seconds, 3) for name, seconds in clock.laps},
            writer_s=round(clock.writer, 3),
            # rank 0's writer's own seconds, pacing excluded: what `finetune ls` shows
            writer_busy_s=round(self.writer.record.busy_s(), 3),
        )
        own = pending.io.finish(tag, self.writer.files, clock.total)
        logger.info("%s", finished(tag, clock, total, own, pending.final))
        return self.out / tag

    def agree(self, tag: str) -> Files:
        """Collective: every rank's outcome. On any failure, clean up and raise on every rank.
        Returns the files this storage holds (every rank's on shared storage)."""
        mine = (self.writer.error, self.writer.files, self.consolidation_error)
        outcomes = dist.gather_outcomes(lambda: mine, share=True, inline=True).results
        bad = {r: err for r, (err, _, _) in enumerate(outcomes) if err}
        if bad:
            freed = self.staging.drop(tag)
            raise SaveError(f"save of {tag} failed on {describe(bad)}; latest is unchanged{freed}")
        consolidation = {r: err for r, (_, _, err) in enumerate(outcomes) if err}
        files: Files = {}
        for r, (_, rank_files, _) in enumerate(outcomes):
            if r in self.layout.my_group:  # on shared storage, every rank
                files.update(rank_files)
        if consolidation:
            self.consolidation_error = describe(consolidation)
            files = {n: v for n, v in files.items() if not is_consolidated(n)}
            self.staging.drop_consolidated(tag, self.consolidation_error)
        return files

    def commit(
        self,
        tag: str,
        files: Files,
        consolidated: bool,
        evaluated: dict[str, float] | None = None,
    ) -> None:
        """Leaders: manifests (``evaluated``: its step's eval row, best.py) into staging, agree,
        then rename and advance ``latest``. Collective."""
        identity = self.lineage.identity(tag, self.run_id, evaluated)
        identity["consolidated"] = consolidated
        if dist.sequence_parallel_size() > 1:  # absent: 1 (every rank held whole rows)
            identity["sequence_parallel_size"] = dist.sequence_parallel_size()
        preference = self.run_info.get(REFERENCE_KEY)
        if preference:  # absent: sft (a preference objective's, with its reference)
            identity[REFERENCE_KEY] = preference
        # what `finetune verify` holds the adapter file to
        if consolidated and self.adapter_summary is not None:
            identity["adapter"] = self.adapter_summary
        ranks = self.layout.my_group if self.layout.node_local else None
        self.staging.ensure_lease_or_drop(f"committing {tag}", tag)

        def prepare() -> None:
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

    def retain(self) -> None:
        """--save_total_limit over this run's line, less what the bucket's copy has not yet
        committed (retention.py). Collective."""
        keep = self.remote.unconfirmed()
        self.lineage.retain(self.ckpt.save_total_limit, self.staging.ensure_lease, keep)

    # --- load ----------------------------------------------------------------------------------

    def load(self) -> bool:
        """Restore the engine, the states and this rank's RNG from the plan (contents.restore);
        False when starting fresh. Collective."""
        if self.plan is None:
            return False
        restore(self.plan, self.engine, self.states, self.out, self.adapters)
        return True
