"""CheckpointManager: when to save, crash-safe saves, retention, and restoring a run.

Built once, after the engine, with the objects whose state a checkpoint holds (the engine, the
training progress, the sampler; each rank's RNG) and the resume plan chosen before the engine
existed (resume.py). *When* to save (``at_step``: every --save_steps; ``at_preemption``;
``at_end``) and the --on_save_error policy are its SaveSchedule part (schedule.py); the trainer
only reports step boundaries.

A save is four functions, in order (--async_save runs the write's files on a thread and the agree
and commit at a later boundary: ``poll``/``wait``):
  snapshot  each rank captures what is not on the engine: its RNG, and (leaders) trainer_state;
  write     every rank calls ``engine.save_checkpoint`` into ``OUT/.staging/<tag>`` (a collective),
            through a checkpoint engine that fsyncs and checksums each file *as it is written* and
            records a failure instead of raising, so every rank still reaches DeepSpeed's barriers;
            then its RNG file; leaders also config, tokenizer and trainer_state.json, hashing only
            those. No rank reads back what another rank wrote: each rank's save
            work is its own share;
  agree     one all-gather of every rank's outcome: all succeeded, or everyone learns who failed;
  commit    leaders write manifest.json (files, sizes, checksums, commit sequence number, parent,
            save id) into the staged folder, agree, then rename it to ``OUT/<tag>`` and replace
            ``OUT/latest``.
A crash at any instant leaves every committed checkpoint complete and ``latest`` naming one (or
absent). A consolidation failure drops only the safetensors files: the partitioned checkpoint is
still committed.

Node-local storage (DeepSpeed's ``checkpoint.use_node_local_storage``): each node has its own
OUT, so every node's first rank (its *leader*) does there what rank 0 does on shared storage,
for the files of that node's ranks; its manifest lists those ranks. The commit has two phases:
all leaders write their manifests into staging and agree, and only then does any leader rename
its folder and advance its ``latest``. Resume takes the newest save present, with the same save
id, on every node. The free-space check asks for this node's share.

Every step that one rank (or one leader) does alone and that precedes a collective runs through
``dist.gather_outcomes`` / ``dist.run_agreed``: a failure there reaches every rank.

Fault sites (faults.py): ``manager.history``, ``save.*``, ``retention.delete``, ``resume.load_rng``,
``resume.truncate_metrics``. Test seams: ``FINETUNE_SKIP_SPACE_CHECK=1`` skips
the free-space pre-check so a test can provoke a real ENOSPC in the middle of a write;
``FINETUNE_SLOW_COMMIT=<seconds>`` has each leader wait that long before writing manifest.json, so
a test can fill the disk between a save's write and its commit;
``FINETUNE_SAVE_IO=<dir>`` writes each rank's save I/O accounting to ``<dir>/<tag>-rank<r>.json``.

A failed save's error line says what removing its staging freed, the free space left and what a
save needs (a full disk stays full after a failed save; the next one is refused up front).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import distributed as dist
from finetune.checkpoint.accounting import Clock, SaveIO, fmt_bytes, space_report
from finetune.checkpoint.adapter import ADAPTER_WEIGHTS, write_adapter_config
from finetune.checkpoint.layout import Layout
from finetune.checkpoint.lease import LeaseLost
from finetune.checkpoint.manifest import MANIFEST
from finetune.checkpoint.outdir import (
    STAGING,
    Deleter,
    OutputDir,
    committed,
    step_of,
    tag_for,
)
from finetune.checkpoint.policy import (
    Committed,
    line_of,
    select_for_deletion,
    space_needed,
)
from finetune.checkpoint.resume import ResumePlan
from finetune.checkpoint.rng import rng_state, set_rng_state
from finetune.checkpoint.schedule import SaveError, SaveSchedule
from finetune.checkpoint.state import TRAINER_STATE, LogWindow, TrainingState
from finetune.checkpoint.writer import GuardedWriter
from finetune.config import CheckpointArgs
from finetune.distributed import logger
from finetune.io import seams
from finetune.io.durable import (
    WriteCancelled,
)
from finetune.io.faults import fault_point
from finetune.ops import replay_adam_steps

# Adam keeps fp32 master weights + two moments (12 B/param); the module states add a copy.
BYTES_PER_PARAM_ESTIMATE = 16
SPACE_MARGIN = 1.10
RANK_WINDOW = "log_window"  # in rng_state_{r}.pt: rank r's own log window (state.py)
CONSOLIDATED_PATTERNS = (
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    ADAPTER_WEIGHTS,
)


def versions() -> dict:
    import deepspeed
    import transformers

    import finetune

    return {
        "finetune": finetune.__version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
    }


@dataclass
class Snapshot:
    """What a save captures before writing: this rank's RNG, and (leaders) the trainer state."""

    step: int
    rng: dict | None = None
    trainer_state: dict | None = None


@dataclass
class Pending:
    """A save between its write and its commit (--async_save: written on a thread meanwhile)."""

    step: int
    tag: str
    clock: Clock
    io: SaveIO
    consolidated: bool
    final: bool
    background: bool


class CheckpointManager(SaveSchedule):
    def __init__(
        self,
        storage: OutputDir,
        ckpt: CheckpointArgs,
        layout: Layout,
        *,
        engine,
        progress: TrainingState,
        sampler,
        tokenizer,
        run_info: dict,
        run_id: str,
        plan: ResumePlan | None = None,
        consolidated_dtype: torch.dtype = torch.float32,
        still_ours=lambda: True,
        adapters: bool = False,
    ):
        """``run_info``: what trainer_state.json records besides the progress (zero stage, dtype,
        args); ``run_id``: the same on every rank (names this run's save ids); ``still_ours``:
        whether this run still holds OUT's lease (asked by the leader before each commit);
        ``adapters`` (--use_peft): the engine's module is a peft model whose base is frozen. Its
        checkpoints leave the base out (the rank files hold only the adapters' state) and add
        adapter_config.json; their consolidated weights are the adapters (checkpoint/adapter.py)."""
        from finetune.lora import trainable_parameters
        from finetune.modeling import count_parameters

        self.storage, self.ckpt, self.layout, self.out = storage, ckpt, layout, storage.root
        self.engine, self.progress, self.sampler, self.tokenizer = (
            engine,
            progress,
            sampler,
            tokenizer,
        )
        self.run_info, self.run_id, self.plan = run_info, run_id, plan
        self.consolidated_dtype, self.still_ours, self.adapters = (
            consolidated_dtype,
            still_ours,
            adapters,
        )
        # the consolidated adapter's tensors and bytes, for the manifest
        self.adapter_summary: dict | None = None
        self.leader = layout.leader
        # What a save's size is estimated from, before there is a checkpoint to size it by: with
        # adapters, only they are saved (a 70B base would otherwise ask for ~1.2 TB free).
        self.parameters = (
            trainable_parameters(engine.module) if adapters else count_parameters(engine.module)
        )
        self.writer = GuardedWriter(engine.checkpoint_engine)
        engine.checkpoint_engine = self.writer
        if hasattr(engine, "_copy_recovery_script"):
            engine._copy_recovery_script = self.writer.guard(engine._copy_recovery_script)
        self.committed_step: int | None = plan.saved["global_step"] if plan else None
        self.consolidation_error: str | None = None
        # --async_save: written in the background, not yet committed
        self.pending: Pending | None = None
        # Where commits and failed saves are reported (MetricsWriter.event: OUT/events.jsonl and the
        # trackers, rank 0); called on every rank, must not raise.
        self.on_event: Callable[..., None] = lambda kind, step, **fields: None
        self.deleter = Deleter(storage)  # retention's deletions, in the background (leaders)
        self._read_history(plan.head if plan else None, plan.max_seq if plan else 0)

    def _read_history(self, head: Committed | None, seen_seq: int) -> None:
        """The line this run continues (rank 0's view, for every rank), the next commit sequence
        number (above any on any storage) and this storage's last checkpoint size. Collective."""

        def mine():
            fault_point("manager.history")
            found = committed(self.storage)
            line = line_of(head, found) if head else []
            mine_head = next(
                (c for c in found if head and c.tag == head.tag and c.save_id == head.save_id), None
            )
            return (
                [c.tag for c in line],
                max((c.seq or 0 for c in found), default=0),
                mine_head.total_bytes if mine_head else None,
                {c.tag: c.total_bytes or 0 for c in found},
            )

        out = dist.gather_outcomes(
            mine,
            on=self.leader,
            share=True,
            step="reading the commit history",
            deadline_s=dist.io_deadline(),
        )
        out.raise_any()
        views = [v for v in out.results if v is not None]
        self.line: list[str] = views[0][0]  # tags, oldest first; what retention counts
        self.next_seq = 1 + max([seen_seq] + [v[1] for v in views])
        self.head = head
        self.last_bytes = out.result[2] if out.result else None
        # this storage's, by tag: what deleting frees
        self.sizes: dict[str, int] = out.result[3] if out.result else {}

    # --- save: snapshot → write → agree → commit ------------------------------------------------

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
        # at most one save in flight (at_step reports its failure under its own step first)
        self.wait()
        tag, clock, io = tag_for(step), Clock(), SaveIO()
        self.ensure_lease(f"saving {tag}", step)  # before its staging is cleared and written
        consolidated = self.ckpt.save_consolidated if consolidated is None else consolidated
        self.check_space(tag)
        clock.lap("check")
        snap = self.snapshot(step, background)
        clock.lap("snapshot")
        self.clear_staging(tag)
        self.write(tag, snap, consolidated)
        self.writer.start()
        clock.lap("write" if not background else "copy")
        pending = Pending(step, tag, clock, io, consolidated, final, background)
        if background:
            self.pending = pending
            logger.info(
                "Snapshot of %s in %.2f seconds (%s of host memory); writing it in the background.",
                tag,
                clock.total,
                fmt_bytes(self.writer.snapshot_bytes),
            )
            return None
        return self._complete(pending)

    def poll(self) -> None:
        """At a step boundary: commit the save in flight if every rank has written its files.
        One all-reduce while a save is in flight, nothing otherwise. Collective."""
        if self.pending is None:
            return
        waiting = dist.all_reduce_sum([0.0 if self.writer.done() else 1.0])[0]
        if waiting == 0:
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
            freed = self._drop_staging(tag)
            raise SaveError(f"save of {tag} failed on {out.describe()}; latest is unchanged{freed}")
        return self._complete(self.pending)

    def abandon(self) -> None:
        """This run lost its output dir's lease: a background write stops at its next piece and
        retention's deletions at their next file; nothing is committed or cleaned up."""
        self.writer.cancel()
        self.deleter.stop()
        self.pending = None

    def _complete(self, pending: Pending) -> Path:
        """agree → commit → retain. Collective."""
        self.pending = None
        tag, clock = pending.tag, pending.clock
        if pending.background:
            clock.lap("background")
        files = self.agree(tag)
        clock.lap("agree")
        self.commit(tag, files, pending.consolidated and self.consolidation_error is None)
        clock.lap("commit")
        self.retain()
        clock.lap("retain")
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
        logger.info(
            "Finished saving the checkpoint %s in %.2f seconds (%.1f MB, %.1f MB/s; %s; rank 0 "
            "wrote %.1f MB and read back %.2f MB)%s.",
            tag,
            clock.total,
            total / 1e6,
            total / 1e6 / max(clock.total, 1e-9),
            clock,
            own["own_bytes"] / 1e6,
            own["hashed_bytes"] / 1e6,
            " [final]" if pending.final else "",
        )
        return self.out / tag

    def check_space(self, tag: str) -> None:
        """Leaders: enough free space for this storage's share? Agreed; SaveError on
        every rank if not."""
        need = self.space_needed()

        def problem():
            fault_point("save.check_space", step_of(tag))
            if seams.enabled(seams.SKIP_SPACE_CHECK):
                return None  # lets tests hit a real ENOSPC mid-write
            free = self.storage.free_bytes()
            if free < need <= free + self.deleter.pending_bytes:
                # retention is still deleting older checkpoints: what it frees counts
                self.deleter.drain()
                free = self.storage.free_bytes()
            return None if free >= need else f"{fmt_bytes(free)} free, need ~{fmt_bytes(need)}"

        out = dist.gather_outcomes(
            problem,
            on=self.leader,
            share=True,
            step=f"checking free space for {tag}",
            deadline_s=dist.io_deadline(),
        )
        bad = {r: p for r, p in enumerate(out.results) if p}
        bad.update(out.errors)
        if bad:
            raise SaveError(
                f"not saving {tag}: not enough free space in {self.out} ({_describe(bad)})"
            )

    def space_needed(self) -> int:
        """Bytes a save needs on this storage (the previous checkpoint's size
        there, or an estimate)."""
        return space_needed(
            self.last_bytes,
            self.parameters,
            self.layout.share,
            BYTES_PER_PARAM_ESTIMATE,
            SPACE_MARGIN,
        )

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
                progress = {
                    **self.progress.state_dict(),
                    "window": window.summed(totals).state_dict(),
                }
                snap.trainer_state = {
                    **progress,
                    **self.run_info,
                    "world_size": dist.world_size(),
                    "versions": versions(),
                }
        except Exception as e:  # noqa: BLE001 — recorded; the agree step decides for all ranks
            self.writer.fail("the snapshot", e)
        return snap

    def clear_staging(self, tag: str) -> None:
        """Leaders remove what a crashed save of the same step left in staging, before DeepSpeed's
        collective write. Polled; SaveError on every rank if it failed. Collective."""

        def clear():
            fault_point("save.clear_staging", step_of(tag))
            self.storage.remove(f"{STAGING}/{tag}")

        out = dist.gather_outcomes(
            clear, on=self.leader, step=f"clearing {STAGING}/{tag}", deadline_s=dist.io_deadline()
        )
        if not out.ok:
            raise SaveError(f"save of {tag} failed on {out.describe()}; latest is unchanged")

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
        if consolidated:
            self._write_consolidated(folder)

        def own_files() -> dict[str, tuple[int, str]]:
            if snap.rng is not None:  # --async_save: its host copy, written by the writer's thread
                self.writer.save(snap.rng, str(folder / f"rng_state_{dist.rank()}.pt"))
            if self.leader and self.writer.error is None:
                return self._write_shared(
                    folder, snap, consolidated and self.consolidation_error is None
                )
            return {}

        # Rank-local I/O before the agree step's all-gather: polled, so a hung write fails the save.
        out = dist.gather_outcomes(
            own_files,
            step=f"writing {tag}'s RNG and shared files",
            deadline_s=dist.io_deadline(),
            cancel=self.writer.record.cancelled,
        )
        if out.own is not None:  # recorded; the agree step decides for all ranks
            self.writer.fail(folder, out.own)
        self.writer.files.update(out.result or {})

    def _write_consolidated(self, folder: Path) -> None:
        """Collective: every rank gathers, even one whose own writes already failed."""
        from finetune.checkpoint.adapter import save_adapter
        from finetune.checkpoint.consolidate import (
            ConsolidationFailed,
            save_consolidated,
        )

        try:
            # the adapters alone, as peft saves them (the base is elsewhere, unchanged)
            if self.adapters:
                files, self.adapter_summary = save_adapter(
                    self.engine.module, folder, self.consolidated_dtype
                )
                self.writer.files.update(files)
            else:
                self.writer.files.update(
                    save_consolidated(
                        self.engine.module,
                        folder,
                        self.consolidated_dtype,
                        self.ckpt.max_shard_size,
                    )
                )
        except ConsolidationFailed as e:
            # every rank is past the gathers: recorded, only safetensors dropped
            self.consolidation_error = str(e)
        except Exception as e:
            # Escaped mid-gather (a transport error): this rank may have left the others inside a
            # collective, so agreeing now could hang. Fail loudly; nothing was committed.
            raise RuntimeError(
                f"the consolidated save raised on rank {dist.rank()} mid-gather; stopping because "
                f"the ranks may be out of step: {type(e).__name__}: {e}"
            ) from e

    def _write_shared(
        self, folder: Path, snap: Snapshot, consolidated: bool
    ) -> dict[str, tuple[int, str]]:
        """A leader's files: config, tokenizer, trainer_state.json; hashes only what it wrote here.
        Returns them (never records them itself: a write that hung past its deadline and returns
        later must not touch a later save's list)."""
        fault_point("save.shared_files", snap.step)
        module = self.engine.module
        config = copy.deepcopy(module.config)
        config.use_cache = True  # turned off for training only; inference wants it
        # config.json describes the safetensors beside it, whatever the training dtype
        if consolidated:
            config.dtype = self.consolidated_dtype
        config.save_pretrained(folder)
        written = [folder / "config.json"]
        if getattr(module, "generation_config", None) is not None and module.can_generate():
            module.generation_config.save_pretrained(folder)
            written.append(folder / "generation_config.json")
        written += [Path(p) for p in self.tokenizer.save_pretrained(folder)]
        if self.adapters:  # what export and PeftModel.from_pretrained need to rebuild the adapters
            written.append(write_adapter_config(module, folder))
        files = {}
        if self.writer.record.cancelled.is_set():  # given up on (a hung write above): write no more
            raise WriteCancelled(f"{folder}: the save was given up")
        staged = f"{STAGING}/{folder.name}"
        for name in dict.fromkeys(path.name for path in written):
            if self.storage.is_file(f"{staged}/{name}"):
                files[name] = self.storage.storage.checksum(f"{staged}/{name}")
                self.storage.storage.sync(f"{staged}/{name}")
        files[TRAINER_STATE] = self.storage.write_json(
            f"{staged}/{TRAINER_STATE}", snap.trainer_state
        )
        return files

    def agree(self, tag: str) -> dict[str, tuple[int, str]]:
        """Collective: every rank's outcome. On any failure, clean up and raise on every rank.
        Returns the files this storage holds (every rank's on shared storage)."""
        mine = (self.writer.error, self.writer.files, self.consolidation_error)
        outcomes = dist.gather_outcomes(lambda: mine, share=True, inline=True).results
        bad = {r: err for r, (err, _, _) in enumerate(outcomes) if err}
        if bad:
            freed = self._drop_staging(tag)
            raise SaveError(f"save of {tag} failed on {_describe(bad)}; latest is unchanged{freed}")
        consolidation = {r: err for r, (_, _, err) in enumerate(outcomes) if err}
        files: dict[str, tuple[int, str]] = {}
        for r, (_, rank_files, _) in enumerate(outcomes):
            if r in self.layout.my_group:  # on shared storage, every rank
                files.update(rank_files)
        if consolidation:
            self.consolidation_error = _describe(consolidation)
            files = {n: v for n, v in files.items() if not _is_consolidated(n)}
            out = dist.gather_outcomes(
                lambda: self.storage.remove_matching(f"{STAGING}/{tag}", CONSOLIDATED_PATTERNS),
                on=self.leader,
                step=f"removing {tag}'s partial safetensors",
                deadline_s=dist.io_deadline(),
            )
            if not out.ok:  # the files are left but unlisted; the checkpoint is still complete
                dist.log_main(
                    logging.WARNING,
                    "could not remove partial safetensors files: %s",
                    out.describe(),
                )
            dist.log_main(
                logging.WARNING,
                "consolidated weights of %s not written (%s); committing the partitioned "
                "checkpoint without them: `finetune export` can rebuild them from it",
                tag,
                self.consolidation_error,
            )
        return files

    def _drop_staging(self, tag: str, written: bool = False) -> str:
        """Leaders remove a failed save's staging (polled: it can be large). Collective. Returns
        what that freed, the free space left and what a save needs, for the error line ("" when
        the removal failed: it is logged here). ``written``: every file of the save was written
        (only its publishing failed), so DeepSpeed's recovery scripts are whole and kept."""
        try:
            self.ensure_lease(f"removing {STAGING}/{tag}", step_of(tag))
        except SaveError as e:  # left for the next start to tidy
            dist.log_main(logging.WARNING, "%s", e)
            return ""

        def remove():
            fault_point("save.drop_staging", step_of(tag))
            freed = self.storage.remove(f"{STAGING}/{tag}") or 0
            freed += self.storage.finish_staging(saved=written) or 0
            try:
                free = self.storage.free_bytes()
            except OSError:
                free = None  # the folder is gone all the same: report what is known
            return freed, free

        out = dist.gather_outcomes(
            remove,
            on=self.leader,
            share=True,
            step=f"removing {STAGING}/{tag}",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            dist.log_main(
                logging.WARNING,
                "could not remove %s/%s (%s); it is removed at the next start",
                STAGING,
                tag,
                out.describe(),
            )
            return ""
        freed = {r: v for r, v in enumerate(out.results) if v is not None}
        return f"; {space_report(freed, self.space_needed())}" if freed else ""

    def commit(self, tag: str, files: dict[str, tuple[int, str]], consolidated: bool) -> None:
        """Leaders: manifests into staging, agree, then rename and advance
        ``latest``. Collective."""
        seq = self.next_seq
        self.next_seq += 1  # consumed even if the commit fails: a save id is never reused
        parent = self.head
        if parent is not None and parent.tag == tag:  # a same-tag re-commit replaces its parent
            parent = (
                Committed(parent.parent, save_id=parent.parent_save_id) if parent.parent else None
            )
        identity = {
            "commit_seq": seq,
            "save_id": f"{self.run_id}-{seq}",
            "parent": parent.tag if parent else None,
            "parent_save_id": parent.save_id if parent else None,
            "consolidated": consolidated,
        }
        # what `finetune verify` holds the adapter file to
        if consolidated and self.adapter_summary is not None:
            identity["adapter"] = self.adapter_summary
        ranks = self.layout.my_group if self.layout.node_local else None
        try:
            self.ensure_lease(f"committing {tag}", step_of(tag))
        except SaveError as e:
            raise SaveError(f"{e}{self._drop_staging(tag)}") from e

        def prepare():
            seams.pause(seams.SLOW_COMMIT)  # a moment for a test to fill the disk
            try:
                self.storage.prepare_commit(
                    tag, files, dist.world_size(), versions(), ranks, identity
                )
            except OSError as e:
                # a failed write names no file: name it
                if e.filename is None and e.errno is not None:
                    raise OSError(
                        e.errno, e.strerror, str(self.out / STAGING / tag / MANIFEST)
                    ) from e
                raise

        out = dist.gather_outcomes(
            prepare, on=self.leader, step=f"writing {tag}'s manifest", deadline_s=dist.io_deadline()
        )
        if not out.ok:
            freed = self._drop_staging(tag)
            raise SaveError(
                f"commit of {tag} failed on {out.describe()}; latest is unchanged{freed}"
            )
        try:
            self.ensure_lease(f"publishing {tag}", step_of(tag))
        except SaveError as e:
            raise SaveError(f"{e}{self._drop_staging(tag)}") from e
        given_up = threading.Event()
        out = dist.gather_outcomes(
            lambda: self.storage.publish(tag, given_up),
            on=self.leader,
            step=f"publishing {tag}",
            deadline_s=dist.io_deadline(),
            cancel=given_up,
        )
        if given_up.is_set() and not self._in_place(tag, identity["save_id"]):
            # A rename stuck past its deadline may still complete when the filesystem recovers: its
            # staging is left alone (a purge racing the rename could put a half-deleted folder in
            # place). A complete folder that lands later is found by the commit order.
            raise SaveError(
                f"commit of {tag} failed on {out.describe()}; its staging is left "
                "in place, `latest` is unchanged"
            )
        if not out.ok and not self._in_place(tag, identity["save_id"]):
            # Only a rename or the `latest` write failed, after every node had its files complete.
            self._drop_staging(tag, written=True)  # a no-op where the rename happened
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
        self.head = Committed(
            tag,
            seq,
            identity["save_id"],
            identity["parent"],
            identity["parent_save_id"],
            sum(size for size, _ in files.values()),
        )
        self.line = [t for t in self.line if t != tag] + [tag]
        self.last_bytes = self.sizes[tag] = self.head.total_bytes

    def ensure_lease(self, before: str, step: int | None) -> None:
        """Right before a commit, a publish, retention or a cleanup: rank 0 re-reads OUT's lease
        (``still_ours``). LeaseLost on every rank if another run holds it; SaveError on every rank
        if it could not be read (nothing is done then either). Polled. Collective."""

        def check():
            fault_point("lease.check", step)
            return self.still_ours()

        out = dist.gather_outcomes(
            check,
            on=dist.is_main(),
            share=True,
            step="checking the output dir's lease",
            deadline_s=dist.io_deadline(),
        )
        if not out.ok:
            raise SaveError(
                f"could not check {self.out}'s lease before {before} "
                f"({out.describe()}); not {before}"
            )
        if out.results[0] is False:
            raise LeaseLost(f"another run took over {self.out}'s lease; not {before}")

    def _in_place(self, tag: str, save_id: str) -> bool:
        """Whether every storage holds this save under its name: after a failed publish, that only
        ``latest`` failed. Leaders read their manifest; agreed. Collective."""
        out = dist.gather_outcomes(
            lambda: (self.storage.read_manifest(tag) or {}).get("save_id") == save_id,
            on=self.leader,
            share=True,
            step=f"reading {tag}'s manifest",
            deadline_s=dist.io_deadline(),
        )
        placed = [v for v in out.results if v is not None]
        return out.ok and bool(placed) and all(placed)

    def retain(self) -> None:
        """--save_total_limit K: keep the K newest of this run's line (what it resumed from and what
        it committed since); nothing else is counted or deleted. Decided from facts every rank
        shares; leaders delete (rename to trash, then remove), polled. Collective."""
        limit = self.ckpt.save_total_limit
        if not limit:
            return
        doomed = select_for_deletion(self.line, limit, {self.head.tag})
        if not doomed:
            return
        try:
            self.ensure_lease("deleting older checkpoints", step_of(self.head.tag))
        except SaveError as e:  # the save itself is committed: retried after the next one
            dist.log_main(logging.WARNING, "save_total_limit %d: %s", limit, e)
            return

        # (tag, its trash): what this leader renamed, even if a later one failed
        moved: list[tuple[str, str]] = []

        def retire():
            fault_point("retention.delete", step_of(self.head.tag))
            # The one atomic step: out of the tag namespace. The files go in the background.
            for tag in doomed:
                if self.storage.exists(tag):
                    moved.append((tag, self.storage.retire(tag)))

        given_up = threading.Event()
        out = dist.gather_outcomes(
            retire, on=self.leader, step="retention", deadline_s=dist.io_deadline(), cancel=given_up
        )
        # a rename given up on may land later: its folder is tidied at the next start
        if not given_up.is_set():
            for tag, trash in moved:
                self.deleter.add(trash, self.sizes.pop(tag, 0), tag)
        if out.ok:
            self.line = [t for t in self.line if t not in doomed]
            dist.log_main(
                logging.INFO,
                "save_total_limit %d: deleting %s in the background",
                limit,
                ", ".join(doomed),
            )
        else:  # kept in the line: retried after the next save
            dist.log_main(
                logging.WARNING,
                "save_total_limit %d: could not delete %s (%s); retrying after the next save",
                limit,
                ", ".join(doomed),
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
                "older checkpoints not deleted completely (%s); what is left under "
                ".trash-* is removed at the next start",
                out.describe(),
            )

    # --- load ----------------------------------------------------------------------------------

    def load(self) -> bool:
        """Restore the engine, progress, sampler and this rank's RNG from the plan; False when
        starting fresh. Collective."""
        plan = self.plan
        if plan is None:
            return False
        start, folder = time.perf_counter(), plan.folder
        load_dir, tag = (
            (str(folder), plan.universal.name)
            if plan.universal
            else (str(folder.parent), folder.name)
        )
        # --use_peft: the rank files hold no frozen base weight, so the module's state
        # is partial (the adapters' own weights come from the optimizer's fp32
        # partitions, as in full fine-tuning).
        load_path, _ = self.engine.load_checkpoint(
            load_dir,
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            **({"load_module_strict": False} if self.adapters else {}),
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {folder}")
        # CPU Adam's running beta powers, as the uninterrupted run has them
        replay_adam_steps(self.engine)
        self.progress.load_state_dict(plan.saved)
        self.sampler.load_state_dict(self.progress.sampler)
        rng_file = folder / f"rng_state_{dist.rank()}.pt"

        def load_rng():
            fault_point("resume.load_rng")
            if not rng_file.exists():  # (the plan's folder may be outside OUT: a local path)
                return None
            state = torch.load(rng_file, weights_only=True)
            set_rng_state(state)
            return state

        state = dist.run_agreed(
            load_rng, step="restoring each rank's RNG", deadline_s=dist.io_deadline()
        )
        if state is None:
            logger.warning(
                "no RNG state for rank %d in %s (it had %d ranks); this rank keeps its seeded RNG",
                dist.rank(),
                folder.name,
                plan.saved["world_size"],
            )
        self.progress.window = restored_window(
            self.progress.window,
            (state or {}).get(RANK_WINDOW),
            plan.saved["world_size"] == dist.world_size(),
        )
        from finetune.metrics import truncate_after

        def truncate():
            fault_point("resume.truncate_metrics")
            truncate_after(self.out / "metrics.jsonl", self.progress.global_step)

        # metrics.jsonl is rank 0's, whatever the storage; a crashed run's tail goes.
        dist.run_agreed(
            truncate,
            on=dist.is_main(),
            step="trimming metrics.jsonl",
            deadline_s=dist.io_deadline(),
        )
        logger.info(
            "Resumed from %s at step %d (epoch %.2f) in %.2f seconds.",
            folder,
            self.progress.global_step,
            self.progress.epoch,
            time.perf_counter() - start,
        )
        return True


def restored_window(world: LogWindow, own: dict | None, same_world: bool) -> LogWindow:
    """This rank's log window after a resume. ``world``: trainer_state.json's (the world's sum;
    rank 0's own in checkpoints written before rank files kept theirs); ``own``: the rank file's.
    At the same world size each rank takes its own, so the next row sums exactly what the
    uninterrupted run's does; on another world size rank 0 takes the world's sum and the others
    start empty. Every rank keeps the window's step count, which decides (alike everywhere) whether
    a row is due at the end."""
    if same_world and own is not None:
        return LogWindow.from_state_dict(own)
    if dist.is_main():
        return world
    return LogWindow(
        steps=world.steps, skipped_steps=world.skipped_steps, lr=world.lr, grad_norm=world.grad_norm
    )


def _is_consolidated(name: str) -> bool:
    return name in ("model.safetensors", "model.safetensors.index.json", ADAPTER_WEIGHTS) or (
        name.startswith("model-") and name.endswith(".safetensors")
    )


def _describe(bad: dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(bad.items()))
