"""The training loop: optimizer steps, evaluation, logging, and the step boundary
where saves happen."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from finetune import distributed as dist
from finetune.checkpoint.checkpointer import Checkpointer
from finetune.checkpoint_format import best
from finetune.checkpoint_format.outdir import tag_for
from finetune.checkpoint_format.state import TrainingState
from finetune.config import RunConfig
from finetune.data import TrainData, model_inputs, to_device
from finetune.data.eval_sets import metric_prefix
from finetune.distributed import logger
from finetune.evaluation import Evaluation, describe, pair_metrics, token_metrics
from finetune.exit_status import EXIT_LEASE_LOST, REMOTE_COPY_FAILED
from finetune.lease import LeaseLost, describe_holder
from finetune.loss import (
    items_per_micro_batch,
    loss_scale,
    rescaled,
    sum_dtype,
)
from finetune.metrics import MetricsWriter
from finetune.objectives import STATS, Objective
from finetune.plot import Plotter
from finetune.preemption import EXIT_PREEMPTED, Preemption
from finetune.probe import maybe_probe
from finetune.remote.lease import RemoteLeaseLost
from finetune.trackers import run_name

if TYPE_CHECKING:
    from datasets import Dataset
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from finetune.reference import LiveReference

# Skipped optimizer steps in a row that stop a run: more than fp16's dynamic scaling ever needs
# (from the largest initial scale, 2**32, to 1 is 32 halvings plus its hysteresis; DeepSpeed itself
# raises at its minimum scale), so what trips this is a run that cannot recover: non-finite
# gradients under bf16/fp32 or a static fp16 scale, where nothing changes between attempts.
MAX_SKIPS_IN_A_ROW = 100

# Why the loop stops before its last step: PREEMPTED, EARLY_STOPPED, or an exit code (None: go on).
PREEMPTED = "preempted"
EARLY_STOPPED = "early_stopped"  # --early_stopping_patience: the final save, then exit 0
Stop = int | str | None


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


@dataclass
class Trainer:
    cfg: RunConfig
    engine: DeepSpeedEngine
    tokenizer: PreTrainedTokenizerBase
    data: TrainData
    evalset: Dataset | None
    total_steps: int
    checkpoints: Checkpointer
    metrics: MetricsWriter
    state: TrainingState
    preemption: Preemption
    plotter: Plotter | None = None  # rank 0's OUT/plots/training.png (--plot)
    stop_note: dict | None = None  # why and where training stopped, for exit_status.json
    skips_in_a_row: int = 0  # optimizer steps DeepSpeed skipped since the last applied one
    all_written: bool | None = None  # the last boundary's: every rank wrote its --async_save part
    step_labels: float | None = None  # the next step's label tokens, all ranks (the boundary's)
    # rank 0's heartbeat: has another run taken OUT's lease over? (asked at every boundary)
    lease_taken_over: Callable[[], bool] = lambda: False
    # training stopped because another run took OUT over: nothing more may be written into OUT
    out_given_up: bool = False
    t_window: float = 0.0  # when the log window began (tokens/s)
    # the model takes num_items_in_batch (transformers' loss kwargs); else its mean is rescaled
    loss_kwargs: bool = False
    objective: Objective | None = None  # a preference --objective (None: sft)
    reference: LiveReference | None = None  # --reference live: scored in the step
    # --eval_datasets: the named held-out sets (evaluated in place of ``evalset``)
    named_evals: dict[str, Dataset] = field(default_factory=dict)

    # --- the loop --------------------------------------------------------------------------

    def train(self) -> int:
        resumed = self.checkpoints.load()
        # The same length on every rank, for the all-reduces (a window restored on another world
        # size is the world's on rank 0 and empty elsewhere; an older checkpoint's has none).
        w = self.state.window
        n = len(self.data.source_names)
        w.source_tokens = (list(w.source_tokens) + [0] * n)[:n]
        w.pair_sums = self._pair_sums(w.pair_floats())
        self._started(resumed)
        if not resumed:
            self.evaluate()
        self.engine.train()  # once: evaluate() puts it back in train mode when it is done
        # In a log file (sbatch, tee) a redraw per step is noise: refresh twice a minute there.
        bar = tqdm(
            total=self.total_steps,
            initial=self.state.global_step,
            disable=not dist.is_main(),
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.1 if sys.stderr.isatty() else 30,
        )
        self.t_window = time.perf_counter()
        self.data.start()  # the first step's batches, prepared while the bar and the loop start
        try:
            # A signal during start-up, a first batch that failed, a lease lost while loading.
            # an early-stopped run resumed from its final checkpoint stops again at once
            unfinished = self.state.global_step < self.total_steps
            stop = self._boundary() or (self._early_stop() if unfinished else None)
            while stop is None and self.state.global_step < self.total_steps:
                stop = self._iteration(bar)
            bar.close()
            return self._end(stop)
        except LeaseLost as e:
            # raised alike on every rank (the boundary's all-reduce, or an agreed check)
            bar.close()
            return self._stop_lease_lost(e)

    def _iteration(self, bar: tqdm) -> Stop:
        """One pass of the loop: an optimizer step, then its row, boundary, eval and save. Returns
        why training stops (a Stop), or None to go on. Collective."""
        if not self._train_step():
            # Not a step: no row, eval or save for a step number twice. The same on every rank,
            # so no rank leaves the loop or skips a collective alone: see _skipped.
            return self._skipped() or self._boundary()
        self.skips_in_a_row = 0
        self.state.global_step += 1
        bar.update(1)
        if self._due(self.cfg.train.logging_steps):
            self._log(bar)
        if self.state.global_step == self.total_steps:
            # The final save comes after the loop whatever happens (a signal during the last step
            # only skips the final eval: _end_preempted).
            return None
        stop = self._boundary()  # collective; before any eval or periodic save of this step
        if stop is None and self.cfg.train.eval_steps and self._due(self.cfg.train.eval_steps):
            self.evaluate()
            stop = self._early_stop()  # the final save of this step follows (in _end)
        step = self.state.global_step
        return stop or self.checkpoints.at_step(step, self.total_steps, self.all_written)

    def _end(self, stop: Stop) -> int:
        """Where every run that did not lose its lease ends: the exit code. Collective."""
        if stop == PREEMPTED:
            return self._stop_preempted()
        if stop is not None and stop != EARLY_STOPPED:
            # a failed periodic save under --on_save_error abort, steps that kept failing, or the
            # bucket's copy given up
            self._note_copy_failure()
            return stop
        if self.state.window.steps:  # the steps since the last row (the same count on every rank)
            self._log(None)
        if stop == EARLY_STOPPED:
            pass  # this step was just evaluated: no second evaluation of it
        elif self._end_preempted():
            dist.log_main(
                logging.WARNING,
                "preemption signal during the last step: final evaluation skipped, "
                "so the final checkpoint commits before the grace period ends",
            )
        else:
            self.evaluate()
        maybe_probe(self.engine, self.tokenizer)  # test seam: FINETUNE_PROBE_LOGITS
        code = self.checkpoints.at_end(self.state.global_step)
        if stop == EARLY_STOPPED and code == 0:
            self.stop_note = self._early_stop_note()
        elif code != 0:
            self._note_copy_failure()
        return code

    def _note_copy_failure(self) -> None:
        """exit_status.json of a run whose copy to --remote_output_dir was given up: the bucket
        copy named, not a crash; OUT's newest checkpoint is committed."""
        why = self.checkpoints.remote.failed
        if why is None or self.stop_note is not None:
            return
        committed = self.checkpoints.committed_step
        self.stop_note = {
            "reason": REMOTE_COPY_FAILED,
            "error": why,
            "step": self.state.global_step,
            "checkpoint": tag_for(committed) if committed is not None else None,
        }

    # --- the best metric and early stopping (checkpoint_format/best.py) ---------------------------

    @cached_property
    def policy(self) -> best.BestPolicy:
        """The best metric's policy: the flags' (built once, not at every evaluation)."""
        return best.BestPolicy.from_args(self.cfg.train)

    def _evaluated(self, row: dict) -> None:
        """After an evaluation: early stopping's counters (training state) and the row a save of
        this step records in its manifest. Every rank alike (the row is all-reduced)."""
        self.checkpoints.evaluated = row
        best.record(self.state, self.policy, row)

    def _early_stop(self) -> Stop:
        """EARLY_STOPPED once --early_stopping_patience evaluations in a row did not improve, else
        None. Every rank decides alike without a collective: the counters follow all-reduced
        rows."""
        policy = self.policy
        st = self.state
        if not best.exhausted(st, policy):
            return None
        dist.log_main(
            logging.WARNING,
            "early stopping at step %d: %d evaluations in a row without %s improving on %.6g "
            "(step %s) by more than %g",
            st.global_step,
            st.evals_without_improvement,
            policy.metric,
            st.best_metric if st.best_metric is not None else float("nan"),
            st.best_metric_step,
            policy.threshold,
        )
        self.metrics.event("early_stopped", st.global_step, best_step=st.best_metric_step)
        return EARLY_STOPPED

    def _early_stop_note(self) -> dict:
        """exit_status.json of an early-stopped run."""
        st = self.state
        note = {"reason": "early_stopped", "step": st.global_step}
        note.update(best_metric=st.best_metric, best_metric_step=st.best_metric_step)
        if self.cfg.ckpt.save_checkpoint:
            note["best_checkpoint"] = best.protected(self.checkpoints.lineage.best)
        return note

    def _stop_lease_lost(self, e: LeaseLost) -> int:
        """Another run holds OUT now: stop at once and write nothing more there (no save, no
        commit, no metrics, no exit_status.json: they are the other run's). Every rank, agreed."""
        # --remote_output_dir's lease lost: OUT is still this run's (its exit_status.json says so)
        remote = isinstance(e, RemoteLeaseLost)
        self.out_given_up = not remote
        # a background write stops at its next piece; its staging is left as is
        self.checkpoints.abandon()
        dist.log_main(
            logging.ERROR,
            "stopping at step %d without writing anything more into %s: %s (exit %d)",
            self.state.global_step,
            self.cfg.ckpt.remote_output_dir if remote else self.cfg.ckpt.output_dir,
            e,
            EXIT_LEASE_LOST,
        )
        reason = "remote lease lost" if remote else "lease lost"
        self.stop_note = {"reason": reason, "step": self.state.global_step}
        return EXIT_LEASE_LOST

    def _started(self, resumed: bool) -> None:
        """OUT/events.jsonl (and the trackers): this launch's start, and what it resumed from."""
        step = self.state.global_step
        self.metrics.event("start", step, world_size=dist.world_size(), run_name=run_name(self.cfg))
        if resumed:
            self.metrics.event("resume", step, from_=self.checkpoints.plan.folder.name)

    def close(self, code: int) -> None:
        """The run's end event, the last plot and the trackers' finish; never raises (rank 0's
        plotting and trackers catch their own failures)."""
        self.metrics.event("end", self.state.global_step, exit_code=code)
        if self.plotter is not None:
            self.plotter.close(timeout=5.0 if code == EXIT_PREEMPTED else 30.0)
        self.metrics.close(code)

    def _end_preempted(self) -> bool:
        """Any rank signalled after the last boundary? Then an eval could outlast SLURM's grace time
        before the final save. Collective when preemption is on (a setting every rank shares)."""
        if not self.preemption.enabled:
            return False
        return dist.all_reduce_sum([1.0 if self.preemption.received else 0.0])[0] > 0

    def _boundary(self) -> Stop:
        """One all-reduce per step boundary: did any rank get a preemption signal, fail to prepare
        its next batch, or (rank 0) learn that another run took OUT's lease; and has every rank
        written its part of an --async_save in flight (``all_written``); the next step's label
        tokens (``step_labels``)? A failed batch raises on every rank (none waits in the next
        forward's all-gather), a lost lease LeaseLost; PREEMPTED to stop, else None. Collective."""
        error = self.data.ready()  # the prefetch ran during this step: normally done already
        labels = self.data.ahead_label_tokens()  # the next step's, for its loss (loss.py)
        signalled, failed, lost, writing, counted, total = dist.all_reduce_sum(
            [
                1.0 if self.preemption.received else 0.0,
                1.0 if error else 0.0,
                1.0 if self.lease_taken_over() else 0.0,
                1.0 if self.checkpoints.writing() else 0.0,
                0.0 if labels is None else 1.0,
                float(labels or 0),
            ]
        )
        self.all_written = writing == 0  # the save in flight's poll rides on this all-reduce
        self.step_labels = total if counted == dist.world_size() else None  # all ranks' ready
        if lost:
            raise LeaseLost(
                f"another run took over {self.cfg.ckpt.output_dir}'s lease "
                f"({describe_holder(self.cfg.ckpt.output_dir)})"
            )
        if failed:
            dist.run_agreed(lambda: _reraise(error))  # this rank's own error, or which rank failed
        return PREEMPTED if self.preemption.enabled and signalled > 0 else None

    def _due(self, every: int | None) -> bool:
        return bool(every) and self.state.global_step % every == 0

    def _train_step(self) -> bool:
        """One optimizer step over gradient-accumulation micro-batches; returns whether DeepSpeed
        applied it (the lr it used goes into the log window). No host sync of its own: the loss
        stays on the device."""
        engine = self.engine
        w = self.state.window
        t0 = time.perf_counter()
        batches = self.data.next_step()
        w.data_s += time.perf_counter() - t0
        if self.data.source_tokens is not None:  # --dataset_mixture
            w.source_tokens = [a + b for a, b in zip(w.source_tokens, self.data.source_tokens)]
        # the rate this step uses (the scheduler steps inside engine.step)
        w.lr = float(engine.get_lr()[0])
        steps = [model_inputs(b) for b in batches]
        # The step's loss is the mean over every label token of the step, across micro-batches
        # and ranks (transformers' num_items_in_batch), not a mean of micro-batch means (a
        # preference objective's: the pairs' mean, and ORPO's NLL over its tokens).
        labels = [self.data.count(inputs) for inputs, _, _ in steps]
        agreed = self.step_labels  # summed at the boundary, if it could
        self.step_labels = None
        items = items_per_micro_batch(sum(labels), len(steps), engine.device, agreed)
        for i, ((inputs, tokens, _), n) in enumerate(zip(steps, labels, strict=True)):
            w.tokens += tokens  # counted on the host copy: no device sync
            inputs = to_device(inputs, engine.device)  # DeepSpeed's forward does not move inputs
            if self.objective is not None:
                loss, stats = self._preference_loss(inputs, items)
                w.pair_sums = w.pair_sums + stats
            else:
                kwargs = {"num_items_in_batch": items} if self.loss_kwargs else {}
                out = engine(**inputs, **kwargs)
                loss = out.loss if self.loss_kwargs else rescaled(out, n, items)
            engine.backward(loss)  # the gradient of the step's token-loss sum / its label tokens
            if i == len(steps) - 1:  # the accumulation boundary: the optimizer step comes
                self.checkpoints.before_update()  # --async_save: its snapshot copied first
            engine.step()
            w.loss_sum = w.loss_sum + loss.detach().to(sum_dtype(engine.device))
            w.micro_batches += 1
        # Read after the last micro-batch's step(), the accumulation boundary: False means DeepSpeed
        # found non-finite gradients (an fp16 overflow, or a NaN/inf gradient norm under ZeRO-3) and
        # made neither an optimizer nor a scheduler step (engine.py _take_model_step).
        applied = engine.was_step_applied()
        w.steps += 1
        self.state.samples_seen += self.data.rows_per_step
        self.state.epoch = self.data.epoch_float
        self.state.sampler = self.data.sampler.state_dict()
        return applied

    def _preference_loss(
        self, inputs: dict, items: torch.Tensor | float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch of pairs: one forward of its chosen and rejected rows (no labels: the
        model computes no loss of its own), the reference's log-probabilities from the batch
        (precomputed) or the live reference, and the objective's loss and STATS."""
        labels = inputs.pop("labels")
        reference = None
        if "ref_chosen" in inputs:
            reference = (inputs.pop("ref_chosen"), inputs.pop("ref_rejected"))
        if self.reference is not None:
            reference = self.reference.logps(inputs, labels)
        logits = self.engine(**inputs).logits
        batch = {**inputs, "labels": labels}
        return self.objective.loss(logits, batch, reference, items)

    def _pair_sums(self, values: list[float]) -> torch.Tensor | list:
        """A log window's preference sums on the device (the same length on every rank)."""
        if self.objective is None:
            return []
        values = (list(values) + [0.0] * len(STATS))[: len(STATS)]
        return torch.tensor(values, dtype=torch.float64, device=self.engine.device)

    def _skipped(self) -> int | None:
        """Count an optimizer step DeepSpeed skipped (its batches stay consumed); the exit code when
        MAX_SKIPS_IN_A_ROW came in a row, else None.

        Every rank decides alike without a collective: DeepSpeed all-reduces the overflow flag (MAX
        over the data-parallel group, zero/stage3.py has_overflow) and the gradient norm (SUM) it
        also checks, so ``was_step_applied`` is the same on every rank at every step."""
        st = self.state
        st.skipped_steps += 1
        st.window.skipped_steps += 1
        self.skips_in_a_row += 1
        scale = loss_scale(self.engine)
        what = (
            f"loss scale now {scale:g}"
            if scale is not None
            else f"{self.cfg.train.precision}, no loss scale"
        )
        if self.skips_in_a_row < MAX_SKIPS_IN_A_ROW:
            # INFO: DeepSpeed has just logged its own "OVERFLOW! Skipping step";
            # this adds the counts.
            dist.log_main(
                logging.INFO,
                "after step %d: optimizer step skipped, non-finite gradients (%s); "
                "%d in a row, %d in all",
                st.global_step,
                what,
                self.skips_in_a_row,
                st.skipped_steps,
            )
            return None
        dist.log_main(
            logging.ERROR,
            "stopping: %d optimizer steps in a row skipped after step %d, non-finite gradients "
            "every time (%s). Try a lower --learning_rate, bf16 instead of fp16, or check the "
            "data; the last committed checkpoint is untouched.",
            self.skips_in_a_row,
            st.global_step,
            what,
        )
        self.stop_note = {
            "reason": "failed",
            "error": "non-finite gradients",
            "step": st.global_step,
            "skipped_in_a_row": self.skips_in_a_row,
            "skipped_steps": st.skipped_steps,
        }
        self.checkpoints.settle()  # an --async_save save in flight is of good weights: committed
        return 1

    def _log(self, bar: tqdm | None) -> None:
        """Reduce the window over ranks and write one metrics row. Collective."""
        w = self.state.window
        # A window restored from a checkpoint written before it recorded its lr: the next step's.
        lr = w.lr if w.lr is not None else float(self.engine.get_lr()[0])
        # float(): the window's one device sync; the all-reduce that follows is one anyway.
        loss_sum, micro, tokens, *rest = dist.all_reduce_sum(w.world_sums())
        by_source, pair_sums = rest[: len(w.source_tokens)], rest[len(w.source_tokens) :]
        now = time.perf_counter()
        loss = loss_sum / max(micro, 1)  # over the window's micro-batches, skipped steps' included
        # of this step: a row is only written at an applied one
        grad_norm = self.engine.get_global_grad_norm()
        # no step in this process yet (resumed at its last step): the saved one
        if grad_norm is None:
            grad_norm = w.grad_norm
        self.state.tokens_seen += int(tokens)
        seen = self.state.tokens_seen_by_source
        for name, n in zip(self.data.source_names, by_source):
            seen[name] = seen.get(name, 0) + int(n)
        row = {
            "step": self.state.global_step,
            "epoch": round(self.state.epoch, 4),
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": round(tokens / max(now - self.t_window, 1e-9), 2),
            "data_ms": round(1000 * w.data_s / max(w.steps, 1), 3),
            "samples_seen": self.state.samples_seen,
            "tokens_seen": self.state.tokens_seen,
            "skipped_steps": w.skipped_steps,
            "loss_scale": loss_scale(self.engine),
            **({"tokens_seen_by_source": dict(seen)} if self.data.source_names else {}),
            **(self.objective.metrics(pair_sums) if self.objective is not None else {}),
        }
        self.metrics.write(row)
        self.state.last_losses = (self.state.last_losses + [loss])[-10:]
        self.state.window = type(w)(
            source_tokens=[0] * len(self.data.source_names), pair_sums=self._pair_sums([])
        )
        self.t_window = now
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")

    def evaluate(self) -> float | None:
        """The eval sets' losses and metrics, one row in metrics.jsonl (evaluation.py): the one
        set's as eval_*, or each named set's as eval_<name>_* and all of them together as eval_*.
        Collective (every rank, same batches)."""
        sets = self.named_evals or {None: self.evalset}
        if any(ds is None or len(ds) == 0 for ds in sets.values()):
            return None
        self.engine.eval()
        ev = Evaluation(
            self.engine,
            self.cfg.train.per_device_eval_batch_size,
            self.tokenizer.pad_token_id,
            self.data,
        )
        row, total = {"step": self.state.global_step}, None
        for name, ds in sets.items():
            if self.objective is not None:
                sums = ev.pair_sums(ds, self._preference_loss)
            else:
                sums = ev.token_sums(ds)
            total = sums if total is None else [a + b for a, b in zip(total, sums, strict=True)]
            if name is not None:
                row |= self._eval_metrics(sums, metric_prefix(name))
        row = {"step": row.pop("step"), **self._eval_metrics(total, metric_prefix(None)), **row}
        self.metrics.write(row)
        self._evaluated(row)
        logger.info("step %d: %s", self.state.global_step, describe(row))
        if self.plotter is not None and not self.lease_taken_over():
            self.plotter.request()  # drawn on a thread; training goes on
        self.engine.train()
        return row["eval_loss"]

    def _eval_metrics(self, sums: list[float], prefix: str) -> dict:
        if self.objective is not None:
            return pair_metrics(self.objective, sums, prefix)
        return token_metrics(sums, prefix)

    # --- saves -------------------------------------------------------------------------------

    def _stop_preempted(self) -> int:
        """Every rank, after agreeing on a signal: commit this step (fast:
        partitioned only), exit 75."""
        step = self.state.global_step
        # collective: who was signalled
        first = dist.all_gather_object(self.preemption.received[:1])
        signals = ", ".join(f"{got[0]} on rank {r}" for r, got in enumerate(first) if got)
        self.stop_note = {"reason": "preempted", "signal": signals, "step": step}
        self.metrics.event("preempted", step, signal=signals)
        path, failure = self.checkpoints.at_preemption(step, signals)
        if failure is not None:
            self.stop_note["reason"] = "preempted, save failed"
            return 1
        if path is not None:
            dist.log_main(
                logging.WARNING,
                "preempted (%s): committed %s; exiting with %d so the job is requeued",
                signals,
                path,
                EXIT_PREEMPTED,
            )
        if self.cfg.ckpt.save_checkpoint:
            committed = self.checkpoints.committed_step
            self.stop_note["checkpoint"] = tag_for(committed) if committed is not None else None
        return EXIT_PREEMPTED
